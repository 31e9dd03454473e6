//! The segment header's atomic fields.

use super::word::{AtomicU32, AtomicU64, Ordering};
use std::mem::offset_of;

use super::field;
use crate::layout::{self, SegmentHeader};

/// The segment header's atomic fields.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HeaderPtr {
    ptr: *mut u8,
}

impl HeaderPtr {
    /// # Safety
    /// `ptr` is page aligned and `size_of::<SegmentHeader>()` bytes from it
    /// lie in a live shared mapping.
    pub(crate) unsafe fn new(ptr: *mut u8) -> Self {
        HeaderPtr { ptr }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `new`'s contract; `off` is an 8-aligned field offset.
        unsafe { field(self.ptr, off) }
    }

    fn writer_pid_word(&self) -> &AtomicU32 {
        // SAFETY: `new`'s contract; writer_pid is the 4-aligned u32 at offset 60.
        unsafe { field(self.ptr, offset_of!(SegmentHeader, writer_pid)) }
    }

    /// A copy of the whole header for validation (fields may be mid-update;
    /// only the immutable ones are trusted, after checks).
    pub(crate) fn read(&self) -> SegmentHeader {
        // SAFETY: `new`'s contract: 256 readable bytes at a page-aligned
        // address (so aligned for the struct). Callers trust only the fields
        // nobody writes after the stamp (sizes, nonce, flags, secret), and
        // check them; the live counters are read through the atomics.
        unsafe { super::read_header(self.ptr) }
    }

    /// Writes the header whole, with `magic` zero; [`HeaderPtr::stamp`] sets it.
    pub(crate) fn init(&self, header: &SegmentHeader) {
        // SAFETY: `new`'s contract: 256 writable bytes; only the creator calls
        // this, before the magic is stamped, so no reader trusts these bytes yet.
        unsafe { super::init_header(self.ptr, header) };
    }

    /// Stamps the magic last (Release): an opener that sees it sees the rest.
    pub(crate) fn stamp(&self) {
        // SAFETY: `new`'s contract: the magic is the aligned u64 at offset 0.
        unsafe { super::stamp(self.ptr, layout::MAGIC) };
    }

    /// Writer pid, for messages; 0 once the writer has closed the store.
    pub(crate) fn writer_pid(&self) -> u32 {
        self.writer_pid_word().load(Ordering::Acquire)
    }

    /// Marks the writer as gone (clean exit).
    pub(crate) fn clear_writer(&self) {
        self.writer_pid_word().store(0, Ordering::Release);
    }

    /// Ids below this were dropped by `clear`.
    pub(crate) fn cleared_below(&self) -> u64 {
        self.u64_at(offset_of!(SegmentHeader, cleared_below))
            .load(Ordering::Acquire)
    }

    /// Records a `clear`.
    pub(crate) fn set_cleared_below(&self, id: u64) {
        self.u64_at(offset_of!(SegmentHeader, cleared_below))
            .store(id, Ordering::Release);
    }

    /// Current epoch.
    #[inline]
    pub(crate) fn epoch(&self) -> u64 {
        self.u64_at(offset_of!(SegmentHeader, epoch))
            .load(Ordering::Acquire)
    }

    /// The allocator's cursor and high-water mark (for inspection).
    pub(crate) fn ring_extent(&self) -> (u64, u64) {
        (
            self.u64_at(offset_of!(SegmentHeader, cursor))
                .load(Ordering::Relaxed),
            self.u64_at(offset_of!(SegmentHeader, high_water))
                .load(Ordering::Relaxed),
        )
    }

    /// Publishes a new epoch.
    pub(crate) fn set_epoch(&self, e: u64) {
        self.u64_at(offset_of!(SegmentHeader, epoch))
            .store(e, Ordering::Release);
    }

    /// The id the next put gets.
    pub(crate) fn next_id(&self) -> u64 {
        self.u64_at(offset_of!(SegmentHeader, next_id))
            .load(Ordering::Acquire)
    }

    /// How much of the data region, from its start, the writer has backed:
    /// a reader touches no byte at or past it. Acquire, though a stale
    /// (smaller) answer only makes a read of a new object fail `Stale`: a
    /// reader that learned of the object through a synchronising channel
    /// (any real one) sees at least the value stored before its publish.
    #[inline]
    pub(crate) fn backed(&self) -> u64 {
        self.u64_at(offset_of!(SegmentHeader, backed))
            .load(Ordering::Acquire)
    }

    /// Publishes the backed extent (after the pages are allocated: Release,
    /// so a reader that sees it sees them).
    pub(crate) fn set_backed(&self, bytes: u64) {
        self.u64_at(offset_of!(SegmentHeader, backed))
            .store(bytes, Ordering::Release);
    }

    /// Publishes the next id, the allocator's cursor and its high-water
    /// mark (for attach and inspection).
    pub(crate) fn set_progress(&self, next_id: u64, cursor: u64, high_water: u64) {
        self.u64_at(offset_of!(SegmentHeader, next_id))
            .store(next_id, Ordering::Release);
        self.u64_at(offset_of!(SegmentHeader, cursor))
            .store(cursor, Ordering::Relaxed);
        self.u64_at(offset_of!(SegmentHeader, high_water))
            .store(high_water, Ordering::Relaxed);
    }

    /// The key index's sequence word (see `crate::atomics::index`).
    #[inline]
    pub(crate) fn index_seq(&self) -> &AtomicU64 {
        self.u64_at(offset_of!(SegmentHeader, index_seq))
    }
}
