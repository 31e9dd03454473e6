//! What the writer knows of its objects, in its own memory: an [`Entry`]
//! per live slot (the allocator's span value) and the [`Keys`] (stored,
//! pending, and the shared index readers look keys up in). Below both the
//! writer and the reclaimer: reclaiming forgets keys here, and the writer
//! never has to be asked.

use std::collections::HashMap;
use std::sync::Arc;

use super::handle::ObjectHandle;
use super::key_index::SharedIndex;
use crate::error::Result;
use crate::layout::ObjectKind;

/// Keys are the producer's own (content hashes, request ids), hashed only
/// in the writer's memory: a fast non-cryptographic hasher is enough, and
/// SipHash was a third of a small put's instructions.
type KeyHasher = foldhash::fast::RandomState;

/// What the writer remembers about a live slot.
#[derive(Debug)]
pub(super) struct Entry {
    pub(super) id: u64,
    pub(super) refs: u32,
    /// `None` once cleared: the slot waits only for guards to go.
    pub(super) key: Option<Arc<str>>,
    /// A copy into the slot still in flight: not published, not freeable.
    pub(super) pending: Option<Arc<dyn PendingCopy>>,
    pub(super) kind: ObjectKind,
    pub(super) size: u64,
    /// The key's fingerprint in the shared key index (zero without one).
    pub(super) fp: [u64; 2],
    /// Protected by `protect` until the next `get_cached` of its key or
    /// `release_protections`: never reclaimed meanwhile.
    pub(super) protected: bool,
    /// The slot's id was already invalidated (a hard clear).
    pub(super) invalid: bool,
    /// Hit (`get_cached`) since the allocator's walk last passed it: under
    /// [`Eviction::SecondChance`] it stays one more lap.
    pub(super) hit: bool,
    /// A reclaim found it held: the allocator's walk checks its holds
    /// (see `Judge::may_go`) until it finds none.
    pub(super) held_seen: std::cell::Cell<bool>,
}

/// A copy into a reserved slot (a device-to-host DMA, say), seen by the
/// store. Implemented in `store/device.rs` over a copy engine's ticket.
pub(crate) trait PendingCopy: Send + Sync + std::fmt::Debug {
    /// Whether the copy has finished (successfully or not).
    fn is_done(&self) -> bool;
    /// Blocks until the copy has finished; its outcome.
    fn wait(&self) -> Result<()>;
    /// Whether the caller dropped its token without finishing the put.
    fn abandoned(&self) -> bool;
    /// Whether the put will never be published, so that its key may go at
    /// once (its slot still waits for `is_done() && abandoned()`): the
    /// caller gave it up, or its copy failed.
    fn given_up(&self) -> bool {
        self.abandoned()
    }
}

/// The writer's keys: what is stored, and what is being put.
#[derive(Debug, Default)]
pub(super) struct Keys {
    pub(super) index: HashMap<Arc<str>, ObjectHandle, KeyHasher>,
    /// Keys of puts whose copy is still in flight, with their ids.
    pub(super) pending: HashMap<Arc<str>, u64, KeyHasher>,
    /// The shared key index readers look keys up in, if the store has one.
    pub(super) shared: Option<SharedIndex>,
}

impl Keys {
    /// Forgets `key`, the key of object `id` whose fingerprint is `fp`
    /// (its object was reclaimed).
    pub(super) fn forget(&mut self, key: &str, id: u64, fp: [u64; 2]) {
        // Only its own: a put given up leaves its key to the next put of it.
        if self.index.get(key).is_some_and(|h| h.monotonic_id == id) {
            self.index.remove(key);
        }
        if self.pending.get(key) == Some(&id) {
            self.pending.remove(key);
        }
        if let Some(shared) = &mut self.shared {
            shared.remove(fp, id);
        }
    }

    /// Forgets every key.
    pub(super) fn clear(&mut self) {
        self.index.clear();
        self.pending.clear();
        if let Some(shared) = &mut self.shared {
            shared.clear();
        }
    }
}
