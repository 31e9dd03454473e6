//! A reader's attachment ([`Attached`]): its entry in the reader table,
//! the mapping and its liveness lock, shared by a
//! [`StoreReader`](super::StoreReader) and every guard and lease it made.

use std::sync::Arc;

use super::handle::ObjectHandle;
use super::mapping::Mapping;
use crate::atomics::{ReaderPtr, SlotPtr};
use crate::error::{Error, Result};
use crate::geometry::StoreGeometry;
use crate::layout::reader_state;
use crate::sys::clock;
use crate::sys::fork;
use crate::sys::liveness;

/// A reader's attachment: its entry in the reader table (and the liveness
/// lock, through the mapping), shared by the `StoreReader` and each of its
/// guards. The entry is left when the last of them goes, so a guard that
/// outlives its reader still holds its slot, under a live entry, in a
/// mapping that stays.
#[derive(Debug)]
pub(super) struct Attached {
    pub(super) geo: StoreGeometry,
    pub(super) index: u32,
    pub(super) me: ReaderPtr,
    pub(super) counted_from: u64,
    /// Our state word in the reader table while we hold the entry.
    pub(super) word: u64,
    /// The fork generation this reader attached in (see `sys::fork`): in a
    /// forked child it reads nothing and writes nothing shared.
    pub(super) fork_gen: u64,
    /// The segment (our reader lock held through it), shared with copies
    /// in flight out of it.
    pub(super) map: Arc<Mapping>,
}

// SAFETY: the pointers point into the mapping `map` keeps alive, which
// moves with the reader. Through `&Attached` only atomics of shared memory
// are touched (acknowledge and unhold are RMWs), never the hazard word,
// which only the non-`Sync` `StoreReader` writes.
unsafe impl Send for Attached {}
// SAFETY: as above: every shared write through `&Attached` is an atomic
// RMW or a store of a value only its own process writes.
unsafe impl Sync for Attached {}

impl Attached {
    /// Whether this is the process that attached (not a forked child).
    #[inline]
    pub(super) fn is_owner(&self) -> bool {
        fork::current() == self.fork_gen
    }

    #[inline]
    pub(super) fn check_owner(&self) -> Result<()> {
        if self.is_owner() {
            Ok(())
        } else {
            Err(self.forked())
        }
    }

    #[cold]
    #[inline(never)]
    pub(super) fn forked(&self) -> Error {
        Error::Forked {
            name: self.map.seg().name().to_owned(),
        }
    }

    /// Whether our reader entry is still ours (see [`Self::check_entry`]).
    #[inline]
    pub(super) fn entry_is_ours(&self) -> bool {
        self.me.word() == self.word
    }

    #[cold]
    #[inline(never)]
    pub(super) fn entry_lost(&self) -> Error {
        tracing::warn!(reader = self.index, "reader entry was taken from us");
        Error::ReaderLeft { index: self.index }
    }

    /// `Err(Forked)` in a forked child, else as [`Self::check_entry`].
    pub(super) fn check_attached(&self) -> Result<()> {
        self.check_owner()?;
        self.check_entry()
    }

    /// `Err(ReaderLeft)` if our reader entry is no longer ours: the writer
    /// marks an entry left only once the kernel has released its lock, which
    /// ours never is while we live, so this catches a scribbled table.
    #[inline]
    pub(super) fn check_entry(&self) -> Result<()> {
        if self.entry_is_ours() {
            Ok(())
        } else {
            Err(self.entry_lost())
        }
    }

    /// This reader's attach generation (what its hold words carry).
    #[inline]
    pub(super) fn generation(&self) -> u64 {
        reader_state::generation(self.word)
    }

    /// Gives back the hold of a guard that is going.
    pub(super) fn release_hold(&self, slot: &SlotPtr) {
        // A forked child's guard: the hold is the parent's.
        if self.is_owner() {
            slot.unhold(self.index);
        }
    }

    /// What dropping a guard does: acknowledges its read, then gives its
    /// hold back (as [`Self::ack_held`] then [`Self::release_hold`], the
    /// fork generation checked once). In a forked child, nothing: the hold
    /// and the read are the parent's.
    #[inline(always)]
    pub(super) fn drop_guard(&self, slot: &SlotPtr, h: ObjectHandle) {
        if !self.is_owner() {
            return;
        }
        if self.entry_is_ours() {
            self.ack_counted(slot, h);
        }
        slot.unhold(self.index);
    }

    /// Acknowledges a read of a slot this reader holds (hazard or hold).
    #[inline]
    pub(super) fn ack_held(&self, slot: &SlotPtr, h: ObjectHandle) {
        if self.check_attached().is_err() {
            return;
        }
        self.ack_counted(slot, h);
    }

    /// The acknowledgement of [`Self::ack_held`], once the entry is known
    /// to be ours in the process that attached.
    #[inline]
    fn ack_counted(&self, slot: &SlotPtr, h: ObjectHandle) {
        let counted = if self.geo.aggregate {
            // vLLM's accounting: every read counts, from any reader.
            slot.acknowledge_aggregate();
            true
        } else {
            h.monotonic_id >= self.counted_from && slot.acknowledge(self.index)
        };
        if counted {
            self.me.set_last_ack_ns(clock::monotonic_ns());
        }
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        if !self.is_owner() {
            // A forked child's copy: the entry and its lock are the
            // parent's. Only our mapping goes.
            return;
        }
        // The reader and every guard are gone (a guard leaked with
        // mem::forget leaks its share, so this never runs): no hold of
        // ours is left, and no get can start. Leave the table. The lock
        // goes with the mapping, once copies in flight let it go.
        self.me.clear_hazard();
        let left = reader_state::word(reader_state::generation(self.word), reader_state::LEFT);
        self.me.transition(self.word, left);
        self.map.seg().unlock(liveness::reader_slot(self.index));
        tracing::debug!(
            name = self.map.seg().name(),
            index = self.index,
            "reader detached"
        );
    }
}
