//! One reader's entry of the reader table: state, owner, hazard word.

use super::word::{fence, AtomicU32, AtomicU64, Ordering};
use std::mem::offset_of;

use super::field;
use crate::layout::{self, ReaderEntry};

/// One reader's entry in the reader table.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReaderPtr {
    ptr: *mut u8,
}

impl ReaderPtr {
    /// # Safety
    /// `ptr` is 8-aligned and `size_of::<ReaderEntry>()` bytes from it lie in
    /// a live shared mapping.
    #[inline]
    pub(crate) unsafe fn new(ptr: *mut u8) -> Self {
        ReaderPtr { ptr }
    }

    #[inline]
    fn u64_at(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `new`'s contract; `off` is an 8-aligned offset inside the entry.
        unsafe { field(self.ptr, off) }
    }

    #[inline]
    fn state_word(&self) -> &AtomicU64 {
        self.u64_at(offset_of!(ReaderEntry, state))
    }

    fn pid_word(&self) -> &AtomicU32 {
        // SAFETY: `new`'s contract; `pid` is the 4-aligned u32 at offset 8.
        unsafe { field(self.ptr, offset_of!(ReaderEntry, pid)) }
    }

    #[inline]
    fn hazard(&self) -> &AtomicU64 {
        self.u64_at(offset_of!(ReaderEntry, hazard))
    }

    /// The entry's state word, `reader_state::word(generation, state)`
    /// (SeqCst: pairs with the writer's reclaim scan).
    #[inline]
    pub(crate) fn word(&self) -> u64 {
        self.state_word().load(Ordering::SeqCst)
    }

    /// The entry's state (see [`layout::reader_state`]).
    #[inline]
    pub(crate) fn state(&self) -> u32 {
        layout::reader_state::state(self.word())
    }

    /// How many attaches this entry has seen.
    #[inline]
    pub(crate) fn generation(&self) -> u64 {
        layout::reader_state::generation(self.word())
    }

    /// Moves the state word from `from` to `to`; false if it was not
    /// `from`. Comparing the whole word (generation included) keeps the
    /// writer's "dead" mark off a reader that re-attached meanwhile.
    pub(crate) fn transition(&self, from: u64, to: u64) -> bool {
        self.state_word()
            .compare_exchange(from, to, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// Sets the state word unconditionally (only its holder does).
    pub(crate) fn set_word(&self, to: u64) {
        self.state_word().store(to, Ordering::SeqCst);
    }

    /// Pid of the holder, for messages (0: unknown).
    pub(crate) fn pid(&self) -> u32 {
        self.pid_word().load(Ordering::Relaxed)
    }

    /// Records the holder's pid, for messages.
    pub(crate) fn set_pid(&self, pid: u32) {
        self.pid_word().store(pid, Ordering::Relaxed);
    }

    /// First id this reader is counted for.
    #[inline]
    pub(crate) fn counted_from(&self) -> u64 {
        self.u64_at(offset_of!(ReaderEntry, counted_from))
            .load(Ordering::Acquire)
    }

    /// Sets the first counted id (before the entry becomes ATTACHED).
    pub(crate) fn set_counted_from(&self, id: u64) {
        self.u64_at(offset_of!(ReaderEntry, counted_from))
            .store(id, Ordering::Release);
    }

    /// Counts a stale handle this reader met.
    pub(crate) fn count_stale(&self) {
        self.u64_at(offset_of!(ReaderEntry, stale_reads))
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Stale handles this reader met.
    pub(crate) fn stale_reads(&self) -> u64 {
        self.u64_at(offset_of!(ReaderEntry, stale_reads))
            .load(Ordering::Relaxed)
    }

    /// Records the attach time (before the entry becomes ATTACHED).
    pub(crate) fn set_attached_ns(&self, t: u64) {
        self.u64_at(offset_of!(ReaderEntry, attached_ns))
            .store(t, Ordering::Relaxed);
    }

    /// When the holder attached (monotonic ns).
    pub(crate) fn attached_ns(&self) -> u64 {
        self.u64_at(offset_of!(ReaderEntry, attached_ns))
            .load(Ordering::Relaxed)
    }

    /// Time of the last acknowledged read (monotonic ns; 0: none yet).
    pub(crate) fn last_ack_ns(&self) -> u64 {
        self.u64_at(offset_of!(ReaderEntry, last_ack_ns))
            .load(Ordering::Relaxed)
    }

    /// Records an acknowledgement time.
    #[inline]
    pub(crate) fn set_last_ack_ns(&self, t: u64) {
        self.u64_at(offset_of!(ReaderEntry, last_ack_ns))
            .store(t, Ordering::Relaxed);
    }

    /// Publishes the hazard on `id`, then a SeqCst fence (the Dekker pair
    /// of [`SlotPtr::invalidate`](super::SlotPtr::invalidate)'s fence).
    ///
    /// The store is Release, not Relaxed: a writer whose hazard load
    /// (Acquire) reads this value, not the previous get's Release clear,
    /// must still see that get's hold. A later Relaxed store of the same
    /// thread heads no release sequence under C++20, and AArch64 may make
    /// it visible before the hold, so the writer would synchronize with
    /// nothing and could reuse a held slot. Release costs nothing on x86
    /// (a plain `mov`) and an `stlr` on AArch64.
    #[inline]
    pub(crate) fn set_hazard(&self, id: u64) {
        self.hazard().store(id, Ordering::Release);
        fence(Ordering::SeqCst);
    }

    /// Clears the hazard (Release: the guard's reads happen before reuse).
    #[inline]
    pub(crate) fn clear_hazard(&self) {
        self.hazard().store(0, Ordering::Release);
    }

    /// Whether the hazard names `id` (after the writer's `invalidate`).
    #[inline]
    pub(crate) fn has_hazard_on(&self, id: u64) -> bool {
        self.hazard().load(Ordering::Acquire) == id
    }
}
