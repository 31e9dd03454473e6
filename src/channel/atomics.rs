//! Every atomic access of the channel, and the futex sleeps and wakes.
//! **Every memory ordering of the channel is chosen here.**
//!
//! | word | written by | read by | ordering and why |
//! |---|---|---|---|
//! | `write_seq` | writer: Release store after the slot's payload and header | readers: Acquire (poll); writer's SeqCst fence follows the store | Release/Acquire publishes the payload; the fence is the writer's half of the two Dekker pairs below |
//! | `SlotHeader::{seq,len}` | writer: Relaxed, before `write_seq` | reader: Relaxed, after its Acquire load of `write_seq` | ordered by `write_seq` |
//! | `ReaderEntry::released` | reader `i`: Release, then a SeqCst fence | writer: Acquire, after a SeqCst fence | the reader's reads of a slot happen before the writer's rewrite of it |
//! | `ReaderEntry::state` | reader: CAS to claim (AcqRel), Release store of ATTACHED then a SeqCst fence, Release store of LEFT; writer: CAS ATTACHED→LEFT on the whole word (generation included) | writer: Acquire, after a SeqCst fence | Dekker pair with `write_seq` (attach) and a generation-checked CAS (reaping) |
//! | `msg_event` (event count: bits 0..8 sleepers, 8.. epoch; the futex word readers sleep on) | readers: fetch_add 1 (Relaxed) + SeqCst fence to announce, before re-checking; CAS −1 (AcqRel) to withdraw, only within their epoch; writer: CAS to (epoch + 1, 0 sleepers) (Release) then FUTEX_WAKE, only if sleepers ≠ 0 | writer: Relaxed load after the SeqCst fence that follows `write_seq` / `closed`; readers: Acquire load before FUTEX_WAIT, which the kernel compares again | Dekker pair (fences) between announcing and publishing; the epoch makes any notify after a registration fail the sleeper's compare; the reset makes one wake serve every registration so far |
//! | `slot_event` | writer: announce / withdraw as readers do on `msg_event`; readers: the notify CAS then FUTEX_WAKE(1) | readers: Relaxed after the SeqCst fence that follows `released` / `state`; writer: Acquire before FUTEX_WAIT | as `msg_event`, for the writer waiting for a slot |
//! | `closed` | writer: Release store at drop, then a SeqCst fence and a wake of every reader | readers: Acquire before their last poll | a reader that sees it polls after and drains every message sent |
//! | `CancelFlag` (process memory, not the segment: one per writer or reader) | a `Canceller` in any thread: Relaxed store, then a SeqCst fence and the notify of the event count its owner sleeps on (`msg_event` for a reader, `slot_event` for the writer) | its owner: Relaxed, at the start of a wait, while spinning, and after announcing (after the announce's SeqCst fence) | Dekker pair (fences) with the announce, exactly as `write_seq` is: a waiter either sees the flag before it sleeps, or is registered when the canceller looks and is woken |
//!
//! **No lost wake-up, reader side.** A reader that finds nothing
//! registers on the event count `msg_event` (adds one sleeper; the word it
//! gets back is its registration), runs a SeqCst fence, polls `write_seq`
//! once more, and only then sleeps: it loads the word and calls FUTEX_WAIT
//! with it, unless the epoch already differs from its registration's. The
//! writer stores `write_seq`, runs a SeqCst fence, and loads the word. The
//! two fences are ordered one way or the other. Either the writer's load
//! comes before the registration in the word's modification order, and
//! then the reader's fence came after the writer's and its poll sees the
//! message; or the writer sees the registration (or a later value: a
//! count of at least one, or a newer epoch, since only the registrant
//! withdraws and only a notify resets) and, if it is still counted, starts
//! a new epoch and wakes: the reader's FUTEX_WAIT then either finds the
//! word changed and returns, or was queued before the wake and is woken by
//! it. With no registration, the writer makes no system call; one notify
//! consumes every registration, so a woken reader that is slow to be
//! scheduled costs the writer no further calls, and the reader registers
//! again if it has to sleep again. The writer waiting for a slot is the
//! mirror image, with `slot_event` and `released` (many notifiers, one
//! sleeper).
//!
//! **Cancel, no lost wake-up.** A cancel is one more notifier of the same
//! event count: the canceller sets its owner's `CancelFlag`, runs a SeqCst
//! fence and notifies; the waiter checks the flag after announcing (and
//! its fence). The argument above applies word for word, with the flag in
//! place of `write_seq`: the waiter sees the flag, or the canceller sees
//! the registration and starts a new epoch, which the waiter's FUTEX_WAIT
//! compare or the wake after it ends. Waking the channel's other sleepers
//! too is harmless: they re-check and sleep again.
//!
//! **Attach.** A reader that takes over an entry (after taking its liveness
//! lock) marks it ATTACHING (not expected), stores `released = write_seq`,
//! stores ATTACHED, runs a SeqCst fence and loads `write_seq` again (W2);
//! it receives from W2 on. A writer check that missed ATTACHED had its fence
//! before the reader's, so the reader's W2 is at least the sequence number
//! that check was for: everything that check let the writer overwrite is
//! older than W2.
//!
//! **Reaping.** The writer marks reader `i` LEFT only by a CAS from the exact
//! word it read (generation and ATTACHED) and only after the liveness lock
//! said nobody holds the entry; a new reader takes the lock before it
//! touches the word and bumps the generation, so either the writer's
//! liveness check sees the new holder or its CAS fails.
//!
//! Loom runs this code as it ships, exactly as it runs the store's: in
//! `cfg(pinshm_loom)` builds the atomics and the futex of [`crate::atomics`] are
//! loom's (a side table keyed by address, a loom mutex and condvar per
//! futex word), and the unit tests of `channel::loom_tests` drive the
//! real writer and reader cores over heap memory laid out as a channel
//! segment (`ChannelPtr::heap`, built only for them).

use std::mem::offset_of;
use std::time::Duration;

use super::layout::{self, ChannelHeader, ReaderEntry, SlotHeader};
use crate::atomics::word::{fence, futex_wait, futex_wake, AtomicBool, AtomicU32, AtomicU64};
use crate::atomics::word::{Ordering, Word};
use crate::geometry::ChannelGeometry;
use crate::layout::reader_state;

/// Low bits of an event count: sleepers announced in the current epoch.
const WAITERS: u32 = 0xff;

/// A process-local cancel word: set (once, for good) by a `Canceller`,
/// read by the one writer or reader it belongs to. It lives in process
/// memory, not in the segment: cancelling one process's wait never ends
/// another process's.
#[derive(Debug)]
pub(crate) struct CancelFlag(AtomicBool);

impl CancelFlag {
    /// Not cancelled.
    pub(crate) fn new() -> CancelFlag {
        CancelFlag(AtomicBool::new(false))
    }

    /// Whether it is set. Relaxed: after an announce it is read behind
    /// the announce's SeqCst fence (the Dekker pair of the table); the
    /// looks at the start of a wait and while spinning are early outs.
    pub(crate) fn is_set(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

impl Default for CancelFlag {
    fn default() -> Self {
        Self::new()
    }
}

/// The channel's shared words: a pointer into a mapping plus the
/// validated geometry. Cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct ChannelPtr {
    geo: ChannelGeometry,
    base: *mut u8,
}

// ---------------------------------------------------------------------------
// The accessors: every word at its offset of the layout.
// ---------------------------------------------------------------------------

impl ChannelPtr {
    /// # Safety
    /// 1. `base` is 64-byte aligned and `layout::total_len(geo..)` bytes from
    ///    it are mapped, shared, readable and writable, and stay so while
    ///    this `ChannelPtr` or any clone of it is used.
    /// 2. `geo` was validated against that length.
    pub(crate) unsafe fn new(base: *mut u8, geo: ChannelGeometry) -> ChannelPtr {
        ChannelPtr { geo, base }
    }

    /// The atomic at byte `off`.
    ///
    /// # Safety
    /// `off` is aligned for `A` and `off + size_of::<A>()` lies within the
    /// mapping (`new`'s contract gives the rest).
    unsafe fn at<A: Word>(&self, off: usize) -> &A {
        // SAFETY: the caller's contract plus `new`'s: aligned, in bounds,
        // alive as long as `self`; all access to these words goes through
        // atomics.
        unsafe { crate::atomics::field(self.base, off) }
    }

    fn h32(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off % 4 == 0 && off < size_of::<ChannelHeader>());
        // SAFETY: a 4-aligned field offset inside the 256-byte header.
        unsafe { self.at(off) }
    }

    fn write_seq(&self) -> &AtomicU64 {
        // SAFETY: an 8-aligned field of the header.
        unsafe { self.at(offset_of!(ChannelHeader, write_seq)) }
    }
    fn closed(&self) -> &AtomicU32 {
        self.h32(offset_of!(ChannelHeader, closed))
    }
    fn msg_event(&self) -> &AtomicU32 {
        self.h32(offset_of!(ChannelHeader, msg_event))
    }
    fn slot_event(&self) -> &AtomicU32 {
        self.h32(offset_of!(ChannelHeader, slot_event))
    }
    fn entry(&self, i: u32, off: usize) -> &AtomicU64 {
        assert!(i < self.geo.n_readers, "reader index within the geometry");
        // SAFETY: entry `i` lies in the header area (validated geometry);
        // `off` is an 8-aligned field offset inside the 64-byte entry.
        unsafe { self.at(layout::reader_offset(i) + off) }
    }
    fn state(&self, i: u32) -> &AtomicU64 {
        self.entry(i, offset_of!(ReaderEntry, state))
    }
    fn released(&self, i: u32) -> &AtomicU64 {
        self.entry(i, offset_of!(ReaderEntry, released))
    }
    fn pid_word(&self, i: u32) -> &AtomicU32 {
        assert!(i < self.geo.n_readers, "reader index within the geometry");
        // SAFETY: the 4-aligned pid field of entry `i`, inside the header.
        unsafe { self.at(layout::reader_offset(i) + offset_of!(ReaderEntry, pid)) }
    }
    /// Byte offset of slot `idx` (its header) in the segment.
    pub(crate) fn slot_offset(&self, idx: u32) -> usize {
        assert!(idx < self.geo.slots, "slot index within the geometry");
        layout::header_len(self.geo.n_readers)
            + idx as usize * layout::slot_stride(self.geo.slot_size)
    }
    fn slot_seq(&self, idx: u32) -> &AtomicU64 {
        // SAFETY: slot `idx` lies inside the mapping; 64-aligned header.
        unsafe { self.at(self.slot_offset(idx) + offset_of!(SlotHeader, seq)) }
    }
    fn slot_len(&self, idx: u32) -> &AtomicU64 {
        // SAFETY: as `slot_seq`.
        unsafe { self.at(self.slot_offset(idx) + offset_of!(SlotHeader, len)) }
    }

    /// Start of slot `idx`'s payload (`slot_size` bytes, 64-aligned).
    pub(crate) fn payload(&self, idx: u32) -> *mut u8 {
        let off = self.slot_offset(idx) + size_of::<SlotHeader>();
        // SAFETY: in bounds: the slot's payload lies inside the mapping.
        unsafe { self.base.add(off) }
    }

    /// Records reader `i`'s pid (informational).
    pub(crate) fn set_pid(&self, i: u32, pid: u32) {
        self.pid_word(i).store(pid, Ordering::Relaxed);
    }

    /// Reader `i`'s recorded pid.
    pub(crate) fn pid(&self, i: u32) -> u32 {
        self.pid_word(i).load(Ordering::Relaxed)
    }
}

/// The loom models' entry: a zeroed channel (as a fresh segment is) on heap
/// memory of the table in [`crate::atomics::word`], and its payloads as
/// loom cells, so that loom reports a slot rewritten under a reader.
#[cfg(all(test, pinshm_loom))]
impl ChannelPtr {
    /// A fresh channel of `geo` for this loom execution (call after the
    /// table's reset, before any model thread starts).
    pub fn heap(geo: ChannelGeometry) -> ChannelPtr {
        use crate::atomics::word::table;
        let len =
            layout::total_len(geo.n_readers, geo.slots, geo.slot_size).expect("a small geometry");
        // SAFETY: `mapping` gives `len` zeroed, page-aligned bytes that live
        // until the next reset, which comes after this execution ends.
        let chan = unsafe { ChannelPtr::new(table::mapping(len), geo) };
        // Every loom object made here, before any thread starts: an object
        // made lazily by one thread and used by another would be an
        // unsynchronised initialisation to loom.
        let _ = (chan.write_seq(), chan.closed());
        let _ = table::futex(chan.msg_event());
        let _ = table::futex(chan.slot_event());
        for i in 0..geo.n_readers {
            let _ = (chan.state(i), chan.released(i), chan.pid_word(i));
        }
        for idx in 0..geo.slots {
            let _ = (chan.slot_seq(idx), chan.slot_len(idx));
            let _ = table::cell(chan.payload(idx));
        }
        chan
    }

    /// Writes slot `idx`'s payload (loom checks it races with no read).
    pub fn write_payload(&self, idx: u32, v: u64) {
        // SAFETY: loom's cell checks the access; nothing else aliases it.
        crate::atomics::word::table::cell(self.payload(idx)).with_mut(|p| unsafe { *p = v });
    }

    /// Reads slot `idx`'s payload (loom checks it races with no write).
    pub fn read_payload(&self, idx: u32) -> u64 {
        // SAFETY: as `write_payload`.
        crate::atomics::word::table::cell(self.payload(idx)).with(|p| unsafe { *p })
    }
}

// ---------------------------------------------------------------------------
// The protocol steps, written once over the accessors above.
// ---------------------------------------------------------------------------

impl ChannelPtr {
    /// The process-local geometry.
    pub(crate) fn geometry(&self) -> ChannelGeometry {
        self.geo
    }

    // ---- writer ----

    /// Stamps slot `idx` with message `seq` of `len` bytes (the payload is
    /// written already); published by [`ChannelPtr::publish`].
    pub(crate) fn stamp_slot(&self, idx: u32, seq: u64, len: u64) {
        self.slot_len(idx).store(len, Ordering::Relaxed);
        self.slot_seq(idx).store(seq, Ordering::Relaxed);
    }

    /// Publishes messages `..count` (Release: their slots are visible to a
    /// reader that sees it), then wakes sleeping readers if there are any.
    pub(crate) fn publish(&self, count: u64) {
        self.write_seq().store(count, Ordering::Release);
        fence(Ordering::SeqCst);
        self.notify(self.msg_event(), i32::MAX);
    }

    /// Cancels the waits of the reader that owns `flag`: sets it, then
    /// wakes the readers sleeping on `msg_event` (see "Cancel" above).
    pub(crate) fn cancel_reader(&self, flag: &CancelFlag) {
        flag.0.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        self.notify(self.msg_event(), i32::MAX);
    }

    /// Cancels the waits of the writer (which owns `flag`): sets it, then
    /// wakes the writer if it sleeps on `slot_event`.
    pub(crate) fn cancel_writer(&self, flag: &CancelFlag) {
        flag.0.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        self.notify(self.slot_event(), 1);
    }

    /// Marks the channel closed and wakes every reader.
    pub(crate) fn close(&self) {
        self.closed().store(1, Ordering::Release);
        fence(Ordering::SeqCst);
        self.notify(self.msg_event(), i32::MAX);
    }

    // ---- event counts (`msg_event`, `slot_event`) ----

    /// Announces a sleeper on `word`, then the SeqCst fence after which the
    /// caller re-checks its condition. Returns the registration (the word
    /// with it counted), for [`ChannelPtr::sleep_on`] and [`ChannelPtr::withdraw`].
    fn announce(&self, word: &AtomicU32) -> u32 {
        let reg = word.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        fence(Ordering::SeqCst);
        reg
    }

    /// Sleeps on `word` while its epoch is still the registration's: a
    /// notify since the registration changed the epoch, and the kernel's
    /// compare then fails (or the wake that follows it ends the sleep).
    /// Acquire: a waker's writes before its notify are visible after.
    fn sleep_on(&self, word: &AtomicU32, reg: u32, timeout: Option<Duration>) {
        let cur = word.load(Ordering::Acquire);
        if cur & !WAITERS == reg & !WAITERS {
            futex_wait(word, cur, timeout);
        }
    }

    /// Withdraws a registration that no notify consumed (same epoch).
    fn withdraw(&self, word: &AtomicU32, reg: u32) {
        let mut cur = word.load(Ordering::Acquire);
        while cur & !WAITERS == reg & !WAITERS && cur & WAITERS != 0 {
            match word.compare_exchange(cur, cur - 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(c) => cur = c,
            }
        }
    }

    /// After the caller's SeqCst fence: if anyone is registered, starts a
    /// new epoch with no sleepers (Release: the caller's writes before are
    /// visible to whoever sees it) and wakes up to `n` sleepers. One wake
    /// serves every registration so far; without registrations, no system
    /// call.
    fn notify(&self, word: &AtomicU32, n: i32) {
        let mut cur = word.load(Ordering::Relaxed);
        while cur & WAITERS != 0 {
            let next = (cur & !WAITERS).wrapping_add(WAITERS + 1);
            match word.compare_exchange(cur, next, Ordering::Release, Ordering::Relaxed) {
                Ok(_) => {
                    futex_wake(word, n);
                    return;
                }
                Err(c) => cur = c,
            }
        }
    }

    /// Fence before a scan of the reader table: pairs with the attaching
    /// reader's fence (already run by the last `publish`, but a writer
    /// that has sent nothing yet needs it too).
    pub(crate) fn scan_fence(&self) {
        fence(Ordering::SeqCst);
    }

    /// Reader `i`'s state word (Acquire; after [`ChannelPtr::scan_fence`]).
    pub(crate) fn state_word(&self, i: u32) -> u64 {
        self.state(i).load(Ordering::Acquire)
    }

    /// Reader `i`'s release mark (Acquire: its reads of the slots below
    /// happen before the writer rewrites them).
    pub(crate) fn released_mark(&self, i: u32) -> u64 {
        self.released(i).load(Ordering::Acquire)
    }

    /// Marks reader `i` LEFT if its word is still exactly `word` (same
    /// generation, ATTACHED): a reader that re-attached meanwhile is safe.
    pub(crate) fn reap(&self, i: u32, word: u64) -> bool {
        let left = reader_state::word(reader_state::generation(word), reader_state::LEFT);
        self.state(i)
            .compare_exchange(word, left, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }

    /// Announces the writer as a sleeper on `slot_event`; returns its
    /// registration. The caller re-checks its condition before
    /// [`ChannelPtr::writer_sleep`].
    pub(crate) fn writer_announce(&self) -> u32 {
        self.announce(self.slot_event())
    }

    /// Sleeps unless a reader woke the writer since `reg`.
    pub(crate) fn writer_sleep(&self, reg: u32, timeout: Option<Duration>) {
        self.sleep_on(self.slot_event(), reg, timeout);
    }

    /// Withdraws the writer's registration if no reader consumed it.
    pub(crate) fn writer_awake(&self, reg: u32) {
        self.withdraw(self.slot_event(), reg);
    }

    // ---- reader ----

    /// Messages published (Acquire: pairs with [`ChannelPtr::publish`]).
    pub(crate) fn published(&self) -> u64 {
        self.write_seq().load(Ordering::Acquire)
    }

    /// Slot `idx`'s sequence number and length (after [`ChannelPtr::published`]).
    pub(crate) fn slot_meta(&self, idx: u32) -> (u64, u64) {
        (
            self.slot_seq(idx).load(Ordering::Relaxed),
            self.slot_len(idx).load(Ordering::Relaxed),
        )
    }

    /// Whether the writer closed the channel (Acquire: a poll after this
    /// sees every message it sent).
    pub(crate) fn is_closed(&self) -> bool {
        self.closed().load(Ordering::Acquire) != 0
    }

    /// Publishes reader `i`'s release mark, then wakes the writer if it
    /// sleeps.
    pub(crate) fn release(&self, i: u32, mark: u64) {
        self.released(i).store(mark, Ordering::Release);
        self.wake_writer_if_sleeping();
    }

    fn wake_writer_if_sleeping(&self) {
        fence(Ordering::SeqCst);
        self.notify(self.slot_event(), 1);
    }

    /// Announces a sleeping reader on `msg_event`; returns its
    /// registration. The caller re-checks before [`ChannelPtr::reader_sleep`].
    pub(crate) fn reader_announce(&self) -> u32 {
        self.announce(self.msg_event())
    }

    /// Sleeps unless the writer woke readers since `reg`.
    pub(crate) fn reader_sleep(&self, reg: u32, timeout: Option<Duration>) {
        self.sleep_on(self.msg_event(), reg, timeout);
    }

    /// Withdraws a reader's registration if the writer did not consume it.
    pub(crate) fn reader_awake(&self, reg: u32) {
        self.withdraw(self.msg_event(), reg);
    }

    /// Claims entry `i` (the caller holds its liveness lock): the new
    /// state word and the first sequence number this reader receives.
    pub(crate) fn claim(&self, i: u32) -> (u64, u64) {
        let mut word = self.state(i).load(Ordering::Acquire);
        loop {
            let gen = reader_state::next_generation(word);
            if reader_state::state(word) == reader_state::VACANT {
                // Expected since create: nothing it is owed was overwritten.
                let attached = reader_state::word(gen, reader_state::ATTACHED);
                match self.state(i).compare_exchange(
                    word,
                    attached,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => return (attached, 0),
                    Err(w) => word = w,
                }
                continue;
            }
            let attaching = reader_state::word(gen, reader_state::ATTACHING);
            if let Err(w) =
                self.state(i)
                    .compare_exchange(word, attaching, Ordering::AcqRel, Ordering::Acquire)
            {
                word = w; // the writer reaped the previous holder meanwhile
                continue;
            }
            let w1 = self.published();
            self.released(i).store(w1, Ordering::Release);
            let attached = reader_state::word(gen, reader_state::ATTACHED);
            self.state(i).store(attached, Ordering::Release);
            fence(Ordering::SeqCst);
            let w2 = self.published().max(w1);
            // A writer that saw `w1` may be asleep waiting for this mark.
            self.release(i, w2);
            return (attached, w2);
        }
    }

    /// Leaves entry `i` (state LEFT), then wakes the writer if it sleeps:
    /// it may have been waiting for this reader.
    pub(crate) fn leave(&self, i: u32, word: u64) {
        let left = reader_state::word(reader_state::generation(word), reader_state::LEFT);
        self.state(i).store(left, Ordering::Release);
        self.wake_writer_if_sleeping();
    }
}
