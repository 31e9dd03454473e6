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
        Ok(self.published()? > self.next)
    }

    /// The writer's sequence number, which never goes back past this
    /// reader's position (else the segment was scribbled).
    fn published(&self) -> Result<u64, Corrupt> {
        let published = self.chan.published();
        if published < self.next {
            return Err(Corrupt {
                field: "write_seq",
                detail: format!("went back to {published}, this reader is at {}", self.next),
            });
        }
        Ok(published)
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
        let published = self.published()?;
        if published == self.next {
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

mod shell;
