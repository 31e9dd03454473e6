//! A reader: [`ReaderCore`] is the protocol over [`ChannelPtr`] (run by loom as
//! is), [`BroadcastReader`] and [`Message`] the segment, liveness and API
//! around it.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::atomics::{CancelFlag, ChannelPtr};
use super::spin::{spin_until, Caught, Spun, WaitPlan, WaitTrace};
use super::LIVENESS_RECHECK;

/// A received message: its sequence number, slot and length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Received {
    /// Sequence number (0 for the channel's first message).
    pub seq: u64,
    /// Slot index.
    pub slot: u32,
    /// Length (checked against the process-local slot size).
    pub len: usize,
}

/// What a wait ended with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Recv {
    /// The next message.
    Message(Received),
    /// Nothing left: the writer closed or died, and every message it sent
    /// was received.
    WriterGone,
    /// The deadline passed.
    TimedOut,
    /// The reader's [`CancelFlag`] is set (a `Canceller` was used).
    Cancelled,
    /// A message is there, not taken (the outcome of
    /// [`ReaderCore::wait_ready`], never of a receive).
    Ready,
}

/// Shared memory that contradicts the protocol (scribbled): which word,
/// and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Corrupt {
    /// The word at fault.
    pub field: &'static str,
    /// What was expected and found.
    pub detail: String,
}

/// A reader's side of the protocol; its position and release mark live in
/// its own memory and are only ever written to shared memory.
#[derive(Debug)]
pub(crate) struct ReaderCore {
    chan: ChannelPtr,
    index: u32,
    word: u64,
    /// Next sequence number to receive, and its slot.
    next: u64,
    idx: u32,
    /// What is released; shared with the messages, which release from
    /// any thread.
    releases: Arc<Releases>,
    /// Set by a canceller: every wait ends with [`Recv::Cancelled`].
    cancel: Arc<CancelFlag>,
}

/// The release side of one reader: which received messages are released,
/// and the mark it publishes. Shared by the reader and its messages, so a
/// message released on another thread, or after its reader is gone,
/// advances the mark at once. Its mutex is held only for the few steps of
/// a poll or a release, never across a wait.
#[derive(Debug)]
pub(crate) struct Releases {
    chan: ChannelPtr,
    index: u32,
    marks: Mutex<Marks>,
}

#[derive(Debug)]
struct Marks {
    /// Messages below this are released (and published as the mark).
    released: u64,
    /// Received, not yet released: `released + k` done iff `outstanding[k]`.
    outstanding: VecDeque<bool>,
}

// SAFETY: `chan` reaches shared memory only through atomics (valid while
// the mapping lives, which the owner of this `Releases` guarantees), and
// the process-local marks are behind the mutex.
unsafe impl Send for Releases {}
// SAFETY: as for `Send`: every access through `&Releases` is an atomic or
// under the mutex.
unsafe impl Sync for Releases {}

impl Releases {
    fn marks(&self) -> MutexGuard<'_, Marks> {
        // The marks are consistent after every step (a panic inside the
        // lock leaves nothing half-done that matters), so a poisoned lock
        // is used as is.
        self.marks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Releases message `seq` (received, not yet released). The mark
    /// advances over every message released so far in order.
    pub(crate) fn release(&self, seq: u64) {
        let mut m = self.marks();
        let Some(k) = seq
            .checked_sub(m.released)
            .and_then(|k| usize::try_from(k).ok())
        else {
            return;
        };
        if let Some(done) = m.outstanding.get_mut(k) {
            *done = true;
        }
        let mut advanced = 0u64;
        while m.outstanding.front() == Some(&true) {
            m.outstanding.pop_front();
            advanced += 1;
        }
        if advanced > 0 {
            m.released += advanced;
            // Under the lock: marks are published in order.
            self.chan.release(self.index, m.released);
        }
    }
}

impl ReaderCore {
    /// Claims entry `index`; the caller holds its liveness lock.
    pub(crate) fn claim(chan: ChannelPtr, index: u32) -> ReaderCore {
        let (word, start) = chan.claim(index);
        let slots = chan.geometry().slots as u64;
        ReaderCore {
            releases: Arc::new(Releases {
                chan: chan.clone(),
                index,
                marks: Mutex::new(Marks {
                    released: start,
                    outstanding: VecDeque::new(),
                }),
            }),
            chan,
            index,
            word,
            next: start,
            idx: (start % slots) as u32,
            cancel: Arc::new(CancelFlag::new()),
        }
    }

    /// The flag that cancels this reader's waits (set it through
    /// [`ChannelPtr::cancel_reader`], which also wakes the reader).
    pub(crate) fn cancel_flag(&self) -> &Arc<CancelFlag> {
        &self.cancel
    }

    /// The shared words.
    pub(crate) fn chan(&self) -> &ChannelPtr {
        &self.chan
    }

    /// The entry index.
    pub(crate) fn index(&self) -> u32 {
        self.index
    }

    /// Messages received and not yet released.
    pub(crate) fn held(&self) -> usize {
        self.releases.marks().outstanding.len()
    }

    /// The release side, for the messages received (see [`Releases`]).
    pub(crate) fn releases(&self) -> &Arc<Releases> {
        &self.releases
    }

    /// Whether a message is published that this reader has not received:
    /// a peek at the writer's sequence number, which takes nothing (no
    /// slot, no release owed) and changes no word of shared memory.
    pub(crate) fn ready(&self) -> Result<bool, Corrupt> {
        let published = self.chan.published();
        if published < self.next {
            return Err(Corrupt {
                field: "write_seq",
                detail: format!("went back to {published}, this reader is at {}", self.next),
            });
        }
        Ok(published > self.next)
    }

    /// The next message, taken ([`Recv::Message`]), or with `peek` only
    /// seen ([`Recv::Ready`]); `None` if nothing is published.
    fn look(&mut self, peek: bool) -> Result<Option<Recv>, Corrupt> {
        if peek {
            return Ok(self.ready()?.then_some(Recv::Ready));
        }
        Ok(self.poll()?.map(Recv::Message))
    }

    /// Waits until a message is there without taking it: [`Recv::Ready`]
    /// (a later poll takes it), or the end, a timeout or a cancel, as
    /// [`ReaderCore::wait`]. It sleeps on the message futex with the same
    /// announce, re-check, sleep steps as a receive, so a message sent
    /// meanwhile always wakes it; it never spins.
    pub(crate) fn wait_ready(
        &mut self,
        deadline: Option<Instant>,
        writer_alive: &dyn Fn() -> bool,
    ) -> Result<Recv, Corrupt> {
        if self.ready()? {
            return Ok(Recv::Ready);
        }
        let r = self.sleep(deadline, None, writer_alive, &mut false, true)?;
        Ok(r.expect("an untimed sleep ends with an outcome"))
    }

    /// The next message, if one is published.
    pub(crate) fn poll(&mut self) -> Result<Option<Received>, Corrupt> {
        let published = self.chan.published();
        if published <= self.next {
            if published < self.next {
                return Err(Corrupt {
                    field: "write_seq",
                    detail: format!("went back to {published}, this reader is at {}", self.next),
                });
            }
            return Ok(None);
        }
        let g = self.chan.geometry();
        let mut marks = self.releases.marks();
        if published - marks.released > g.slots as u64 {
            return Err(Corrupt {
                field: "write_seq",
                detail: format!(
                    "{published} is more than {} slots past this reader's release mark {}",
                    g.slots, marks.released
                ),
            });
        }
        let (seq, len) = self.chan.slot_meta(self.idx);
        if seq != self.next || len > g.slot_size as u64 {
            return Err(Corrupt {
                field: "slot header",
                detail: format!(
                    "slot {} says message {seq} of {len} bytes; expected message {} of at most {} bytes",
                    self.idx, self.next, g.slot_size
                ),
            });
        }
        let got = Received {
            seq,
            slot: self.idx,
            len: len as usize,
        };
        self.next += 1;
        self.idx += 1;
        if self.idx == g.slots {
            self.idx = 0;
        }
        marks.outstanding.push_back(false);
        Ok(Some(got))
    }

    /// Waits for the next message: spins for `spin` (yielding the CPU now
    /// and then, so a writer on the same core runs), then sleeps on the
    /// message futex, re-checking `writer_alive` at least every
    /// [`LIVENESS_RECHECK`]. A set cancel flag ends it before it sleeps
    /// (the shell also refuses to start a wait once cancelled).
    // The loom models' entry; the shell plans its waits.
    #[cfg_attr(not(all(test, pinshm_loom)), allow(dead_code))]
    pub(crate) fn wait(
        &mut self,
        deadline: Option<Instant>,
        spin: Duration,
        writer_alive: &dyn Fn() -> bool,
    ) -> Result<Recv, Corrupt> {
        self.wait_planned(deadline, WaitPlan::spin(spin), writer_alive)
            .map(|(r, _)| r)
    }

    /// As [`ReaderCore::wait`], following `plan`: spin for `plan.spin`;
    /// then, with a window `(wake, until)`, sleep on the futex (the same
    /// announce, re-check, sleep steps) with a timeout at `wake`, and spin
    /// from there until `until`; then sleep untimed. Says when the message
    /// came, and how late the timed sleep woke.
    pub(crate) fn wait_planned(
        &mut self,
        deadline: Option<Instant>,
        plan: WaitPlan,
        writer_alive: &dyn Fn() -> bool,
    ) -> Result<(Recv, WaitTrace), Corrupt> {
        let mut trace = WaitTrace::default();
        if let Some(m) = self.poll()? {
            return Ok((Recv::Message(m), trace));
        }
        if !plan.spin.is_zero() {
            trace.caught = Caught::Spin;
            if let Some(r) = self.spin_until(Instant::now() + plan.spin, deadline)? {
                return Ok((r, trace));
            }
        }
        if let Some((wake, until)) = plan.window {
            trace.caught = Caught::Early;
            let slept = Instant::now() < wake;
            if let Some(r) =
                self.sleep(deadline, Some(wake), writer_alive, &mut trace.slept, false)?
            {
                return Ok((r, trace));
            }
            if slept {
                trace.overshoot = Some(Instant::now().saturating_duration_since(wake));
            }
            trace.caught = Caught::Window;
            if let Some(r) = self.spin_until(until, deadline)? {
                return Ok((r, trace));
            }
        }
        trace.caught = Caught::Sleep;
        let r = self.sleep(deadline, None, writer_alive, &mut trace.slept, false)?;
        Ok((r.expect("an untimed sleep ends with an outcome"), trace))
    }

    /// Spins until `until` (or `deadline`, if sooner): a message, a
    /// cancel, or `None` (the time is up).
    fn spin_until(
        &mut self,
        until: Instant,
        deadline: Option<Instant>,
    ) -> Result<Option<Recv>, Corrupt> {
        let until = deadline.map_or(until, |d| d.min(until));
        let cancel = Arc::clone(&self.cancel);
        Ok(match spin_until(until, &cancel, || self.poll())? {
            Spun::Got(m) => Some(Recv::Message(m)),
            Spun::Cancelled => Some(Recv::Cancelled),
            Spun::TimeUp => None,
        })
    }

    /// Sleeps on the message futex until an outcome, or until `until`
    /// (`None`: no such limit) with `Ok(None)`. Announce, re-check, sleep,
    /// withdraw: the one protocol every sleep of a reader follows. Sets
    /// `slept` once it has waited on the futex. With `peek`, a message is
    /// seen ([`Recv::Ready`]), not taken.
    fn sleep(
        &mut self,
        deadline: Option<Instant>,
        until: Option<Instant>,
        writer_alive: &dyn Fn() -> bool,
        slept: &mut bool,
        peek: bool,
    ) -> Result<Option<Recv>, Corrupt> {
        loop {
            let seen = self.chan.reader_announce();
            let outcome = self.check(deadline, writer_alive, peek);
            let Ok(None) = outcome else {
                self.chan.reader_awake(seen);
                return outcome;
            };
            let now = Instant::now();
            let mut timeout = LIVENESS_RECHECK;
            for end in deadline.into_iter().chain(until) {
                timeout = timeout.min(end.saturating_duration_since(now));
            }
            if until.is_some_and(|u| now >= u) {
                self.chan.reader_awake(seen);
                return Ok(None);
            }
            self.chan.reader_sleep(seen, Some(timeout));
            *slept = true;
            self.chan.reader_awake(seen);
            if let Some(r) = self.look(peek)? {
                return Ok(Some(r));
            }
        }
    }

    /// One look after announcing: a message (taken, or with `peek` seen),
    /// the end, a timeout, or `None` (sleep).
    fn check(
        &mut self,
        deadline: Option<Instant>,
        writer_alive: &dyn Fn() -> bool,
        peek: bool,
    ) -> Result<Option<Recv>, Corrupt> {
        // After the announce's fence: the Dekker pair with a canceller.
        if self.cancel.is_set() {
            return Ok(Some(Recv::Cancelled));
        }
        // `closed` first: a poll after seeing it sees every message sent.
        let closed = self.chan.is_closed();
        if let Some(r) = self.look(peek)? {
            return Ok(Some(r));
        }
        if closed {
            return Ok(Some(Recv::WriterGone));
        }
        if !writer_alive() {
            // Dead: nothing more will be published; drain what was.
            return Ok(Some(self.look(peek)?.unwrap_or(Recv::WriterGone)));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(Some(Recv::TimedOut));
        }
        Ok(None)
    }

    /// Releases message `seq` (received, not yet released): see
    /// [`Releases::release`].
    // The loom models' entry; the shell's messages release directly.
    #[cfg_attr(not(all(test, pinshm_loom)), allow(dead_code))]
    pub(crate) fn release(&mut self, seq: u64) {
        self.releases.release(seq);
    }

    /// Leaves the entry (not expected any more).
    // The loom models' entry; the shell leaves with its last message.
    #[cfg_attr(not(all(test, pinshm_loom)), allow(dead_code))]
    pub(crate) fn leave(&self) {
        self.chan.leave(self.index, self.word);
    }
}

pub use shell::{BroadcastReader, Message};

mod shell {
    use std::cell::{Cell, RefCell};
    use std::ops::Deref;
    use std::time::{Duration, Instant};

    use std::sync::Arc;

    use super::{Corrupt, ReaderCore, Recv, Releases};
    use crate::channel::atomics::ChannelPtr;
    use crate::channel::spin::SpinPolicy;
    use crate::channel::spin::WaitPlan;
    use crate::channel::validate::validate;
    use crate::channel::{BroadcastHandle, CancelLink, Canceller, LIVENESS_RECHECK};
    use crate::error::{Error, Result};
    use crate::sys::fork;
    use crate::sys::liveness::{reader_slot, WRITER_SLOT};
    use crate::sys::segment::Segment;

    /// One reader of a broadcast channel, in one reader entry until dropped.
    /// Receives every message sent after the writer created the channel (a
    /// reader index that was never attached) or after it attached (an index
    /// taken over from a reader that left or died).
    ///
    /// `Send`, not `Sync`: one per thread. A [`Message`] owns its share of
    /// the reader's attachment: it may outlive the reader, and move to
    /// another thread, and the reader's entry stays until the last of them
    /// goes:
    ///
    /// ```
    /// use pinshm::{Broadcast, BroadcastConfig, BroadcastReader};
    /// # let name = format!("pinshm-doc-message-outlives-{}", std::process::id());
    /// let mut tx = Broadcast::create(BroadcastConfig::new(1, 4, 64).name(&name)).unwrap();
    /// tx.send(b"hi").unwrap();
    /// let m = {
    ///     let rx = BroadcastReader::attach(&tx.handle()).unwrap();
    ///     rx.recv().unwrap()
    /// };
    /// assert_eq!(&*m, b"hi");
    /// ```
    ///
    /// It is not `Sync` (share it, and two threads could receive the
    /// same position at once):
    ///
    /// ```compile_fail
    /// fn sync<T: Sync>() {}
    /// sync::<pinshm::BroadcastReader>();
    /// ```
    #[derive(Debug)]
    pub struct BroadcastReader {
        core: RefCell<ReaderCore>,
        /// The spin before sleeping, learned from recent waits.
        spin: Cell<SpinPolicy>,
        /// Shared with this reader's cancellers; detached at drop.
        cancel: Arc<CancelLink>,
        /// When the writer's liveness lock was last found held (a system
        /// call; asked at most once per [`LIVENESS_RECHECK`] while waiting).
        writer_seen: Cell<Option<Instant>>,
        // Last: the mapping goes after everything that points into it.
        at: Arc<Attachment>,
    }

    // SAFETY: the pointers inside `core` point into the mapping that `at`
    // keeps alive wherever the reader goes; the RefCell makes it !Sync, so
    // one thread at a time uses it. What its messages share with it
    // (`Releases`, `Attachment`) is `Sync`.
    unsafe impl Send for BroadcastReader {}

    /// A reader's entry (and liveness lock) and its mapping, shared by the
    /// reader and its messages: left when the last of them goes, so the
    /// writer keeps expecting the reader, and keeps off a held message's
    /// slot, while any message lives. A message leaked with `mem::forget`
    /// keeps the entry until the process exits (the writer then waits or
    /// times out on that slot, as for an unreleased message).
    #[derive(Debug)]
    struct Attachment {
        releases: Arc<Releases>,
        index: u32,
        word: u64,
        /// The fork generation it attached in: a forked child's copy reads
        /// and releases nothing (see `sys::fork`).
        fork_gen: u64,
        // Last: unmapped after everything that points into it.
        seg: Segment,
    }

    impl Attachment {
        /// Whether this is the process that attached (not a forked child).
        fn is_owner(&self) -> bool {
            fork::current() == self.fork_gen
        }
    }

    impl Drop for Attachment {
        fn drop(&mut self) {
            if !self.is_owner() {
                return; // a forked child's copy: the entry is the parent's
            }
            // The reader and its messages are gone: leave, then let the
            // lock go (closing the segment would too).
            self.releases.chan.leave(self.index, self.word);
            self.seg.unlock(reader_slot(self.index));
            tracing::debug!(name = self.seg.name(), "broadcast reader detached");
        }
    }

    impl BroadcastReader {
        /// Attaches into the first free reader index.
        pub fn attach(h: &BroadcastHandle) -> Result<BroadcastReader> {
            Self::attach_inner(h, None)
        }

        /// Attaches as reader `index` (a tensor-parallel rank, say).
        pub fn attach_as(h: &BroadcastHandle, index: u32) -> Result<BroadcastReader> {
            Self::attach_inner(h, Some(index))
        }

        fn attach_inner(h: &BroadcastHandle, index: Option<u32>) -> Result<BroadcastReader> {
            let fork_gen = fork::register();
            // Mapped without pre-faulting: faulting a hole of a sparse
            // segment would allocate it. A reserved one is faulted in.
            let seg = Segment::open(&h.name, false)?;
            if seg.is_reserved() {
                seg.prefault();
            }
            let (geo, spin) = validate(&seg, h)?;
            // SAFETY: `validate` checked the header against the mapping's
            // length; `seg` (dropped last) keeps the mapping alive.
            let chan = unsafe { ChannelPtr::new(seg.as_ptr(), geo) };
            let candidates = match index {
                Some(i) if i >= geo.n_readers => {
                    return Err(Error::ReaderIndexOutOfRange {
                        index: i,
                        n_readers: geo.n_readers,
                    })
                }
                Some(i) => i..i + 1,
                None => 0..geo.n_readers,
            };
            for i in candidates {
                // The lock first: a live reader's entry is never taken over.
                if !seg.try_lock(reader_slot(i))? {
                    if index.is_some() {
                        return Err(Error::ReaderSlotTaken {
                            index: i,
                            pid: chan.pid(i),
                        });
                    }
                    continue;
                }
                let core = ReaderCore::claim(chan.clone(), i);
                chan.set_pid(i, std::process::id());
                tracing::debug!(name = %h.name, index = i, from = core.next, "broadcast reader attached");
                let cancel =
                    CancelLink::new(core.cancel_flag().clone(), chan.clone(), false, fork_gen);
                let at = Arc::new(Attachment {
                    releases: Arc::clone(core.releases()),
                    index: i,
                    word: core.word,
                    fork_gen,
                    seg,
                });
                return Ok(BroadcastReader {
                    core: RefCell::new(core),
                    spin: Cell::new(SpinPolicy::new(spin)),
                    cancel,
                    writer_seen: Cell::new(None),
                    at,
                });
            }
            Err(Error::NoReaderSlot {
                n_readers: geo.n_readers,
            })
        }

        /// This reader's index.
        pub fn index(&self) -> u32 {
            self.core.borrow().index()
        }

        /// The channel's segment name.
        pub fn name(&self) -> &str {
            self.at.seg.name()
        }

        /// The longest `recv` spins before sleeping (default: the
        /// channel's, see [`BroadcastConfig::spin`](crate::BroadcastConfig::spin));
        /// within it, each receive spins as long as recent waits suggest
        /// pays, and around the predicted arrival when messages come at a
        /// steady period (`channel::spin`). Zero: sleep at once, always.
        pub fn set_spin(&mut self, spin: Duration) {
            self.spin.set(SpinPolicy::new(spin));
        }

        /// How long the next `recv` would spin at once before sleeping
        /// (a learned period adds a spin around the next arrival instead:
        /// see `channel::spin`).
        pub fn spin_window(&self) -> Duration {
            self.spin.get().window()
        }

        /// A handle that ends this reader's blocked `recv` from another
        /// thread, at once, with [`Error::Cancelled`] (and every later one).
        pub fn canceller(&self) -> Canceller {
            Canceller::new(self.cancel.clone())
        }

        /// The next message, waiting as long as it takes. After the writer
        /// is dropped or dies, every message it sent is still received,
        /// then [`Error::WriterGone`]. A reader that already holds a
        /// [`Message`] in every slot gets [`Error::TooManyGuards`] (the
        /// writer could never send it another one).
        pub fn recv(&self) -> Result<Message> {
            self.recv_deadline(None, "recv")
        }

        /// As [`BroadcastReader::recv`], giving up after `timeout` with
        /// [`Error::Timeout`].
        pub fn recv_timeout(&self, timeout: Duration) -> Result<Message> {
            self.recv_deadline(Some(timeout), "recv_timeout")
        }

        /// The next message if one is there; `Ok(None)` if not.
        pub fn try_recv(&self) -> Result<Option<Message>> {
            match self.recv_deadline(Some(Duration::ZERO), "try_recv") {
                Ok(m) => Ok(Some(m)),
                Err(Error::Timeout { .. }) => Ok(None),
                Err(e) => Err(e),
            }
        }

        /// Whether the writer is still there (holds its liveness lock).
        /// False in a forked child, which cannot tell (the reader is the
        /// parent's: attach anew).
        pub fn writer_alive(&self) -> bool {
            self.is_owner() && self.at.seg.held_by_other(WRITER_SLOT)
        }

        /// Whether [`BroadcastReader::recv`] would return at once: a
        /// message is there that this reader has not received, or the
        /// writer closed the channel (`recv` then ends with
        /// [`Error::WriterGone`] at once). A peek at the writer's sequence
        /// number: it takes nothing and writes nothing to shared memory,
        /// so asking in a loop costs a few loads. A writer that died
        /// without closing is noticed by [`BroadcastReader::wait_ready`]
        /// and `recv` (a system call), not here. After a cancel:
        /// [`Error::Cancelled`].
        pub fn is_ready(&self) -> Result<bool> {
            self.may_wait("is_ready")?;
            let core = self.core.borrow();
            let ready = core.ready().map_err(|c| self.corrupt(c))?;
            Ok(ready || core.chan().is_closed())
        }

        /// Waits until [`BroadcastReader::is_ready`] would say `true`, for
        /// at most `timeout`, taking nothing: `Ok(true)` once a message is
        /// there or the writer is gone (closed, or dead: `recv` then
        /// returns at once), `Ok(false)` when the time is up. It sleeps on
        /// the channel's futex with the protocol of a receive, so a
        /// message sent meanwhile always wakes it, and never spins.
        /// [`Error::Cancelled`] once cancelled (a wait in progress ends at
        /// once).
        pub fn wait_ready(&self, timeout: Duration) -> Result<bool> {
            self.may_wait("wait_ready")?;
            let deadline = Instant::now().checked_add(timeout);
            let alive = || self.writer_alive_recently();
            let got = self.core.borrow_mut().wait_ready(deadline, &alive);
            match got.map_err(|c| self.corrupt(c))? {
                Recv::Ready | Recv::WriterGone | Recv::Message(_) => Ok(true),
                Recv::TimedOut => Ok(false),
                Recv::Cancelled => Err(Error::Cancelled {
                    op: "wait_ready",
                    name: self.at.seg.name().to_owned(),
                }),
            }
        }

        /// `Forked` in a forked child; `Cancelled` (as `op`) once cancelled:
        /// no wait starts, whether or not a message is there.
        fn may_wait(&self, op: &'static str) -> Result<()> {
            if !self.is_owner() {
                return Err(Error::Forked {
                    name: self.at.seg.name().to_owned(),
                });
            }
            if self.core.borrow().cancel_flag().is_set() {
                return Err(Error::Cancelled {
                    op,
                    name: self.at.seg.name().to_owned(),
                });
            }
            Ok(())
        }

        /// Whether the writer is alive, asking the kernel at most once per
        /// [`LIVENESS_RECHECK`]: a dead writer is noticed within about two
        /// periods (the last "alive" answer is trusted for one), so a
        /// reader that sleeps and wakes often asks rarely.
        fn writer_alive_recently(&self) -> bool {
            let fresh = self
                .writer_seen
                .get()
                .is_some_and(|t| t.elapsed() < LIVENESS_RECHECK);
            fresh || {
                let alive = self.writer_alive();
                self.writer_seen.set(alive.then(Instant::now));
                alive
            }
        }

        fn recv_deadline(&self, timeout: Option<Duration>, op: &'static str) -> Result<Message> {
            self.may_wait(op)?;
            let t0 = Instant::now();
            // A timeout too long to add to the clock is no deadline.
            let deadline = timeout.and_then(|t| t0.checked_add(t));
            let plan = if timeout == Some(Duration::ZERO) {
                WaitPlan::spin(Duration::ZERO)
            } else {
                self.spin.get().plan(t0)
            };
            // Holding a message in every slot, this reader itself keeps the
            // writer from sending more: waiting would never end.
            let slots = self.core.borrow().chan().geometry().slots as usize;
            if self.core.borrow().held() >= slots {
                return Err(Error::TooManyGuards { limit: slots });
            }
            let alive = || self.writer_alive_recently();
            let got = self.core.borrow_mut().wait_planned(deadline, plan, &alive);
            let (got, trace) = got.map_err(|c| self.corrupt(c))?;
            if timeout != Some(Duration::ZERO) {
                let mut policy = self.spin.get();
                let now = Instant::now();
                match got {
                    Recv::Message(_) => policy.learn(t0, now, trace),
                    Recv::TimedOut => policy.timed_out(now),
                    Recv::Cancelled => {
                        policy.gave_up();
                        policy.forget();
                    }
                    Recv::WriterGone | Recv::Ready => {}
                }
                self.spin.set(policy);
            }
            match got {
                Recv::Cancelled => Err(Error::Cancelled {
                    op,
                    name: self.at.seg.name().to_owned(),
                }),
                Recv::Message(m) => {
                    let p = self.core.borrow().chan().payload(m.slot);
                    Ok(Message {
                        at: Arc::clone(&self.at),
                        seq: m.seq,
                        data: p,
                        len: m.len,
                    })
                }
                Recv::WriterGone => Err(Error::WriterGone {
                    name: self.at.seg.name().to_owned(),
                }),
                // A receive takes what it finds; only `wait_ready` peeks.
                Recv::Ready => Err(self.corrupt(Corrupt {
                    field: "reader",
                    detail: "a receive ended with a peek".to_owned(),
                })),
                Recv::TimedOut => Err(Error::Timeout {
                    op,
                    after: timeout.unwrap_or_default(),
                    detail: format!(
                        "no message on channel '{}' (the writer is alive, it sent nothing new)",
                        self.at.seg.name()
                    ),
                }),
            }
        }

        /// Whether this is the process that attached (not a forked child).
        fn is_owner(&self) -> bool {
            self.at.is_owner()
        }

        fn corrupt(&self, c: Corrupt) -> Error {
            tracing::debug!(name = self.at.seg.name(), field = c.field, detail = %c.detail, "corrupt channel");
            Error::BadHeader {
                name: self.at.seg.name().to_owned(),
                field: c.field,
                detail: c.detail,
            }
        }
    }

    impl Drop for BroadcastReader {
        fn drop(&mut self) {
            if !self.is_owner() {
                return; // a forked child's copy: the entry is the parent's
            }
            // Cancellers stop touching the mapping before it goes. The
            // entry is left by the attachment, once its messages are gone.
            self.cancel.detach();
        }
    }

    /// A message, in place in its slot: derefs to its bytes. While it lives
    /// the writer cannot reuse the slot; dropping it releases it, from any
    /// thread, before or after its reader is dropped. Soundness does not
    /// rest on the drop: a forgotten `Message` keeps its slot (the writer
    /// waits or times out) and its reader's entry and mapping.
    #[derive(Debug)]
    pub struct Message {
        at: Arc<Attachment>,
        seq: u64,
        data: *const u8,
        len: usize,
    }

    // SAFETY: `data` points into the mapping that `at` keeps alive, and is
    // only read (bytes nobody writes while the message is unreleased); the
    // drop releases through `Releases`, which is `Sync`.
    unsafe impl Send for Message {}
    // SAFETY: through `&Message` only the read-only payload and plain
    // values are read.
    unsafe impl Sync for Message {}

    impl Message {
        /// Sequence number (0 for the channel's first message).
        pub fn seq(&self) -> u64 {
            self.seq
        }
    }

    impl Deref for Message {
        type Target = [u8];
        fn deref(&self) -> &[u8] {
            // SAFETY: `data..data+len` is the payload of a slot of the
            // mapping (`len <= slot_size`, checked against the process-local
            // geometry), which `at` keeps mapped. This reader
            // has not released the message, and the writer rewrites a slot
            // only after every expected reader released it (and this reader
            // is expected while attached), so nobody writes these bytes
            // while the slice lives.
            unsafe { std::slice::from_raw_parts(self.data, self.len) }
        }
    }

    impl AsRef<[u8]> for Message {
        fn as_ref(&self) -> &[u8] {
            self
        }
    }

    impl Drop for Message {
        fn drop(&mut self) {
            if !self.at.is_owner() {
                return; // a forked child's copy: the mark is the parent's
            }
            self.at.releases.release(self.seq);
        }
    }
}
