//! Layer 2: the single-writer ring inside the data region.
//!
//! Two halves:
//!
//! * [`Ring`]: pure arithmetic over virtual positions, kept in the writer's
//!   own memory (never read back from shared memory). Positions only grow; a
//!   slot's address is `pos % capacity`. A slot never straddles the end: an
//!   allocation that would is moved to the next lap and the skipped tail
//!   counts as used until the slot before it is freed. Tested under Miri.
//! * [`SlotPtr`], [`ReaderPtr`], [`HeaderPtr`]: the only code that touches the
//!   atomics of a segment. **Every memory ordering of the crate is chosen
//!   here**, next to the field it guards:
//!
//! | field | written by | read by | protocol |
//! |---|---|---|---|
//! | `SlotHeader::id` | writer: 0 (Relaxed + Release fence) before reuse, the new id (Release) to publish, 0 (Relaxed + SeqCst fence) to reclaim, old id (Release) to back off | readers: Acquire (optimistic copy; after the hazard's SeqCst fence) | seqlock publish / validate; Dekker pair with `hazards` |
//! | `SlotHeader::refs` | writer (Release) on put / get_cached | readers (Acquire) before acknowledging | a reader acknowledges only while `reads < refs` |
//! | `reads[i]` | reader `i` only (Release) | writer (Acquire) before reclaiming | the reader's reads of the payload happen before the writer's reuse |
//! | `ReaderEntry::hazards[k]` | reader (Relaxed + SeqCst fence to set, Release to clear) | writer (Acquire, after its SeqCst fence) | Dekker through two SeqCst fences: one side sees the other |
//! | `ReaderEntry::state` | reader (SeqCst), writer marks dead (SeqCst CAS) | writer (SeqCst, after its fence) | a reader attaching while the writer reclaims is seen by one side |
//!
//! Reclaiming slot S (writer): check every counted reader's `reads[i] >= refs`
//! (Acquire); store `id = 0` then a SeqCst fence; scan the hazards of every
//! reader not `LEFT` (Acquire). A hazard equal to the old id means a guard may be
//! reading: store the old id back and stop. Getting a guard (reader): store
//! the id in a free hazard, then a SeqCst fence, then load `id`
//! (Acquire); a mismatch clears the hazard and reports `Stale`. The two
//! SeqCst fences are ordered one way or the other: if the reader's comes
//! first, the writer's scan sees the hazard (it backs off); if the
//! writer's comes first, the reader's load sees 0 (it backs off). A guarded
//! slot is never reused. (Fences rather than SeqCst accesses: the same
//! cost on x86, and loom can check them; see tests/loom.rs.)
//!
//! Copying out without a hazard (`get_copy`): load `id` (Acquire), copy,
//! Acquire fence, load `id` again; a change means the slot was reused under
//! the copy, which is then thrown away (`Stale`): a torn read is never
//! returned.

use std::collections::VecDeque;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use crate::layout::{self, ReaderEntry, SegmentHeader, SlotHeader};
use std::mem::offset_of;

/// One allocation of the ring.
#[derive(Debug, Clone)]
pub struct Span<T> {
    /// Virtual start position.
    pub pos: u64,
    /// The caller's bookkeeping.
    pub value: T,
}

/// FIFO allocator over `capacity` bytes (writer memory only).
#[derive(Debug)]
pub struct Ring<T> {
    capacity: u64,
    tail: u64,
    spans: VecDeque<Span<T>>,
}

impl<T> Ring<T> {
    /// An empty ring of `capacity` bytes (> 0).
    pub fn new(capacity: u64) -> Self {
        assert!(capacity > 0, "ring capacity must be positive");
        Ring {
            capacity,
            tail: 0,
            spans: VecDeque::new(),
        }
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Virtual position of the oldest slot (or the tail when empty).
    pub fn head(&self) -> u64 {
        self.spans.front().map_or(self.tail, |s| s.pos)
    }

    /// Virtual position one past the newest slot.
    pub fn tail(&self) -> u64 {
        self.tail
    }

    /// Bytes between head and tail (live slots plus skipped lap ends).
    pub fn used(&self) -> u64 {
        self.tail - self.head()
    }

    /// Physical address of a virtual position.
    pub fn address(&self, pos: u64) -> u64 {
        pos % self.capacity
    }

    /// Largest allocation that would succeed now.
    pub fn largest_free(&self) -> u64 {
        if self.spans.is_empty() {
            return self.capacity;
        }
        let head = self.head();
        let free = self.capacity - (self.tail - head);
        let to_end = self.capacity - self.tail % self.capacity;
        // Either up to the end of this lap, or from the next lap's start up to head.
        if to_end >= free {
            free
        } else {
            to_end.max(free - to_end)
        }
    }

    /// Where a slot of `len` bytes would start, without taking it.
    pub fn reserve(&self, len: u64) -> Option<u64> {
        if len == 0 || len > self.capacity {
            return None;
        }
        let (tail, head) = if self.spans.is_empty() {
            // An empty ring restarts at the beginning of a lap: no skip needed.
            let t = self.tail.div_ceil(self.capacity) * self.capacity;
            (t, t)
        } else {
            (self.tail, self.head())
        };
        let phys = tail % self.capacity;
        let start = if phys + len > self.capacity {
            tail + (self.capacity - phys)
        } else {
            tail
        };
        (start + len - head <= self.capacity).then_some(start)
    }

    /// Takes the slot `reserve` proposed.
    pub fn commit(&mut self, pos: u64, len: u64, value: T) {
        debug_assert_eq!(Some(pos), self.reserve(len));
        self.tail = pos + len;
        self.spans.push_back(Span { pos, value });
    }

    /// The oldest slot.
    pub fn front(&self) -> Option<&Span<T>> {
        self.spans.front()
    }

    /// Whether no slot is live.
    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Frees the oldest slot.
    pub fn pop_front(&mut self) -> Option<Span<T>> {
        self.spans.pop_front()
    }

    /// Live slots, oldest first, mutable bookkeeping.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Span<T>> {
        self.spans.iter_mut()
    }

    /// Number of live slots.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// The live slot whose value matches `key`, by binary search on a key
    /// that grows with position (the monotonic id).
    pub fn find_by<K: Ord>(&self, key: K, f: impl Fn(&T) -> K) -> Option<&Span<T>> {
        let i = self
            .spans
            .binary_search_by(|s| f(&s.value).cmp(&key))
            .ok()?;
        self.spans.get(i)
    }

    /// As [`Ring::find_by`], mutable.
    pub fn find_by_mut<K: Ord>(&mut self, key: K, f: impl Fn(&T) -> K) -> Option<&mut Span<T>> {
        // The newest slot is the common case (publishing a put).
        let i = match self.spans.back() {
            Some(b) if f(&b.value) == key => self.spans.len() - 1,
            _ => self
                .spans
                .binary_search_by(|s| f(&s.value).cmp(&key))
                .ok()?,
        };
        self.spans.get_mut(i)
    }
}

/// The atomic of type `A` at byte `off` from `base`, for the pointer types
/// below (the one place shared memory is turned into atomics).
///
/// # Safety
/// `base + off` is aligned for `A`, lies with `size_of::<A>()` bytes inside a
/// live mapping, and that mapping outlives `'a`.
unsafe fn field<'a, A>(base: *mut u8, off: usize) -> &'a A {
    // SAFETY: the caller's contract; atomics have no invalid bit patterns.
    unsafe { &*(base.add(off) as *const A) }
}

/// A slot's prefix (header and reader counters) in shared memory.
#[derive(Clone, Copy, Debug)]
pub struct SlotPtr {
    ptr: *mut u8,
}

impl SlotPtr {
    /// # Safety
    /// 1. `ptr` is 64-byte aligned and points into a live shared mapping.
    /// 2. `slot_prefix_len(n_readers)` bytes from `ptr` lie inside it, for the
    ///    `n_readers` later passed to [`SlotPtr::reads`].
    pub unsafe fn new(ptr: *mut u8) -> Self {
        SlotPtr { ptr }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `new`'s contract: the prefix is mapped and 64-aligned, `off`
        // is an 8-aligned field offset inside the 64-byte SlotHeader.
        unsafe { field(self.ptr, off) }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        // SAFETY: as `u64_at`, with a 4-aligned offset (header or counters).
        unsafe { field(self.ptr, off) }
    }

    /// The id word.
    fn id(&self) -> &AtomicU64 {
        self.u64_at(offset_of!(SlotHeader, id))
    }

    /// Reader `i`'s acknowledged-read counter.
    fn reads(&self, i: u32) -> &AtomicU32 {
        self.u32_at(size_of::<SlotHeader>() + 4 * i as usize)
    }

    // ---- writer ----

    /// Marks the slot as being written. Any reader that sees one of the
    /// writes that follow sees `id == 0` (or the new id) when it re-checks.
    pub fn begin_write(&self) {
        self.id().store(0, Ordering::Relaxed);
        fence(Ordering::Release);
    }

    /// Marks `len` bytes from here as skipped (no object; for inspection).
    pub fn mark_skip(&self, len: u64) {
        self.begin_write();
        self.u64_at(offset_of!(SlotHeader, slot_len))
            .store(len, Ordering::Relaxed);
        self.u64_at(offset_of!(SlotHeader, size))
            .store(0, Ordering::Relaxed);
    }

    /// Fills the header and zeroes the counters, then publishes `id`
    /// (Release: the payload written before is visible to whoever sees it).
    #[allow(clippy::too_many_arguments)]
    pub fn publish(
        &self,
        id: u64,
        tag: u64,
        size: u64,
        slot_len: u64,
        kind: u32,
        epoch: u64,
        n_readers: u32,
    ) {
        let r = Ordering::Relaxed;
        self.u64_at(offset_of!(SlotHeader, tag)).store(tag, r);
        self.u64_at(offset_of!(SlotHeader, size)).store(size, r);
        self.u64_at(offset_of!(SlotHeader, slot_len))
            .store(slot_len, r);
        self.u32_at(offset_of!(SlotHeader, refs)).store(1, r);
        self.u32_at(offset_of!(SlotHeader, kind)).store(kind, r);
        self.u64_at(offset_of!(SlotHeader, epoch)).store(epoch, r);
        for i in 0..n_readers {
            self.reads(i).store(0, r);
        }
        self.id().store(id, Ordering::Release);
    }

    /// Publishes a new reference count (one more expected read per reader).
    pub fn set_refs(&self, refs: u32) {
        self.u32_at(offset_of!(SlotHeader, refs))
            .store(refs, Ordering::Release);
    }

    /// Reader `i`'s acknowledged reads; Acquire pairs with the reader's
    /// Release so its reads of the payload happen before any reuse.
    pub fn reads_acquire(&self, i: u32) -> u32 {
        self.reads(i).load(Ordering::Acquire)
    }

    /// First half of reclaiming: no new guard can validate after this.
    pub fn invalidate(&self) {
        self.id().store(0, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Backs off a reclaim that found a hazard.
    pub fn restore(&self, id: u64) {
        self.id().store(id, Ordering::Release);
    }

    // ---- reader ----

    /// The id, for an optimistic read (seqlock begin).
    pub fn id_acquire(&self) -> u64 {
        self.id().load(Ordering::Acquire)
    }

    /// The id after a hazard was published (after its SeqCst fence).
    pub fn id_after_hazard(&self) -> u64 {
        self.id().load(Ordering::Acquire)
    }

    /// The id again after an optimistic copy (seqlock end).
    pub fn id_recheck(&self) -> u64 {
        fence(Ordering::Acquire);
        self.id().load(Ordering::Relaxed)
    }

    /// Tag, size and kind; meaningful only between two equal id loads.
    pub fn meta(&self) -> (u64, u64, u32) {
        let r = Ordering::Relaxed;
        (
            self.u64_at(offset_of!(SlotHeader, tag)).load(r),
            self.u64_at(offset_of!(SlotHeader, size)).load(r),
            self.u32_at(offset_of!(SlotHeader, kind)).load(r),
        )
    }

    /// Everything the inspector shows, in one relaxed snapshot.
    pub fn snapshot(&self) -> SlotHeader {
        let r = Ordering::Relaxed;
        SlotHeader {
            id: self.id().load(r),
            tag: self.u64_at(offset_of!(SlotHeader, tag)).load(r),
            size: self.u64_at(offset_of!(SlotHeader, size)).load(r),
            slot_len: self.u64_at(offset_of!(SlotHeader, slot_len)).load(r),
            refs: self.u32_at(offset_of!(SlotHeader, refs)).load(r),
            kind: self.u32_at(offset_of!(SlotHeader, kind)).load(r),
            epoch: self.u64_at(offset_of!(SlotHeader, epoch)).load(r),
            reserved: [0; 2],
        }
    }

    /// Reader `i`'s acknowledged reads (relaxed, for inspection).
    pub fn reads_relaxed(&self, i: u32) -> u32 {
        self.reads(i).load(Ordering::Relaxed)
    }

    /// Acknowledges one read by reader `i` if it owes one.
    ///
    /// Only reader `i` writes `reads[i]`, and only while the slot cannot be
    /// reused under it (it holds a hazard on the slot), so a plain
    /// load/store pair is enough. Returns whether a read was counted.
    pub fn acknowledge(&self, i: u32) -> bool {
        let done = self.reads(i).load(Ordering::Relaxed);
        let refs = self
            .u32_at(offset_of!(SlotHeader, refs))
            .load(Ordering::Acquire);
        if done < refs {
            self.reads(i).store(done + 1, Ordering::Release);
            true
        } else {
            false
        }
    }
}

/// One reader's entry in the reader table.
#[derive(Clone, Copy, Debug)]
pub struct ReaderPtr {
    ptr: *mut u8,
}

impl ReaderPtr {
    /// # Safety
    /// `ptr` is 8-aligned and `size_of::<ReaderEntry>()` bytes from it lie in
    /// a live shared mapping.
    pub unsafe fn new(ptr: *mut u8) -> Self {
        ReaderPtr { ptr }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `new`'s contract; `off` is an 8-aligned offset inside the entry.
        unsafe { field(self.ptr, off) }
    }

    fn state_word(&self) -> &AtomicU32 {
        // SAFETY: `new`'s contract; `state` is the 4-aligned u32 at offset 0.
        unsafe { field(self.ptr, offset_of!(ReaderEntry, state)) }
    }

    fn pid_word(&self) -> &AtomicU32 {
        // SAFETY: `new`'s contract; `pid` is the 4-aligned u32 at offset 4.
        unsafe { field(self.ptr, offset_of!(ReaderEntry, pid)) }
    }

    fn hazard(&self, k: usize) -> &AtomicU64 {
        self.u64_at(offset_of!(ReaderEntry, hazards) + 8 * k)
    }

    /// The entry's state (SeqCst: pairs with the writer's reclaim scan).
    pub fn state(&self) -> u32 {
        self.state_word().load(Ordering::SeqCst)
    }

    /// Moves the state from `from` to `to`; false if it was not `from`.
    pub fn transition(&self, from: u32, to: u32) -> bool {
        self.state_word()
            .compare_exchange(from, to, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// Sets the state unconditionally.
    pub fn set_state(&self, to: u32) {
        self.state_word().store(to, Ordering::SeqCst);
    }

    /// Pid and start time of the holder.
    pub fn owner(&self) -> (u32, u64) {
        (
            self.pid_word().load(Ordering::Acquire),
            self.u64_at(offset_of!(ReaderEntry, start_time))
                .load(Ordering::Relaxed),
        )
    }

    /// Records the holder (start time first: a pid seen implies its start time).
    pub fn set_owner(&self, pid: u32, start_time: u64) {
        self.u64_at(offset_of!(ReaderEntry, start_time))
            .store(start_time, Ordering::Relaxed);
        self.pid_word().store(pid, Ordering::Release);
    }

    /// First id this reader is counted for.
    pub fn counted_from(&self) -> u64 {
        self.u64_at(offset_of!(ReaderEntry, counted_from))
            .load(Ordering::Acquire)
    }

    /// Sets the first counted id (before the entry becomes ATTACHED).
    pub fn set_counted_from(&self, id: u64) {
        self.u64_at(offset_of!(ReaderEntry, counted_from))
            .store(id, Ordering::Release);
    }

    /// Bumps and returns the attach generation.
    pub fn bump_generation(&self) -> u64 {
        self.u64_at(offset_of!(ReaderEntry, generation))
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_add(1)
    }

    /// Counts a stale handle this reader met.
    pub fn count_stale(&self) {
        self.u64_at(offset_of!(ReaderEntry, stale_reads))
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Stale handles this reader met.
    pub fn stale_reads(&self) -> u64 {
        self.u64_at(offset_of!(ReaderEntry, stale_reads))
            .load(Ordering::Relaxed)
    }

    /// Records the attach time (before the entry becomes ATTACHED).
    pub fn set_attached_ns(&self, t: u64) {
        self.u64_at(offset_of!(ReaderEntry, attached_ns))
            .store(t, Ordering::Relaxed);
    }

    /// When the holder attached (monotonic ns).
    pub fn attached_ns(&self) -> u64 {
        self.u64_at(offset_of!(ReaderEntry, attached_ns))
            .load(Ordering::Relaxed)
    }

    /// Attach generation.
    pub fn generation(&self) -> u64 {
        self.u64_at(offset_of!(ReaderEntry, generation))
            .load(Ordering::Relaxed)
    }

    /// Time of the last acknowledged read (monotonic ns; 0: none yet).
    pub fn last_ack_ns(&self) -> u64 {
        self.u64_at(offset_of!(ReaderEntry, last_ack_ns))
            .load(Ordering::Relaxed)
    }

    /// Number of hazards set (for inspection).
    pub fn hazards_in_use(&self) -> usize {
        (0..layout::HAZARDS_PER_READER)
            .filter(|&k| self.hazard(k).load(Ordering::Relaxed) != 0)
            .count()
    }

    /// Records an acknowledgement time.
    pub fn set_last_ack_ns(&self, t: u64) {
        self.u64_at(offset_of!(ReaderEntry, last_ack_ns))
            .store(t, Ordering::Relaxed);
    }

    /// Publishes a hazard on `id` in word `k`, then a SeqCst fence (the
    /// Dekker pair of [`SlotPtr::invalidate`]'s fence).
    pub fn set_hazard(&self, k: usize, id: u64) {
        debug_assert!(k < layout::HAZARDS_PER_READER);
        self.hazard(k).store(id, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Clears hazard `k` (Release: the guard's reads happen before reuse).
    pub fn clear_hazard(&self, k: usize) {
        self.hazard(k).store(0, Ordering::Release);
    }

    /// Clears every hazard (a reader taking over an entry).
    pub fn clear_all_hazards(&self) {
        for k in 0..layout::HAZARDS_PER_READER {
            self.clear_hazard(k);
        }
    }

    /// Whether any hazard names `id` (after the writer's `invalidate`).
    pub fn holds(&self, id: u64) -> bool {
        (0..layout::HAZARDS_PER_READER).any(|k| self.hazard(k).load(Ordering::Acquire) == id)
    }
}

/// The segment header's atomic fields.
#[derive(Clone, Copy, Debug)]
pub struct HeaderPtr {
    ptr: *mut u8,
}

impl HeaderPtr {
    /// # Safety
    /// `ptr` is page aligned and `size_of::<SegmentHeader>()` bytes from it
    /// lie in a live shared mapping.
    pub unsafe fn new(ptr: *mut u8) -> Self {
        HeaderPtr { ptr }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `new`'s contract; `off` is an 8-aligned field offset.
        unsafe { field(self.ptr, off) }
    }

    fn writer_pid(&self) -> &AtomicU32 {
        // SAFETY: `new`'s contract; writer_pid is the 4-aligned u32 at offset 60.
        unsafe { field(self.ptr, offset_of!(SegmentHeader, writer_pid)) }
    }

    /// A copy of the whole header for validation (fields may be mid-update;
    /// only the immutable ones are trusted, after checks).
    pub fn read(&self) -> SegmentHeader {
        // SAFETY: `new`'s contract: 256 readable bytes; `SegmentHeader` is
        // Pod, so any bytes are a valid value, and read_unaligned needs no
        // alignment.
        unsafe { std::ptr::read_volatile(self.ptr as *const SegmentHeader) }
    }

    /// Writes the header whole, with `magic` zero; [`HeaderPtr::stamp`] sets it.
    pub fn init(&self, header: &SegmentHeader) {
        let mut h = *header;
        h.magic = 0;
        // SAFETY: `new`'s contract: 256 writable bytes; only the creator calls
        // this, before the magic is stamped, so no reader trusts these bytes yet.
        unsafe { std::ptr::write_volatile(self.ptr as *mut SegmentHeader, h) };
    }

    /// Stamps the magic last (Release): an opener that sees it sees the rest.
    pub fn stamp(&self) {
        self.u64_at(offset_of!(SegmentHeader, magic))
            .store(layout::MAGIC, Ordering::Release);
    }

    /// The magic (Acquire: pairs with `stamp`).
    pub fn magic(&self) -> u64 {
        self.u64_at(offset_of!(SegmentHeader, magic))
            .load(Ordering::Acquire)
    }

    /// Writer pid (0 once the writer has exited cleanly) and start time.
    pub fn writer(&self) -> (u32, u64) {
        (
            self.writer_pid().load(Ordering::Acquire),
            self.u64_at(offset_of!(SegmentHeader, writer_start_time))
                .load(Ordering::Relaxed),
        )
    }

    /// Marks the writer as gone (clean exit).
    pub fn clear_writer(&self) {
        self.writer_pid().store(0, Ordering::Release);
    }

    /// Ids below this were dropped by `clear`.
    pub fn cleared_below(&self) -> u64 {
        self.u64_at(offset_of!(SegmentHeader, cleared_below))
            .load(Ordering::Acquire)
    }

    /// Records a `clear`.
    pub fn set_cleared_below(&self, id: u64) {
        self.u64_at(offset_of!(SegmentHeader, cleared_below))
            .store(id, Ordering::Release);
    }

    /// Current epoch.
    pub fn epoch(&self) -> u64 {
        self.u64_at(offset_of!(SegmentHeader, epoch))
            .load(Ordering::Acquire)
    }

    /// Ring head and tail (virtual positions).
    pub fn ring_extent(&self) -> (u64, u64) {
        (
            self.u64_at(offset_of!(SegmentHeader, ring_head))
                .load(Ordering::Relaxed),
            self.u64_at(offset_of!(SegmentHeader, ring_tail))
                .load(Ordering::Relaxed),
        )
    }

    /// Publishes a new epoch.
    pub fn set_epoch(&self, e: u64) {
        self.u64_at(offset_of!(SegmentHeader, epoch))
            .store(e, Ordering::Release);
    }

    /// The id the next put gets.
    pub fn next_id(&self) -> u64 {
        self.u64_at(offset_of!(SegmentHeader, next_id))
            .load(Ordering::Acquire)
    }

    /// Publishes the next id and the ring's extent (for attach and inspection).
    pub fn set_progress(&self, next_id: u64, head: u64, tail: u64) {
        self.u64_at(offset_of!(SegmentHeader, next_id))
            .store(next_id, Ordering::Release);
        self.u64_at(offset_of!(SegmentHeader, ring_head))
            .store(head, Ordering::Relaxed);
        self.u64_at(offset_of!(SegmentHeader, ring_tail))
            .store(tail, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_allocates_in_order_and_wraps_without_straddling() {
        let mut r: Ring<u32> = Ring::new(1000);
        let a = r.reserve(400).unwrap();
        r.commit(a, 400, 1);
        let b = r.reserve(400).unwrap();
        r.commit(b, 400, 2);
        assert_eq!((a, b), (0, 400));
        // 200 left at the end, 300 does not fit: nothing freed yet.
        assert_eq!(r.reserve(300), None);
        assert_eq!(r.reserve(200), Some(800));
        r.pop_front();
        // Now 300 goes to the next lap's start, skipping 200 at the end.
        let c = r.reserve(300).unwrap();
        assert_eq!(c, 1000);
        assert_eq!(r.address(c), 0);
        r.commit(c, 300, 3);
        assert_eq!(r.used(), 900);
        // 100 left before b (at 400): 150 does not fit.
        assert_eq!(r.reserve(150), None);
        assert_eq!(r.reserve(100), Some(1300));
    }

    #[test]
    fn empty_ring_restarts_at_a_lap_start() {
        let mut r: Ring<()> = Ring::new(1000);
        let a = r.reserve(700).unwrap();
        r.commit(a, 700, ());
        r.pop_front();
        // A 900-byte slot fits in an empty ring even though the tail is at 700.
        assert_eq!(r.reserve(900), Some(1000));
        assert_eq!(r.reserve(1000), Some(1000));
        assert_eq!(r.reserve(1001), None);
        assert_eq!(r.reserve(0), None);
    }

    #[test]
    fn largest_free_matches_reserve() {
        let mut r: Ring<()> = Ring::new(1024);
        let mut rng = 12345u64;
        for _ in 0..2000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let len = (rng % 512 + 1) * 2 / 2;
            if rng % 3 == 0 {
                r.pop_front();
            }
            let lf = r.largest_free();
            assert!(
                lf == 0 || r.reserve(lf).is_some(),
                "largest_free {lf} must fit"
            );
            assert!(
                r.reserve(lf + 1).is_none(),
                "largest_free {lf} must be largest"
            );
            if let Some(p) = r.reserve(len) {
                assert!(r.address(p) + len <= 1024, "no slot straddles the end");
                r.commit(p, len, ());
            }
            assert!(r.used() <= 1024);
        }
    }

    #[test]
    fn find_by_locates_ids_across_the_deque_seam() {
        let mut r: Ring<u64> = Ring::new(10);
        for id in 1..=10 {
            let p = r.reserve(1).unwrap();
            r.commit(p, 1, id);
        }
        for _ in 0..5 {
            r.pop_front();
        }
        for id in 11..=15 {
            let p = r.reserve(1).unwrap();
            r.commit(p, 1, id);
        }
        for id in 6..=15 {
            assert_eq!(r.find_by_mut(id, |v| *v).map(|s| s.value), Some(id));
        }
        assert!(r.find_by_mut(5, |v| *v).is_none());
    }

    /// The slot protocol on heap memory, for Miri: pointer casts, alignment
    /// and the races between a guard and a reclaim.
    #[test]
    fn slot_protocol_on_heap_memory() {
        #[repr(C, align(64))]
        struct Mem([u64; 80]);
        #[derive(Clone, Copy)]
        struct P(*mut u8);
        // SAFETY: the pointees are boxes that outlive the thread.
        unsafe impl Send for P {}
        let mut slot_mem = Box::new(Mem([0; 80]));
        let mut reader_mem = Box::new(Mem([0; 80]));
        let (sp, rp) = (
            P(slot_mem.0.as_mut_ptr().cast()),
            P(reader_mem.0.as_mut_ptr().cast()),
        );
        // SAFETY: 640 bytes, 64-aligned: room for a slot prefix of 2 readers
        // and for a whole reader entry (576 bytes).
        let slot = unsafe { SlotPtr::new(sp.0) };
        slot.begin_write();
        slot.publish(7, 99, 10, 192, 0, 1, 2);
        assert_eq!(slot.id_acquire(), 7);
        assert_eq!(slot.meta(), (99, 10, 0));
        assert!(slot.acknowledge(0));
        assert!(!slot.acknowledge(0), "one reference, one read");
        assert_eq!(slot.reads_acquire(0), 1);
        assert_eq!(slot.reads_acquire(1), 0);
        let reader = std::thread::spawn(move || {
            // SAFETY: as above; the boxes outlive the thread (joined below).
            let (slot, me) = unsafe { (SlotPtr::new({ sp }.0), ReaderPtr::new({ rp }.0)) };
            me.set_hazard(0, 7);
            let ok = slot.id_after_hazard() == 7;
            if ok {
                assert_eq!(slot.meta().1, 10);
            }
            me.clear_hazard(0);
            ok
        });
        // SAFETY: as above.
        let me = unsafe { ReaderPtr::new(rp.0) };
        slot.invalidate();
        if me.holds(7) {
            slot.restore(7);
        }
        let _ = reader.join().unwrap();
        slot.set_refs(2);
        assert!(slot.acknowledge(1));
        assert_eq!(slot.snapshot().refs, 2);
        drop((slot_mem, reader_mem));
    }
}
