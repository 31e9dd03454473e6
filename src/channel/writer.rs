//! The writer: [`WriterCore`] is the protocol over [`ChannelPtr`] (run by loom as
//! is), [`Broadcast`] the segment, liveness and API around it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::atomics::{CancelFlag, ChannelPtr};
use super::spin::{spin_until, Spun};
use super::LIVENESS_RECHECK;
use crate::layout::reader_state;

/// Why [`WriterCore::wait_slot`] returned without a free slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Blocked {
    /// The deadline passed; the readers still in the way.
    TimedOut(Vec<u32>),
    /// The writer's [`CancelFlag`] is set (a `Canceller` was used).
    Cancelled,
}

/// The writer's side of the protocol: its own position (never read back
/// from shared memory) and a cached lower bound of the readers' marks.
#[derive(Debug)]
pub(crate) struct WriterCore {
    chan: ChannelPtr,
    /// Sequence number of the next message.
    next: u64,
    /// Its slot (`next % slots`).
    idx: u32,
    /// Every expected reader had released at least this many messages at
    /// the last scan: slots of messages below `gate` are free.
    gate: u64,
    /// Set by a canceller: every wait ends with [`Blocked::Cancelled`].
    cancel: Arc<CancelFlag>,
}

impl WriterCore {
    /// A writer at the start of a fresh channel.
    pub(crate) fn new(chan: ChannelPtr) -> WriterCore {
        WriterCore {
            chan,
            next: 0,
            idx: 0,
            gate: 0,
            cancel: Arc::new(CancelFlag::new()),
        }
    }

    /// The flag that cancels this writer's waits (set it through
    /// [`ChannelPtr::cancel_writer`], which also wakes the writer).
    pub(crate) fn cancel_flag(&self) -> &Arc<CancelFlag> {
        &self.cancel
    }

    /// The shared words.
    pub(crate) fn chan(&self) -> &ChannelPtr {
        &self.chan
    }

    /// Messages sent so far.
    pub(crate) fn sent(&self) -> u64 {
        self.next
    }

    /// The slot the next message goes to.
    pub(crate) fn slot(&self) -> u32 {
        self.idx
    }

    /// Whether the next message's slot is free: every expected reader has
    /// released the message that used it last. Scans the reader table only
    /// when the cached bound says no; collects the readers in the way.
    fn scan(&mut self, mut blockers: Option<&mut Vec<(u32, u64)>>) -> bool {
        let slots = self.chan.geometry().slots as u64;
        if self.next < self.gate + slots {
            return true;
        }
        self.chan.scan_fence();
        let mut min = self.next;
        for i in 0..self.chan.geometry().n_readers {
            let word = self.chan.state_word(i);
            let s = reader_state::state(word);
            if s != reader_state::VACANT && s != reader_state::ATTACHED {
                continue; // attaching, left, or scribbled: not expected
            }
            // A mark past what was sent can only be scribbled: clamp it.
            let mark = self.chan.released_mark(i).min(self.next);
            min = min.min(mark);
            if mark + slots <= self.next {
                if let Some(b) = blockers.as_deref_mut() {
                    b.push((i, word));
                }
            }
        }
        self.gate = min;
        self.next < min + slots
    }

    /// The expected readers that still hold the next message's slot (none
    /// when it is free): who a waiting writer waits for.
    pub(crate) fn blockers(&mut self) -> Vec<u32> {
        let mut b = Vec::new();
        self.scan(Some(&mut b));
        b.into_iter().map(|(i, _)| i).collect()
    }

    /// Waits until the next slot is free: spins for `spin`, then sleeps on
    /// the slot futex (re-checking who is alive at least every
    /// [`LIVENESS_RECHECK`]). A reader that `alive` says is dead stops
    /// being expected. `Err` says why not: the deadline passed (with the
    /// readers still in the way then), or the cancel flag is set (seen
    /// before it sleeps; the shell also refuses to start a wait once
    /// cancelled).
    pub(crate) fn wait_slot(
        &mut self,
        deadline: Option<Instant>,
        spin: Duration,
        alive: &dyn Fn(u32) -> bool,
    ) -> Result<(), Blocked> {
        if self.scan(None) {
            return Ok(());
        }
        if !spin.is_zero() && deadline.is_none_or(|d| d > Instant::now()) {
            let now = Instant::now();
            let until = now.checked_add(spin).unwrap_or(now);
            let cancel = Arc::clone(&self.cancel);
            let free = || Ok::<_, std::convert::Infallible>(self.scan(None).then_some(()));
            match spin_until(until, &cancel, free) {
                Ok(Spun::Got(())) => return Ok(()),
                Ok(Spun::Cancelled) => return Err(Blocked::Cancelled),
                Ok(Spun::TimeUp) | Err(_) => {}
            }
        }
        let mut blockers = Vec::new();
        loop {
            blockers.clear();
            if self.scan(Some(&mut blockers)) {
                return Ok(());
            }
            let mut reaped = false;
            for &(i, word) in &blockers {
                if reader_state::state(word) == reader_state::ATTACHED
                    && !alive(i)
                    && self.chan.reap(i, word)
                {
                    tracing::warn!(
                        reader = i,
                        "broadcast reader is gone; no longer waiting for it"
                    );
                    reaped = true;
                }
            }
            if reaped {
                continue;
            }
            let timeout = match deadline {
                None => LIVENESS_RECHECK,
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(Blocked::TimedOut(blockers.iter().map(|b| b.0).collect()));
                    }
                    (d - now).min(LIVENESS_RECHECK)
                }
            };
            let seen = self.chan.writer_announce();
            // After the announce's fence: the Dekker pair with a canceller.
            if self.cancel.is_set() {
                self.chan.writer_awake(seen);
                return Err(Blocked::Cancelled);
            }
            if self.scan(None) {
                self.chan.writer_awake(seen);
                return Ok(());
            }
            self.chan.writer_sleep(seen, Some(timeout));
            self.chan.writer_awake(seen);
        }
    }

    /// Publishes the message whose payload was written into [`Self::slot`].
    pub(crate) fn commit(&mut self, len: u64) {
        self.chan.stamp_slot(self.idx, self.next, len);
        self.next += 1;
        self.idx += 1;
        if self.idx == self.chan.geometry().slots {
            self.idx = 0;
        }
        self.chan.publish(self.next);
    }
}

pub use shell::Broadcast;

mod shell {
    use std::time::{Duration, Instant};

    use std::sync::Arc;

    use super::{Blocked, WriterCore};
    use crate::channel::atomics::ChannelPtr;
    use crate::channel::LIVENESS_RECHECK;
    use crate::channel::{BroadcastConfig, BroadcastHandle, CancelLink, Canceller};
    use crate::error::{Error, Result};
    use crate::geometry::ChannelGeometry;
    use crate::layout::channel::{self as layout, ChannelHeader};
    use crate::sys::fork;
    use crate::sys::liveness::{reader_slot, WRITER_SLOT};
    use crate::sys::segment::{self, Backing, Segment};

    /// The writer of a broadcast channel: one per channel, owner of its
    /// segment (unlinked on drop). Every message goes to every reader, in
    /// order; see the [crate docs](crate) for an example.
    #[derive(Debug)]
    pub struct Broadcast {
        core: WriterCore,
        spin: Duration,
        /// Shared with this writer's cancellers; detached at drop.
        cancel: Arc<CancelLink>,
        /// When each reader's liveness lock was last found held (a system
        /// call; asked at most once per [`LIVENESS_RECHECK`] per reader).
        reader_seen: Vec<Option<Instant>>,
        nonce: u64,
        /// The fork generation it was made in: a forked child's copy sends
        /// nothing and closes nothing (see `sys::fork`).
        fork_gen: u64,
        /// Which pages of a sparse segment are backed (all, if reserved).
        backing: Backing,
        // Last: unmapped (and unlinked) after everything that points into it.
        seg: Segment,
    }

    // SAFETY: the pointers inside `core` point into `seg`'s mapping, which
    // moves with the writer; sending takes `&mut self`.
    unsafe impl Send for Broadcast {}

    impl Broadcast {
        /// Creates the channel's segment (exclusively; a segment of the same
        /// name whose writer is dead is replaced) and becomes its writer.
        pub fn create(cfg: BroadcastConfig) -> Result<Broadcast> {
            cfg.validate()?;
            let fork_gen = fork::register();
            let name = cfg.name.clone().unwrap_or_else(segment::unique_name);
            let (n, slots, size) = (cfg.n_readers, cfg.slots, cfg.slot_size as u32);
            let total = layout::total_len(n, slots, size).ok_or_else(|| {
                Error::InvalidConfig(format!(
                    "slots ({slots}) x slot_size ({size}) overflows a channel's size"
                ))
            })?;
            crate::sys::check_segment_size(
                total as u64,
                &format!("slots ({slots}) x slot_size ({size})"),
            )?;
            // A dead writer's channel is replaced, unless its writer runs.
            let reserve = cfg.reserve;
            let seg = Segment::create_replacing(
                &name,
                total,
                reserve,
                reserve,
                cfg.name.is_some(),
                |old| {
                    let is_channel = old.len() >= size_of::<ChannelHeader>() as u64
                        && old.magic() == layout::MAGIC;
                    is_channel
                        .then(String::new)
                        .ok_or_else(|| "a broadcast channel".to_owned())
                },
            )?;
            // The header (reader table, futex words) is backed before it is
            // written: an error here, never SIGBUS.
            let mut backing = Backing::new(total as u64, reserve);
            backing.ensure(&seg, 0, layout::header_len(n) as u64)?;
            // Alive from here: nobody may take this segment for abandoned.
            if !seg.try_lock(WRITER_SLOT)? {
                return Err(Error::InUse {
                    name,
                    detail: "another process holds its writer lock".into(),
                });
            }
            let nonce = segment::random_u64() | 1;
            let header = ChannelHeader {
                magic: layout::MAGIC,
                version: layout::VERSION,
                n_readers: n,
                slots,
                slot_size: size,
                slot_stride: layout::slot_stride(size) as u64,
                header_len: layout::header_len(n) as u64,
                total_len: total as u64,
                nonce,
                spin_ns: cfg.spin.as_nanos().min(u64::MAX as u128) as u64,
                ..bytemuck::Zeroable::zeroed()
            };
            // SAFETY: the mapping is page aligned and `total` (> 256) bytes
            // long; nobody trusts it before the magic is stamped.
            unsafe {
                crate::atomics::init_header(seg.as_ptr(), &header);
                crate::atomics::stamp(seg.as_ptr(), layout::MAGIC);
            }
            let geo = ChannelGeometry {
                n_readers: n,
                slots,
                slot_size: size,
            };
            // SAFETY: the mapping holds `total_len(geo)` bytes, page aligned,
            // and `seg` (dropped last) keeps it alive as long as `core`.
            let chan = unsafe { ChannelPtr::new(seg.as_ptr(), geo) };
            tracing::debug!(name = %name, n_readers = n, slots, slot_size = size, "broadcast channel created");
            let core = WriterCore::new(chan.clone());
            let cancel = CancelLink::new(core.cancel_flag().clone(), chan, true, fork_gen);
            Ok(Broadcast {
                core,
                spin: cfg.spin,
                cancel,
                reader_seen: vec![None; n as usize],
                nonce,
                fork_gen,
                backing,
                seg,
            })
        }

        /// Sends `bytes` to every reader; blocks while the slot it needs is
        /// still unreleased by some expected reader.
        pub fn send(&mut self, bytes: &[u8]) -> Result<()> {
            self.send_with(bytes.len(), |b| b.copy_from_slice(bytes))
        }

        /// As [`Broadcast::send`], giving up after `timeout` with
        /// [`Error::Timeout`].
        pub fn send_timeout(&mut self, bytes: &[u8], timeout: Duration) -> Result<()> {
            self.check_len(bytes.len())?;
            self.wait(Some(timeout), "send_timeout")?;
            self.write(bytes.len(), |b| b.copy_from_slice(bytes))
        }

        /// Sends `bytes` if its slot is free now; `Ok(false)` if it would
        /// block.
        pub fn try_send(&mut self, bytes: &[u8]) -> Result<bool> {
            self.check_len(bytes.len())?;
            match self.wait(Some(Duration::ZERO), "try_send") {
                Ok(()) => {
                    self.write(bytes.len(), |b| b.copy_from_slice(bytes))?;
                    Ok(true)
                }
                Err(Error::Timeout { .. }) => Ok(false),
                Err(e) => Err(e),
            }
        }

        /// Sends a message of `len` bytes written in place by `fill` (the
        /// slot's previous bytes are not cleared).
        pub fn send_with<F: FnOnce(&mut [u8])>(&mut self, len: usize, fill: F) -> Result<()> {
            self.check_len(len)?;
            self.wait(None, "send")?;
            self.write(len, fill)
        }

        /// As [`Broadcast::send_with`], giving up after `timeout` with
        /// [`Error::Timeout`] (`fill` is then not called).
        pub fn send_with_timeout<F: FnOnce(&mut [u8])>(
            &mut self,
            len: usize,
            timeout: Duration,
            fill: F,
        ) -> Result<()> {
            self.check_len(len)?;
            self.wait(Some(timeout), "send_timeout")?;
            self.write(len, fill)
        }

        /// What readers need to attach (serde: send it anywhere).
        pub fn handle(&self) -> BroadcastHandle {
            let g = self.core.chan().geometry();
            BroadcastHandle {
                name: self.seg.name().to_owned(),
                nonce: self.nonce,
                layout_version: layout::VERSION,
                n_readers: g.n_readers,
                slots: g.slots,
                slot_size: g.slot_size,
            }
        }

        /// The segment's name.
        pub fn name(&self) -> &str {
            self.seg.name()
        }

        /// A handle that ends this writer's blocked `send` from another
        /// thread, at once, with [`Error::Cancelled`] (and every later
        /// one). Readers are not affected: they still drain what was sent.
        pub fn canceller(&self) -> Canceller {
            Canceller::new(self.cancel.clone())
        }

        /// Removes the name from /dev/shm now (it is otherwise removed on
        /// drop). The channel keeps working for every reader already
        /// attached; no new reader can attach. Once every reader has
        /// attached this makes the channel crash-proof: the kernel frees
        /// the memory when the last process unmaps it, however they end.
        /// Idempotent; a forked child's copy unlinks nothing.
        pub fn unlink(&self) {
            if fork::current() == self.fork_gen {
                self.seg.unlink_now();
            }
        }

        /// Messages sent so far.
        pub fn sent(&self) -> u64 {
            self.core.sent()
        }

        /// The readers holding up the next send, with the pid each recorded
        /// when it attached (`None`: the index was never attached, and is
        /// expected anyway). Empty when the next slot is free. For a log
        /// line that names who blocks; the answer may be stale at once.
        pub fn blocking_readers(&mut self) -> Vec<(u32, Option<u32>)> {
            if fork::current() != self.fork_gen {
                return Vec::new(); // the readers are the parent's
            }
            let blockers = self.core.blockers();
            let chan = self.core.chan();
            blockers
                .into_iter()
                .map(|i| (i, Some(chan.pid(i)).filter(|&p| p != 0)))
                .collect()
        }

        /// How many reader indices have attached since the channel was
        /// created, each counted once (whether it is still attached, has
        /// left or has died): what a writer waits for before it removes the
        /// channel's name (nobody else needs it to attach), and what vLLM's
        /// writer-side `wait_until_ready` waits for. `Forked` in a forked
        /// child (the readers are the parent's).
        pub fn attached_readers(&self) -> Result<u32> {
            if fork::current() != self.fork_gen {
                return Err(Error::Forked {
                    name: self.seg.name().to_owned(),
                });
            }
            let chan = self.core.chan();
            let n = chan.geometry().n_readers;
            let attached = (0..n)
                .filter(|&i| {
                    crate::layout::reader_state::state(chan.state_word(i))
                        != crate::layout::reader_state::VACANT
                })
                .count();
            Ok(attached as u32)
        }

        /// Largest message.
        pub fn slot_size(&self) -> usize {
            self.core.chan().geometry().slot_size as usize
        }

        fn check_len(&self, len: usize) -> Result<()> {
            // Every send checks this first: in a forked child the ring and
            // the readers' marks are the parent's.
            if fork::current() != self.fork_gen {
                return Err(Error::Forked {
                    name: self.seg.name().to_owned(),
                });
            }
            let max = self.slot_size();
            if len > max {
                return Err(Error::TooLarge {
                    size: len as u64,
                    max: max as u64,
                });
            }
            Ok(())
        }

        fn wait(&mut self, timeout: Option<Duration>, op: &'static str) -> Result<()> {
            // Cancelled: nothing is sent, even into a free slot.
            if self.core.cancel_flag().is_set() {
                return Err(Error::Cancelled {
                    op,
                    name: self.seg.name().to_owned(),
                });
            }
            // A timeout too long to add to the clock is no deadline.
            let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
            let seg = &self.seg;
            let seen = std::cell::RefCell::new(&mut self.reader_seen);
            // A dead reader is noticed within about two re-check periods
            // (the last "alive" answer is trusted for one period).
            let alive = |i: u32| {
                let mut seen = seen.borrow_mut();
                let fresh = seen[i as usize].is_some_and(|t| t.elapsed() < LIVENESS_RECHECK);
                fresh || {
                    let alive = seg.held_by_other(reader_slot(i));
                    seen[i as usize] = alive.then(Instant::now);
                    alive
                }
            };
            let spin = if timeout == Some(Duration::ZERO) {
                Duration::ZERO
            } else {
                self.spin
            };
            self.core
                .wait_slot(deadline, spin, &alive)
                .map_err(|why| match why {
                    Blocked::Cancelled => Error::Cancelled {
                        op,
                        name: self.seg.name().to_owned(),
                    },
                    Blocked::TimedOut(blockers) => Error::Timeout {
                        op,
                        after: timeout.unwrap_or_default(),
                        detail: format!(
                            "the next slot is still held by reader(s) {blockers:?} of channel '{}' (slow, stuck, or not attached yet: every reader index counts until it attaches and receives)",
                            self.seg.name()
                        ),
                    },
                })
        }

        /// Writes and publishes the next message; `NoSpace` (nothing sent)
        /// if its pages cannot be backed.
        fn write<F: FnOnce(&mut [u8])>(&mut self, len: usize, fill: F) -> Result<()> {
            let idx = self.core.slot();
            // The slot's header and the message's bytes, backed before the
            // first write into them (a no-op once backed).
            let off = self.core.chan().slot_offset(idx) as u64;
            let header = size_of::<layout::SlotHeader>() as u64;
            self.backing.ensure(&self.seg, off, header + len as u64)?;
            let p = self.core.chan().payload(idx);
            // SAFETY: `len <= slot_size` (checked) and the payload of a slot
            // holds `slot_size` bytes inside the mapping. The slot is free
            // (wait_slot): every expected reader has released the message
            // that used it, readers read only published slots they have not
            // released, and this one is published only by `commit` below;
            // `&mut self` makes this the only writer.
            let buf = unsafe { std::slice::from_raw_parts_mut(p, len) };
            fill(buf);
            self.core.commit(len as u64);
            Ok(())
        }
    }

    impl Drop for Broadcast {
        fn drop(&mut self) {
            if fork::current() != self.fork_gen {
                return; // a forked child's copy: the channel is the parent's
            }
            // Cancellers stop touching the mapping before it goes.
            self.cancel.detach();
            // Readers drain what was sent, then see `closed`.
            self.core.chan().close();
            tracing::debug!(
                name = self.seg.name(),
                sent = self.core.sent(),
                "broadcast writer closed"
            );
        }
    }
}
