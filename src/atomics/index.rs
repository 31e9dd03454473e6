//! The shared key index's atomics (layout 8): the table of
//! [`IndexEntry`](crate::layout::IndexEntry)s after the data region, and its
//! sequence word in the header. The probing (which entry to look at) is
//! `crate::store::key_index`'s; the orderings are chosen here.
//!
//! | field | written by | read by | protocol |
//! |---|---|---|---|
//! | `SegmentHeader::index_seq` | writer: odd (Relaxed) then a Release fence before it changes entries, the next even value (Release) after | readers: Acquire before a probe; an Acquire fence then Relaxed after it | seqlock: a probe between two equal even loads saw no change |
//! | `IndexEntry::{fp, id, address}` | writer only (Relaxed), between the two stores of `index_seq` | readers (Relaxed), between the two loads of `index_seq` | a reader takes an entry, or the absence of one, only when the sequence word did not move across its probe; and a hit only after checking the slot it names (id, tag and key fingerprint, under its hold or its validated hazard), since the writer may change the table right after |
//!
//! Why a torn hit is harmless: the slot, not the entry, decides. A reader
//! that follows an entry publishes its hazard on the entry's id (the hold
//! protocol of `crate::atomics`; `get_key` then takes the hold, `lookup`
//! only marks the slot touched), then compares the slot's id and key
//! fingerprint with what it looked up; the writer writes both before the
//! id's Release publish and never while the slot is held or under a
//! validated hazard. A mixed entry names a slot
//! whose id or fingerprint differs, and the lookup reports a miss.
//!
//! Why a miss needs the sequence word: the writer moves entries when it
//! removes one (backward-shift deletion keeps probe chains short without
//! tombstones), so a reader racing a move may pass the place an entry
//! leaves before reaching the place it goes. The writer's odd store is
//! followed by a Release fence and the entries' stores; a reader that read
//! any of those stores reaches, through its Acquire fence, at least the odd
//! value on its second load, and retries.

use super::field;
use super::header::HeaderPtr;
use super::word::{fence, AtomicU64, Ordering};
use crate::layout::IndexEntry;
use std::mem::offset_of;

/// The key index of a mapped store segment.
#[derive(Clone, Copy, Debug)]
pub(crate) struct IndexPtr {
    table: *mut u8,
    entries: u64,
    header: HeaderPtr,
}

impl IndexPtr {
    /// # Safety
    /// 1. `table` is 8-aligned and `entries * 32` bytes from it lie in a
    ///    live shared mapping that outlives every use of the result.
    /// 2. `entries` is a power of two.
    /// 3. `header` is the same mapping's header.
    pub(crate) unsafe fn new(table: *mut u8, entries: u64, header: HeaderPtr) -> Self {
        debug_assert!(entries.is_power_of_two());
        IndexPtr {
            table,
            entries,
            header,
        }
    }

    /// How many entries the table has (a power of two).
    #[inline]
    pub(crate) fn entries(&self) -> u64 {
        self.entries
    }

    #[inline]
    fn word(&self, i: u64, off: usize) -> &AtomicU64 {
        debug_assert!(i < self.entries);
        // SAFETY: `new`'s contract: entry `i & (entries - 1)` lies inside the
        // table, and `off` is an 8-aligned offset inside an entry.
        unsafe {
            field(
                self.table,
                (i & (self.entries - 1)) as usize * size_of::<IndexEntry>() + off,
            )
        }
    }

    /// Entry `i` as (fingerprint, id, address), Relaxed: between the
    /// sequence loads for a reader; the writer reads back its own stores.
    #[inline]
    pub(crate) fn read(&self, i: u64) -> ([u64; 2], u64, u64) {
        let r = Ordering::Relaxed;
        (
            [
                self.word(i, offset_of!(IndexEntry, fp)).load(r),
                self.word(i, offset_of!(IndexEntry, fp) + 8).load(r),
            ],
            self.word(i, offset_of!(IndexEntry, id)).load(r),
            self.word(i, offset_of!(IndexEntry, address)).load(r),
        )
    }

    // ---- writer ----

    /// Starts a change of the table: the sequence word becomes odd, and
    /// the Release fence orders it before every entry store that follows.
    /// Returns the even value it was, for [`IndexPtr::end_change`].
    pub(crate) fn begin_change(&self) -> u64 {
        let seq = self.header.index_seq();
        // Only the writer stores the word: reading it back is no race.
        let s = seq.load(Ordering::Relaxed) & !1;
        seq.store(s.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        s
    }

    /// Writes entry `i` (Relaxed), inside a change.
    pub(crate) fn write(&self, i: u64, fp: [u64; 2], id: u64, address: u64) {
        let r = Ordering::Relaxed;
        self.word(i, offset_of!(IndexEntry, fp)).store(fp[0], r);
        self.word(i, offset_of!(IndexEntry, fp) + 8).store(fp[1], r);
        self.word(i, offset_of!(IndexEntry, address))
            .store(address, r);
        self.word(i, offset_of!(IndexEntry, id)).store(id, r);
    }

    /// Ends the change begun at `s` (Release: a reader that loads the new
    /// value sees every entry store of the change).
    pub(crate) fn end_change(&self, s: u64) {
        self.header
            .index_seq()
            .store(s.wrapping_add(2), Ordering::Release);
    }

    // ---- reader ----

    /// The sequence word before a probe (Acquire).
    #[inline]
    pub(crate) fn seq_begin(&self) -> u64 {
        self.header.index_seq().load(Ordering::Acquire)
    }

    /// The sequence word after a probe: an Acquire fence, then Relaxed. Equal
    /// to an even [`IndexPtr::seq_begin`], the probe saw no change.
    #[inline]
    pub(crate) fn seq_end(&self) -> u64 {
        fence(Ordering::Acquire);
        self.header.index_seq().load(Ordering::Relaxed)
    }
}
