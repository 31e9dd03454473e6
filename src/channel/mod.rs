//! The broadcast channel: one writer, `n_readers` readers, a ring of
//! `slots` fixed-size slots in its own named segment. Every reader receives
//! every message, in send order, in place.
//!
//! * [`layout`]: the `#[repr(C)]` structs of the segment and its version.
//! * [`shm`]: every atomic access and futex call, with the ordering table
//!   and the no-lost-wake-up argument.
//! * [`writer`] / [`reader`]: the protocol cores (run by loom unchanged)
//!   and the public types around them.
//!
//! Waiting: spin for [`BroadcastConfig::spin`], then sleep on a futex in the
//! segment. A sleeping party wakes at least every [`LIVENESS_RECHECK`] and
//! asks the kernel whether the other side's open-file-description lock is
//! still held (trusting an "alive" answer for one period, so a party that
//! sleeps and wakes often makes that system call rarely): a dead reader
//! stops blocking the writer, and a dead writer's readers get
//! [`Error::WriterGone`](crate::Error::WriterGone), within about two
//! periods (half a second).

// In loom builds the segment-backed half is compiled out.
#![cfg_attr(loom, allow(dead_code))]

pub mod layout;
pub mod reader;
pub mod shm;
pub mod writer;

use std::time::Duration;

#[cfg(not(loom))]
pub use reader::{BroadcastReader, Message};
#[cfg(not(loom))]
pub use writer::Broadcast;

/// Longest a sleeping writer or reader sleeps before re-checking whether
/// the other side is alive (a futex wait timeout; a wake ends it sooner),
/// and how long an "alive" answer is trusted.
pub const LIVENESS_RECHECK: Duration = Duration::from_millis(250);

/// Default spin before sleeping.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(5);

/// Longest spin a segment's header may ask its readers for.
pub const MAX_SPIN: Duration = Duration::from_secs(1);

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

    /// How long the writer, and by default each reader, spins before
    /// sleeping on the futex (default 5 µs, at most 1 s; zero: sleep at
    /// once).
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

/// What a reader needs to attach to a channel: serde, `Clone + Send`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BroadcastHandle {
    /// Segment name.
    pub name: String,
    /// The channel's nonce (a recreated channel of the same name differs).
    pub nonce: u64,
    /// Layout version of the writer.
    pub version: u32,
    /// Reader entries.
    pub n_readers: u32,
    /// Slots.
    pub slots: u32,
    /// Largest message.
    pub slot_size: u32,
}

/// The protocol cores over a heap table of loom atomics, for
/// `tests/loom_channel.rs` (only in `cfg(loom)` builds).
#[cfg(loom)]
pub mod loom_api {
    pub use super::layout::reader_state;
    pub use super::reader::{ReaderCore, Received, Recv};
    pub use super::shm::{Geometry, Shm};
    pub use super::writer::WriterCore;
}
