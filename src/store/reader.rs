//! One reader of a store: [`StoreReader`].

use std::cell::Cell;

use super::config::{ObjectHandle, ReaderOptions, StoreHandle};
use super::guard::ReadGuard;
use crate::error::{Error, Result};
use crate::geometry::{validate_header, Geometry};
use crate::layout::{self, reader_state, ObjectKind};
use crate::shm::{ReaderPtr, SlotPtr};
use crate::sys::clock;
use crate::sys::segment::{self, Segment};

/// Opens and validates a segment against the expectations of a handle.
fn open_validated(sh: &StoreHandle, prefault: bool) -> Result<(Segment, Geometry)> {
    let seg = Segment::open(&sh.name, prefault)?;
    let geo = validate_header(&seg, &sh.name)?;
    let bad = |field, want: u64, got: u64| Error::BadHeader {
        name: sh.name.clone(),
        field,
        detail: format!("the handle says {want}, the segment says {got}"),
    };
    if sh.layout_version != layout::LAYOUT_VERSION {
        return Err(bad(
            "layout_version",
            layout::LAYOUT_VERSION as u64,
            sh.layout_version as u64,
        ));
    }
    let nonce = geo.header().read().nonce;
    if nonce != sh.nonce {
        return Err(Error::SegmentMismatch {
            name: sh.name.clone(),
            expected: sh.nonce,
            found: nonce,
        });
    }
    if geo.capacity != sh.capacity {
        return Err(bad("capacity", sh.capacity, geo.capacity));
    }
    if geo.n_readers != sh.n_readers {
        return Err(bad("n_readers", sh.n_readers as u64, geo.n_readers as u64));
    }
    if geo.max_object_size != sh.max_object_size {
        return Err(bad(
            "max_object_size",
            sh.max_object_size,
            geo.max_object_size,
        ));
    }
    Ok((seg, geo))
}

/// One reader of a store, attached into a reader slot until dropped.
///
/// A `StoreReader` is `Send` but not `Sync`: one per thread (each thread of
/// a process attaches its own, as each takes one of `n_readers` slots).
#[derive(Debug)]
pub struct StoreReader {
    geo: Geometry,
    index: u32,
    me: ReaderPtr,
    counted_from: u64,
    /// Bit k set: hazard word k is in use by a live guard.
    hazards_used: Cell<u64>,
    /// Unregistered before `seg` unmaps (fields drop in order).
    pinned: Option<crate::pin::Pinned>,
    seg: Segment,
}

// SAFETY: the pointers point into `seg`, which moves with the reader; the
// reader's own state (Cell) is not shared, since StoreReader is not Sync.
unsafe impl Send for StoreReader {}

impl StoreReader {
    /// Attaches into the first free reader slot (pinning: `PinMode::Auto`).
    pub fn attach(sh: &StoreHandle) -> Result<StoreReader> {
        Self::attach_with(sh, ReaderOptions::default())
    }

    /// Attaches as reader `index` (a tensor-parallel rank, say).
    pub fn attach_as(sh: &StoreHandle, index: u32) -> Result<StoreReader> {
        Self::attach_with(sh, ReaderOptions::default().index(index))
    }

    /// Attaches with explicit options.
    pub fn attach_with(sh: &StoreHandle, opts: ReaderOptions) -> Result<StoreReader> {
        let (seg, geo) = open_validated(sh, opts.prefault)?;
        let (index, counted_from) = match opts.index {
            Some(index) => {
                if index >= geo.n_readers {
                    return Err(Error::ReaderIndexOutOfRange {
                        index,
                        n_readers: geo.n_readers,
                    });
                }
                let from = claim(&geo, index)?.ok_or_else(|| Error::ReaderSlotTaken {
                    index,
                    pid: geo.reader(index).owner().0,
                })?;
                (index, from)
            }
            None => {
                let mut found = None;
                for i in 0..geo.n_readers {
                    if let Some(from) = claim(&geo, i)? {
                        found = Some((i, from));
                        break;
                    }
                }
                found.ok_or(Error::NoReaderSlot {
                    n_readers: geo.n_readers,
                })?
            }
        };
        let me = geo.reader(index);
        let pinned = match crate::pin::pin(seg.as_ptr(), seg.len(), opts.pin) {
            Ok(p) => p,
            Err(e) => {
                // Give the slot back before failing: an entry that was never
                // attached stays expected (counted), one taken over stays left.
                me.set_state(if counted_from == 0 {
                    reader_state::VACANT
                } else {
                    reader_state::LEFT
                });
                return Err(e);
            }
        };
        tracing::debug!(name = %sh.name, index, counted_from, pinned = pinned.is_some(), "reader attached");
        Ok(StoreReader {
            geo,
            index,
            me,
            counted_from,
            hazards_used: Cell::new(0),
            pinned,
            seg,
        })
    }

    /// This reader's index in the reader table.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The segment's name.
    pub fn name(&self) -> &str {
        self.seg.name()
    }

    /// Whether this process's mapping is page-locked for DMA.
    pub fn is_pinned(&self) -> bool {
        self.pinned.is_some()
    }

    /// A zero-copy view of the object. Its read is acknowledged when the
    /// guard drops; until then the writer cannot reuse the slot.
    pub fn get(&self, h: ObjectHandle) -> Result<ReadGuard<'_>> {
        let slot = self.slot(h)?;
        let k = self.take_hazard()?;
        self.me.set_hazard(k, h.monotonic_id);
        match self.validate(h, &slot, slot.id_after_hazard()) {
            Ok((data, len, kind)) => Ok(ReadGuard {
                reader: self,
                slot,
                hazard: k,
                handle: h,
                data,
                len,
                kind,
            }),
            Err(e) => {
                self.release_hazard(k);
                Err(e)
            }
        }
    }

    /// An owned copy of the object; its read is acknowledged before return.
    ///
    /// The copy is optimistic (seqlock): if the writer reuses the slot while
    /// it is being copied, which it can only do when this reader owes no
    /// read of the object, the copy is discarded and `Stale` returned.
    pub fn get_copy(&self, h: ObjectHandle) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.get_copy_into(h, &mut out)?;
        Ok(out)
    }

    /// As [`StoreReader::get_copy`], into `out` (cleared first, its capacity
    /// reused): no allocation, and no page faults on a buffer used before.
    pub fn get_copy_into(&self, h: ObjectHandle, out: &mut Vec<u8>) -> Result<()> {
        let slot = self.slot(h)?;
        let (data, len, _) = self.validate(h, &slot, slot.id_acquire())?;
        out.clear();
        out.reserve(len);
        // SAFETY: `data..data+len` lies in the data region (validate checked
        // it against the process-local capacity) and `out` has room for len
        // bytes. The writer may be rewriting these bytes (only if this read
        // is not counted); such a copy is detected below and discarded.
        unsafe {
            std::ptr::copy_nonoverlapping(data, out.as_mut_ptr(), len);
        }
        if slot.id_recheck() != h.monotonic_id {
            return Err(self.stale(h, "slot reused during the copy"));
        }
        // SAFETY: the first len bytes were initialised by the copy.
        unsafe { out.set_len(len) };
        // The bytes are whole; if the slot has gone since, there is nothing
        // left to acknowledge.
        let _ = self.acknowledge(h);
        Ok(())
    }

    /// Acknowledges one read of `h` without reading it.
    pub fn touch(&self, h: ObjectHandle) -> Result<()> {
        self.acknowledge(h)
    }

    // ---- internals ----

    fn stale(&self, h: ObjectHandle, why: &'static str) -> Error {
        tracing::debug!(
            reader = self.index,
            address = h.address,
            id = h.monotonic_id,
            why,
            "stale read"
        );
        self.me.count_stale();
        // A stale handle from a writer that is gone will never become good:
        // say so (checked only on this error path).
        if let Err(gone) = self.check_writer() {
            return gone;
        }
        Error::Stale {
            address: h.address,
            monotonic_id: h.monotonic_id,
        }
    }

    /// Whether the writer that created this segment still runs.
    pub fn writer_alive(&self) -> bool {
        let (pid, start) = self.geo.header().writer();
        pid != 0 && segment::process_alive(pid, start)
    }

    /// `Err(WriterGone)` if the writer has exited or died. Objects already
    /// published stay readable; nothing new will come.
    pub fn check_writer(&self) -> Result<()> {
        if self.writer_alive() {
            Ok(())
        } else {
            Err(Error::WriterGone {
                name: self.seg.name().to_owned(),
            })
        }
    }

    fn slot(&self, h: ObjectHandle) -> Result<SlotPtr> {
        if h.monotonic_id == 0 {
            return Err(self.stale(h, "id 0 is never used"));
        }
        self.geo
            .slot(h.address)
            .ok_or_else(|| self.stale(h, "address out of range or misaligned"))
    }

    /// Given the slot's id as just loaded, checks it, the tag and the size
    /// against the handle and the process-local bounds.
    fn validate(
        &self,
        h: ObjectHandle,
        slot: &SlotPtr,
        id: u64,
    ) -> Result<(*const u8, usize, ObjectKind)> {
        if id != h.monotonic_id {
            return Err(self.stale(h, "id mismatch"));
        }
        let (tag, size, kind) = slot.meta();
        if tag != layout::slot_tag(h.monotonic_id, h.address, h.epoch, size, kind) {
            return Err(self.stale(
                h,
                "tag mismatch (other epoch or segment, or a corrupted slot header)",
            ));
        }
        let data = self
            .geo
            .payload(h.address, size)
            .ok_or_else(|| self.stale(h, "size runs past the data region"))?;
        let kind = ObjectKind::from_code(kind)
            .ok_or_else(|| self.stale(h, "unknown object kind (a corrupted slot header)"))?;
        Ok((data, size as usize, kind))
    }

    fn take_hazard(&self) -> Result<usize> {
        let used = self.hazards_used.get();
        if used == u64::MAX {
            return Err(Error::TooManyGuards {
                limit: layout::HAZARDS_PER_READER,
            });
        }
        let k = (!used).trailing_zeros() as usize;
        self.hazards_used.set(used | 1 << k);
        Ok(k)
    }

    pub(super) fn release_hazard(&self, k: usize) {
        self.me.clear_hazard(k);
        self.hazards_used.set(self.hazards_used.get() & !(1 << k));
    }

    /// Counts one read of `h`, under a hazard so the slot cannot be reused
    /// while the counter is written.
    fn acknowledge(&self, h: ObjectHandle) -> Result<()> {
        let slot = self.slot(h)?;
        let k = self.take_hazard()?;
        self.me.set_hazard(k, h.monotonic_id);
        let r = self
            .validate(h, &slot, slot.id_after_hazard())
            .map(|_| self.ack_held(&slot, h));
        self.release_hazard(k);
        r
    }

    /// Acknowledges a read of a slot this reader holds a hazard on.
    pub(super) fn ack_held(&self, slot: &SlotPtr, h: ObjectHandle) {
        if h.monotonic_id >= self.counted_from && slot.acknowledge(self.index) {
            self.me.set_last_ack_ns(clock::monotonic_ns());
        }
    }
}

impl Drop for StoreReader {
    fn drop(&mut self) {
        // No guard can be alive (they borrow self): leave the table.
        self.me.clear_all_hazards();
        self.me.set_state(reader_state::LEFT);
        tracing::debug!(
            name = self.seg.name(),
            index = self.index,
            "reader detached"
        );
    }
}

/// Takes reader entry `i` if it is free (never used, left, or its process
/// died); returns the first id this reader is counted for.
fn claim(geo: &Geometry, i: u32) -> Result<Option<u64>> {
    let r = geo.reader(i);
    let pid = std::process::id();
    let start = segment::own_start_time();
    match r.state() {
        reader_state::VACANT if r.transition(reader_state::VACANT, reader_state::ATTACHED) => {
            // Counted from the start: the writer has been waiting for it.
            r.set_attached_ns(clock::monotonic_ns());
            r.set_owner(pid, start);
            r.bump_generation();
            return Ok(Some(0));
        }
        s @ (reader_state::LEFT | reader_state::ATTACHED) => {
            if s == reader_state::ATTACHED {
                let (p, st) = r.owner();
                if p == 0 || segment::process_alive(p, st) {
                    return Ok(None);
                }
            }
            if r.transition(s, reader_state::ATTACHING) {
                // Not counted while attaching; start counting from the next
                // put so nothing of the previous holder is inherited.
                r.clear_all_hazards();
                let from = geo.header().next_id();
                r.set_counted_from(from);
                r.set_attached_ns(clock::monotonic_ns());
                r.set_owner(pid, start);
                r.bump_generation();
                r.set_state(reader_state::ATTACHED);
                return Ok(Some(from));
            }
        }
        _ => {}
    }
    Ok(None)
}
