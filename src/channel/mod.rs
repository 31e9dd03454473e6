//! The broadcast channel: one writer, `n_readers` readers, a ring of
//! `slots` fixed-size slots in its own named segment. Every reader receives
//! every message, in send order, in place.
//!
//! Waiting: a reader spins only while it pays (a window learned from its
//! recent waits, at most [`BroadcastConfig::spin`]; with a steady period,
//! a timed sleep to just before the predicted arrival and a short spin
//! around it); the writer waiting for a slot spins for `spin`. Then each
//! sleeps on a futex in the segment. A [`Canceller`] ends a wait from
//! another thread at once. A sleeping party wakes at least every quarter
//! of a second and asks the kernel whether the other side's open-file-description lock is
//! still held (trusting an "alive" answer for one period, so a party that
//! sleeps and wakes often makes that system call rarely): a dead reader
//! stops blocking the writer, and a dead writer's readers get
//! [`Error::WriterGone`](crate::Error::WriterGone), within about two
//! periods (half a second).

// The module's parts:
// * `crate::layout::channel`: the `#[repr(C)]` structs of the segment and
//   its version, beside the store's.
// * `atomics`: every atomic access and futex call, with the ordering table
//   and the no-lost-wake-up argument.
// * `writer` / `reader`: the protocol cores (run by loom unchanged)
//   and the public types around them.
// * `spin`: how long a reader spins before it sleeps (`SpinPolicy`).

pub(crate) mod atomics;
// The channel segment's layout sits with the store's, below both stacks.
use crate::layout::channel as layout;
pub(crate) mod reader;
pub(crate) mod spin;
mod validate;
pub(crate) mod writer;

#[cfg(all(test, pinshm_loom))]
mod loom_tests;

use std::time::Duration;

pub use reader::{BroadcastReader, Message};
pub use spin::WaitStats;
pub use writer::Broadcast;

/// Longest a sleeping writer or reader sleeps before re-checking whether
/// the other side is alive (a futex wait timeout; a wake ends it sooner),
/// and how long an "alive" answer is trusted.
pub(crate) const LIVENESS_RECHECK: Duration = Duration::from_millis(250);

/// Default longest spin before sleeping: long enough to bridge a reply that
/// comes back within tens of µs (a round trip), far shorter than the gap
/// between decode steps (5 ms), so a reader between steps sleeps at once.
pub(crate) const DEFAULT_SPIN: Duration = Duration::from_micros(200);

/// Longest spin a segment's header may ask its readers for.
pub(crate) const MAX_SPIN: Duration = Duration::from_secs(1);

/// How to create a [`Broadcast`].
#[derive(Debug, Clone)]
pub struct BroadcastConfig {
    pub(crate) n_readers: u32,
    pub(crate) slots: u32,
    pub(crate) slot_size: usize,
    pub(crate) name: Option<String>,
    pub(crate) spin: Duration,
    pub(crate) reserve: bool,
}

impl BroadcastConfig {
    /// `n_readers` readers (1 to 64), a ring of `slots` slots, messages of
    /// up to `slot_size` bytes.
    pub fn new(n_readers: u32, slots: u32, slot_size: usize) -> Self {
        BroadcastConfig {
            n_readers,
            slots,
            slot_size,
            name: None,
            spin: DEFAULT_SPIN,
            reserve: false,
        }
    }

    /// Whether to take every page of /dev/shm at create (default false).
    /// Unreserved, the channel costs the pages its messages touch: the
    /// writer backs (`fallocate`) the bytes of a message just before it
    /// first writes them, so a full /dev/shm is [`Error::NoSpace`](crate::Error::NoSpace)
    /// from that send, never SIGBUS, and readers never fault on unbacked
    /// pages. Reserved, a too-small /dev/shm fails at create and every page
    /// is faulted in up front.
    pub fn reserve(mut self, yes: bool) -> Self {
        self.reserve = yes;
        self
    }

    /// The segment name (default: a unique one).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// How long the writer spins before sleeping on the futex, and the
    /// longest each reader spins by default (a reader spins only as long as
    /// its recent waits suggest pays, see `channel::spin`). Default 200 µs,
    /// at most 1 s; zero: sleep at once.
    pub fn spin(mut self, spin: Duration) -> Self {
        self.spin = spin.min(MAX_SPIN);
        self
    }

    pub(crate) fn validate(&self) -> crate::Result<()> {
        let bad = |m: String| Err(crate::Error::InvalidConfig(m));
        if self.n_readers == 0 || self.n_readers > layout::MAX_READERS {
            return bad(format!(
                "n_readers is {}; use 1 to {}",
                self.n_readers,
                layout::MAX_READERS
            ));
        }
        if self.slots == 0 || self.slots > layout::MAX_SLOTS {
            return bad(format!(
                "slots is {}; use 1 to {}",
                self.slots,
                layout::MAX_SLOTS
            ));
        }
        if self.slot_size == 0 || self.slot_size > layout::MAX_SLOT_SIZE as usize {
            return bad(format!(
                "slot_size is {}; use 1 to {} (put larger payloads in an ObjectStore and send their handles)",
                self.slot_size,
                layout::MAX_SLOT_SIZE
            ));
        }
        Ok(())
    }
}

/// Ends the blocked `send`/`recv` of one [`Broadcast`] or
/// [`BroadcastReader`] from another thread, at once (a futex wake, no
/// polling), and every later one: they return
/// [`Error::Cancelled`](crate::Error::Cancelled). For a shutdown; it cannot
/// be undone. Made by [`Broadcast::canceller`] or
/// [`BroadcastReader::canceller`]; `Send + Sync + Clone`, and it may
/// outlive its writer or reader (cancelling then does nothing).
///
/// ```
/// use pinshm::{Broadcast, BroadcastReader, Error, channel::BroadcastConfig};
/// let tx = Broadcast::create(BroadcastConfig::new(1, 2, 64)).unwrap();
/// let rx = BroadcastReader::attach(&tx.handle()).unwrap();
/// let cancel = rx.canceller();
/// let t = std::thread::spawn(move || matches!(rx.recv(), Err(Error::Cancelled { .. })));
/// cancel.cancel();
/// assert!(t.join().unwrap());
/// ```
#[derive(Clone, Debug)]
pub struct Canceller {
    link: std::sync::Arc<CancelLink>,
}

/// What a [`Canceller`] shares with its owner: the owner's flag, and its
/// channel words while its mapping lives (the owner clears `chan`, under
/// the mutex, before it unmaps).
#[derive(Debug)]
pub(crate) struct CancelLink {
    flag: std::sync::Arc<atomics::CancelFlag>,
    chan: std::sync::Mutex<Option<atomics::ChannelPtr>>,
    writer: bool,
    /// The owner's fork generation: in a forked child a canceller does
    /// nothing (the owner is the parent's, and the child never detaches).
    fork_gen: u64,
}

// SAFETY: the only thread-bound part is the `ChannelPtr` (pointers into the
// owner's mapping). It is used only under the mutex, and only while it is
// `Some`: the owner sets it to `None` under the same mutex before its
// mapping goes (`CancelLink::detach`), so no use outlives the mapping (in
// a forked child, where the owner's drop does not detach, `cancel` does
// not touch it at all). The
// words it touches are atomics in shared memory, meant for any thread.
unsafe impl Send for CancelLink {}
// SAFETY: as for `Send`: every access to the `ChannelPtr` is under the mutex.
unsafe impl Sync for CancelLink {}

impl CancelLink {
    pub(crate) fn new(
        flag: std::sync::Arc<atomics::CancelFlag>,
        chan: atomics::ChannelPtr,
        writer: bool,
        fork_gen: u64,
    ) -> std::sync::Arc<CancelLink> {
        std::sync::Arc::new(CancelLink {
            flag,
            chan: std::sync::Mutex::new(Some(chan)),
            writer,
            fork_gen,
        })
    }

    /// The owner is going (its mapping with it): cancellers do nothing now.
    pub(crate) fn detach(&self) {
        *self.chan.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

impl Canceller {
    pub(crate) fn new(link: std::sync::Arc<CancelLink>) -> Canceller {
        Canceller { link }
    }

    /// Ends the owner's wait in progress, if any, and makes every later one
    /// end the same way ([`Error::Cancelled`](crate::Error::Cancelled)).
    /// Idempotent; does nothing once the owner is dropped, nor in a forked
    /// child.
    pub fn cancel(&self) {
        if crate::sys::fork::current() != self.link.fork_gen {
            return;
        }
        let chan = self.link.chan.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(chan) = chan.as_ref() {
            if self.link.writer {
                chan.cancel_writer(&self.link.flag);
            } else {
                chan.cancel_reader(&self.link.flag);
            }
        }
    }

    /// Whether [`Canceller::cancel`] was called (by any clone).
    pub fn is_cancelled(&self) -> bool {
        self.link.flag.is_set()
    }
}

/// What a reader needs to attach to a channel: serde, `Clone + Send`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BroadcastHandle {
    /// Segment name.
    pub name: String,
    /// The channel's nonce (a recreated channel of the same name differs).
    pub nonce: u64,
    /// Layout version of the writer (as `StoreHandle::layout_version`).
    pub layout_version: u32,
    /// Reader entries.
    pub n_readers: u32,
    /// Slots.
    pub slots: u32,
    /// Largest message.
    pub slot_size: u32,
}
