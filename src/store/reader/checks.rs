//! The reader's checks of a slot against a handle: where the handle
//! points, the id, the keyed tag, size and kind against the data region
//! and the backed extent. Every word read from shared memory is checked
//! here before the read path trusts it.

use super::StoreReader;
use crate::atomics::SlotPtr;
use crate::error::Result;
use crate::layout::{self, ObjectKind};
use crate::store::handle::ObjectHandle;

impl StoreReader {
    pub(super) fn slot(&self, h: ObjectHandle) -> Result<SlotPtr> {
        self.find_slot(h).map_err(|why| self.stale(h, why))
    }

    /// The slot `h` names, if it lies in what the writer has backed; else
    /// why not.
    #[inline]
    pub(super) fn find_slot(&self, h: ObjectHandle) -> std::result::Result<SlotPtr, &'static str> {
        if h.monotonic_id == 0 {
            return Err("id 0 is never used");
        }
        let slot = self
            .at
            .geo
            .slot(h.address)
            .ok_or("address out of range or misaligned")?;
        // Before any byte of it is touched: a read fault on a page the
        // writer never backed would allocate it (and raise SIGBUS on a full
        // /dev/shm). `geo.slot` checked that this cannot overflow.
        if !self.within_backed(h.address + self.at.geo.prefix_len) {
            return Err("address past what the writer has written");
        }
        Ok(slot)
    }

    /// Whether the data region's first `end` bytes are backed: against
    /// the extent seen before (`backed` only grows, so what was backed then
    /// is backed now), else against the shared word, loaded again (Acquire,
    /// as every load of it: the pages exist before a byte of them is
    /// touched, whichever load saw them).
    #[inline]
    pub(super) fn within_backed(&self, end: u64) -> bool {
        if end <= self.backed_seen.get() {
            return true;
        }
        let backed = self.at.geo.header().backed();
        self.backed_seen.set(backed);
        end <= backed
    }

    /// Given the slot's id as just loaded, checks it, the tag and the size
    /// against the handle and the process-local bounds.
    pub(super) fn validate_slot(&self, h: ObjectHandle, slot: &SlotPtr, id: u64) -> Result<Valid> {
        self.check_slot(h, slot, id)
            .map_err(|why| self.stale(h, why))
    }

    /// As [`StoreReader::validate_slot`], counting nothing: why not, if not.
    #[inline]
    pub(super) fn check_slot(
        &self,
        h: ObjectHandle,
        slot: &SlotPtr,
        id: u64,
    ) -> std::result::Result<Valid, &'static str> {
        if id != h.monotonic_id {
            return Err("id mismatch");
        }
        let (tag, size, kind) = slot.meta();
        self.check_meta(h, tag, size, kind, self.tag_for(h, size, kind))
    }

    /// The tag a slot of `h` holds if its size and kind are these.
    #[inline]
    pub(super) fn tag_for(&self, h: ObjectHandle, size: u64, kind: u32) -> u64 {
        layout::keyed_slot_tag(self.tag_key, h.monotonic_id, h.address, h.epoch, size, kind)
    }

    /// The tag `h`'s slot should hold for the size and kind it shows
    /// before the hazard is published: a guess, worked out ahead so that
    /// its arithmetic overlaps the hazard's fence instead of following
    /// the id's load. Trusted for nothing: [`StoreReader::check_held`]
    /// uses it only for the very size and kind it loads after the id.
    #[inline]
    pub(super) fn expect(&self, h: ObjectHandle, slot: &SlotPtr) -> Expected {
        let (_, size, kind) = slot.meta();
        Expected {
            size,
            kind,
            tag: self.tag_for(h, size, kind),
        }
    }

    /// As [`StoreReader::check_slot`] (the same checks of the same words,
    /// loaded after the id), with the tag worked out ahead by
    /// [`StoreReader::expect`] where the size and kind are the ones it saw.
    #[inline]
    pub(super) fn check_held(
        &self,
        h: ObjectHandle,
        slot: &SlotPtr,
        id: u64,
        pre: Expected,
    ) -> std::result::Result<Valid, &'static str> {
        if id != h.monotonic_id {
            return Err("id mismatch");
        }
        let (tag, size, kind) = slot.meta();
        let want = if (size, kind) == (pre.size, pre.kind) {
            pre.tag
        } else {
            self.tag_for(h, size, kind)
        };
        self.check_meta(h, tag, size, kind, want)
    }

    /// The checks of a slot's header words, loaded after an id that
    /// matched `h`: its tag against `want` (the keyed tag of `h` with this
    /// size and kind), its size against the data region and the backed
    /// extent, its kind.
    #[inline]
    pub(super) fn check_meta(
        &self,
        h: ObjectHandle,
        tag: u64,
        size: u64,
        kind: u32,
        want: u64,
    ) -> std::result::Result<Valid, &'static str> {
        if tag != want {
            return Err("tag mismatch (other epoch or segment, or a corrupted slot header)");
        }
        let data = self
            .at
            .geo
            .payload(h.address, size)
            .ok_or("size runs past the data region")?;
        // `payload` checked that this sum stays within the capacity.
        if !self.within_backed(h.address + self.at.geo.prefix_len + size) {
            return Err("size runs past what the writer has written");
        }
        let kind =
            ObjectKind::from_code(kind).ok_or("unknown object kind (a corrupted slot header)")?;
        Ok(Valid {
            data,
            len: size as usize,
            kind,
            tag,
        })
    }
}

/// What [`StoreReader::validate_slot`] found: the payload's start and
/// length in this process's mapping, its kind, and the tag it checked.
#[derive(Clone, Copy)]
pub(super) struct Valid {
    pub(super) data: *const u8,
    pub(super) len: usize,
    pub(super) kind: ObjectKind,
    pub(super) tag: u64,
}

/// What [`StoreReader::expect`] worked out before a hazard: the size and
/// kind a slot showed, and the tag a slot of the handle with them holds.
#[derive(Clone, Copy)]
pub(super) struct Expected {
    size: u64,
    kind: u32,
    tag: u64,
}
