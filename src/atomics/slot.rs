//! A slot's prefix: header, per-reader read counters and hold words.

use super::word::{fence, AtomicU32, AtomicU64, Ordering};
use std::mem::offset_of;

use super::field;
use crate::layout::{self, hold, SlotHeader};

/// What [`SlotPtr::publish`] writes beside the identity: the references
/// the object starts with (1, or 0 in a cache) and its key's fingerprint.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SlotMeta {
    pub refs: u32,
    pub key_fp: [u64; 2],
}

/// A slot's prefix (header, reader counters, hold words) in shared memory.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SlotPtr {
    ptr: *mut u8,
    n_readers: u32,
}

impl SlotPtr {
    /// # Safety
    /// 1. `ptr` is 64-byte aligned and points into a live shared mapping.
    /// 2. `slot_prefix_len(n_readers)` bytes from `ptr` lie inside it.
    #[inline]
    pub(crate) unsafe fn new(ptr: *mut u8, n_readers: u32) -> Self {
        SlotPtr { ptr, n_readers }
    }

    #[inline]
    fn u64_at(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `new`'s contract: the prefix is mapped and 64-aligned, `off`
        // is an 8-aligned offset inside it (a SlotHeader field or a hold word).
        unsafe { field(self.ptr, off) }
    }

    #[inline]
    fn u32_at(&self, off: usize) -> &AtomicU32 {
        // SAFETY: as `u64_at`, with a 4-aligned offset (header or counters).
        unsafe { field(self.ptr, off) }
    }

    /// The id word.
    #[inline]
    fn id(&self) -> &AtomicU64 {
        self.u64_at(offset_of!(SlotHeader, id))
    }

    /// The tag word.
    #[inline]
    fn tag(&self) -> &AtomicU64 {
        self.u64_at(offset_of!(SlotHeader, tag))
    }

    /// The touched word (v8).
    #[inline]
    fn touched(&self) -> &AtomicU64 {
        self.u64_at(offset_of!(SlotHeader, touched))
    }

    /// Reader `i`'s acknowledged-read counter.
    #[inline]
    fn reads(&self, i: u32) -> &AtomicU32 {
        debug_assert!(i < self.n_readers);
        self.u32_at(size_of::<SlotHeader>() + 4 * i as usize)
    }

    /// Reader `i`'s hold word ([`layout::hold`]).
    #[inline]
    fn hold_word(&self, i: u32) -> &AtomicU64 {
        debug_assert!(i < self.n_readers);
        // Inside the prefix (`new`'s contract): holds_offset + 8 * n_readers
        // <= slot_prefix_len, and holds_offset is 8-aligned.
        self.u64_at(layout::holds_offset(self.n_readers) + 8 * i as usize)
    }

    // ---- writer ----

    /// Marks the slot as being written. Any reader that sees one of the
    /// writes that follow sees `id == 0` (or the new id) when it re-checks.
    pub(crate) fn begin_write(&self) {
        self.id().store(0, Ordering::Relaxed);
        fence(Ordering::Release);
    }

    /// Marks `len` bytes from here as skipped (no object; for inspection).
    pub(crate) fn mark_skip(&self, len: u64) {
        self.begin_write();
        self.u64_at(offset_of!(SlotHeader, slot_len))
            .store(len, Ordering::Relaxed);
        self.u64_at(offset_of!(SlotHeader, size))
            .store(0, Ordering::Relaxed);
    }

    /// Fills the header and zeroes the counters and hold words, then
    /// publishes `id` (Release: the payload written before is visible to
    /// whoever sees it). No live reader holds the slot (the writer freed it
    /// or never published it), so the hold words it zeroes are a dead
    /// holder's leftovers at most.
    pub(crate) fn publish(
        &self,
        id: u64,
        tag: u64,
        size: u64,
        slot_len: u64,
        kind: u32,
        meta: SlotMeta,
    ) {
        let r = Ordering::Relaxed;
        self.tag().store(tag, r);
        self.u64_at(offset_of!(SlotHeader, key_fp))
            .store(meta.key_fp[0], r);
        self.u64_at(offset_of!(SlotHeader, key_fp) + 8)
            .store(meta.key_fp[1], r);
        self.touched().store(0, r);
        self.u64_at(offset_of!(SlotHeader, size)).store(size, r);
        self.u64_at(offset_of!(SlotHeader, slot_len))
            .store(slot_len, r);
        self.u32_at(offset_of!(SlotHeader, refs))
            .store(meta.refs, r);
        self.u32_at(offset_of!(SlotHeader, kind)).store(kind, r);
        // Two runs of words side by side (counters, then hold words).
        for i in 0..self.n_readers {
            self.reads(i).store(0, r);
        }
        for i in 0..self.n_readers {
            self.hold_word(i).store(0, r);
        }
        self.id().store(id, Ordering::Release);
    }

    /// Publishes a new reference count (one more expected read per reader).
    pub(crate) fn set_refs(&self, refs: u32) {
        self.u32_at(offset_of!(SlotHeader, refs))
            .store(refs, Ordering::Release);
    }

    /// Reader `i`'s acknowledged reads; Acquire pairs with the reader's
    /// Release so its reads of the payload happen before any reuse.
    #[inline]
    pub(crate) fn reads_acquire(&self, i: u32) -> u32 {
        self.reads(i).load(Ordering::Acquire)
    }

    /// First half of reclaiming: no new guard can validate after this.
    /// Returns the tag, which it zeroes with the id, for
    /// [`SlotPtr::restore`].
    ///
    /// The tag goes too because the slot's header may become payload: a
    /// newer object that starts before it covers it, and may write the old
    /// id there (any small integer may be it). A reader whose copy saw a
    /// byte written after this (the next object's, after the SeqCst fence
    /// here and the Release fence of its `begin_write`) loads, after its
    /// Acquire fence, either the zeroed tag or a later write of that word;
    /// never the old tag, which only the segment's secret reproduces
    /// ([`layout::keyed_slot_tag`]). So [`SlotPtr::identity_recheck`] finds
    /// the change even when the id word was written back to the old id.
    pub(crate) fn invalidate(&self) -> u64 {
        // Only the writer stores the tag: reading it back is no race.
        let tag = self.tag().load(Ordering::Relaxed);
        self.id().store(0, Ordering::Relaxed);
        self.tag().store(0, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        tag
    }

    /// Backs off a reclaim that found a hazard or a hold: the tag that
    /// [`SlotPtr::invalidate`] returned, then the id (Release: a reader
    /// that loads the id again loads the tag again).
    pub(crate) fn restore(&self, id: u64, tag: u64) {
        self.tag().store(tag, Ordering::Relaxed);
        self.id().store(id, Ordering::Release);
    }

    /// Whether reader `i`, of attach generation `generation`, holds the
    /// slot: after [`SlotPtr::invalidate`] and the hazard scan, the
    /// writer's last check (Acquire: pairs with the Release of
    /// [`SlotPtr::unhold`], so the holder's reads happen before any reuse).
    #[inline]
    pub(crate) fn held_by(&self, i: u32, generation: u64) -> bool {
        hold::count_for(self.hold_word(i).load(Ordering::Acquire), generation) != 0
    }

    /// Reader `i`'s hold word, generation and count (Acquire, as
    /// [`SlotPtr::held_by`]'s load), for a scan that reads the reader's
    /// state only when this word or its hazard may keep the slot.
    #[inline]
    pub(crate) fn hold_word_acquire(&self, i: u32) -> u64 {
        self.hold_word(i).load(Ordering::Acquire)
    }

    /// Reader `i`'s hold count for `generation` (relaxed, for inspection).
    pub(crate) fn holds_relaxed(&self, i: u32, generation: u64) -> u32 {
        hold::count_for(self.hold_word(i).load(Ordering::Relaxed), generation)
    }

    // ---- reader ----

    /// The id (Acquire): the start of an optimistic read (seqlock begin),
    /// or the check after a hazard was published (after its SeqCst fence).
    #[inline]
    pub(crate) fn id_acquire(&self) -> u64 {
        self.id().load(Ordering::Acquire)
    }

    /// Id and tag again after an optimistic copy (seqlock end); the caller
    /// compares both with what it validated before the copy.
    ///
    /// The id alone is not enough: once the slot is freed, a newer object
    /// may start before it and its payload then covers this header, so the
    /// id word can read as the old id again (the payload's bytes, not a
    /// header's). The tag cannot: [`SlotPtr::invalidate`] zeroes it before
    /// any reuse, and the stored tag is keyed by the segment's secret, so
    /// no payload spells it but by a 2^-64 accident (see
    /// [`layout::keyed_slot_tag`]). The tag covers size and kind (it mixes
    /// them), so it is the slot's whole identity.
    #[inline]
    pub(crate) fn identity_recheck(&self) -> (u64, u64) {
        fence(Ordering::Acquire);
        let r = Ordering::Relaxed;
        (self.id().load(r), self.tag().load(r))
    }

    /// Tag, size and kind; meaningful only between two equal id loads.
    #[inline]
    pub(crate) fn meta(&self) -> (u64, u64, u32) {
        let r = Ordering::Relaxed;
        (
            self.tag().load(r),
            self.u64_at(offset_of!(SlotHeader, size)).load(r),
            self.u32_at(offset_of!(SlotHeader, kind)).load(r),
        )
    }

    /// Everything the inspector shows, in one relaxed snapshot.
    pub(crate) fn snapshot(&self) -> SlotHeader {
        let r = Ordering::Relaxed;
        SlotHeader {
            id: self.id().load(r),
            tag: self.tag().load(r),
            size: self.u64_at(offset_of!(SlotHeader, size)).load(r),
            slot_len: self.u64_at(offset_of!(SlotHeader, slot_len)).load(r),
            refs: self.u32_at(offset_of!(SlotHeader, refs)).load(r),
            kind: self.u32_at(offset_of!(SlotHeader, kind)).load(r),
            key_fp: self.key_fp(),
            touched: self.touched().load(r),
        }
    }

    /// The fingerprint of the object's key (Relaxed): meaningful only
    /// between two equal id loads, or while the reader holds the slot (it
    /// is written before the id's Release publish and never while the
    /// slot is held).
    #[inline]
    pub(crate) fn key_fp(&self) -> [u64; 2] {
        let r = Ordering::Relaxed;
        [
            self.u64_at(offset_of!(SlotHeader, key_fp)).load(r),
            self.u64_at(offset_of!(SlotHeader, key_fp) + 8).load(r),
        ]
    }

    /// A reader's hit by key (Relaxed: a hint for eviction, ordering
    /// nothing). Called only while the reader holds the slot or its
    /// validated hazard keeps the slot from reuse (a `lookup`), so the
    /// mark is never written into a slot that has become another object's
    /// (the writer zeroes the word at each publish).
    #[inline]
    pub(crate) fn touch(&self) {
        if self.touched().load(Ordering::Relaxed) == 0 {
            self.touched().store(1, Ordering::Relaxed);
        }
    }

    /// The writer's second-chance sweep: whether a reader hit the object
    /// by key since the last sweep, clearing the mark (Relaxed: a hint).
    pub(crate) fn take_touched(&self) -> bool {
        self.touched().load(Ordering::Relaxed) != 0
            && self.touched().swap(0, Ordering::Relaxed) != 0
    }

    /// Reader `i`'s acknowledged reads (relaxed, for inspection).
    pub(crate) fn reads_relaxed(&self, i: u32) -> u32 {
        self.reads(i).load(Ordering::Relaxed)
    }

    /// Counts one read in the slot's aggregate counter (`reads[0]`), from
    /// any reader, under a hazard on the slot (RMW: readers race on it;
    /// Release: the read happens before the writer's reuse).
    #[inline]
    pub(crate) fn acknowledge_aggregate(&self) {
        // Saturating: a hot object read 2^32 times must not look unread.
        let _ = self
            .reads(0)
            .fetch_update(Ordering::Release, Ordering::Relaxed, |n| n.checked_add(1));
    }

    /// Takes one more hold for reader `i` of `generation`. Called only
    /// while the reader's hazard on this slot's id is published and
    /// validated, so the slot cannot be reused under the write; the
    /// hazard's Release clear that follows publishes the hold to a writer
    /// that sees the hazard gone. A word of another generation (a dead
    /// holder's) is replaced. RMWs: threads of one reader process may
    /// race here (the Python binding lets any thread drop a view).
    #[inline]
    pub(crate) fn hold(&self, i: u32, generation: u64) {
        let w = self.hold_word(i);
        let mut cur = w.load(Ordering::Relaxed);
        loop {
            let count = hold::count_for(cur, generation);
            // Saturates instead of wrapping: 2^32 - 1 holds is a leak.
            let next = hold::word(generation, count.saturating_add(1));
            match w.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return,
                Err(seen) => cur = seen,
            }
        }
    }

    /// Gives one hold of reader `i` back (Release: this holder's reads of
    /// the payload happen before a writer that sees the count drop reuses
    /// the slot). The hold keeps the slot from reuse until this store.
    #[inline]
    pub(crate) fn unhold(&self, i: u32) {
        let _ = self
            .hold_word(i)
            .fetch_update(Ordering::Release, Ordering::Relaxed, |w| {
                (w as u32 != 0).then(|| w - 1)
            });
    }

    /// Acknowledges one read by reader `i` if it owes one.
    ///
    /// Only reader `i`'s process writes `reads[i]`, and only while the slot
    /// cannot be reused under it (it holds the slot: a hazard or a hold).
    /// An RMW, not a load/store pair: guards of one reader may be dropped
    /// on several threads at once (a guard owns its share of the reader and
    /// is `Send`), and none of their counts may be lost. Returns whether a
    /// read was counted.
    #[inline]
    pub(crate) fn acknowledge(&self, i: u32) -> bool {
        let refs = self
            .u32_at(offset_of!(SlotHeader, refs))
            .load(Ordering::Acquire);
        self.reads(i)
            .fetch_update(Ordering::Release, Ordering::Relaxed, |done| {
                (done < refs).then(|| done + 1)
            })
            .is_ok()
    }
}
