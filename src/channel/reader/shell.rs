//! The shell around `ReaderCore`: [`BroadcastReader`]
//! and [`Message`], the segment, liveness and API around the protocol.

use std::cell::{Cell, RefCell};
use std::ops::Deref;
use std::time::{Duration, Instant};

use std::sync::Arc;

use super::{Corrupt, ReaderCore, Recv, Releases};
use crate::channel::atomics::ChannelPtr;
use crate::channel::spin::WaitPlan;
use crate::channel::spin::{SpinPolicy, WaitStats};
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
/// use pinshm::{Broadcast, BroadcastReader, channel::BroadcastConfig};
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
            let cancel = CancelLink::new(core.cancel_flag().clone(), chan.clone(), false, fork_gen);
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
    /// channel's, see [`BroadcastConfig::spin`](crate::channel::BroadcastConfig::spin));
    /// within it, each receive spins as long as recent waits suggest
    /// pays, and around the predicted arrival when messages come at a
    /// steady period (`channel::spin`). Zero: sleep at once, always.
    pub fn set_spin(&mut self, spin: Duration) {
        let counted = self.spin.get();
        self.spin.set(SpinPolicy::new(spin).with_stats(&counted));
    }

    /// How this reader's receives found their messages so far: already
    /// there, in the short spin, in the spin around a predicted arrival,
    /// or after a futex sleep (see [`WaitStats`]).
    pub fn wait_stats(&self) -> WaitStats {
        self.spin.get().stats()
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
