//! What stays and what goes, by the writer's word: protecting keys from
//! eviction, and the soft and hard clears.

use super::writer::{next_epoch, ObjectStore};
use crate::error::{Error, Result};

impl ObjectStore {
    /// Keeps `key` from being reclaimed until its next
    /// [`get_cached`](Self::get_cached) or [`release_protections`](Self::release_protections)
    /// (vLLM 0.33's writer `touch`). Adds no expected read.
    pub fn protect(&mut self, key: &str) -> Result<()> {
        self.check_owner()?;
        let id = self
            .keys
            .index
            .get(key)
            .ok_or_else(|| Error::KeyNotFound {
                key: key.to_owned(),
            })?
            .monotonic_id;
        let span = self
            .space
            .ring
            .find_mut(id)
            .expect("every indexed key has a live slot");
        span.value.protected = true;
        Ok(())
    }

    /// Ends every [`protect`](Self::protect) (vLLM 0.33's `release_touches`).
    pub fn release_protections(&mut self) {
        if !self.is_owner() {
            return;
        }
        for span in self.space.ring.iter_mut() {
            span.value.protected = false;
        }
    }

    /// Forgets every key (vLLM 0.33's soft clear): `is_cached` is false for
    /// all, ids keep increasing, and nothing is owed any more. The next puts
    /// go from the ring's first byte, as in vLLM. A handle from before
    /// reads its own bytes until its slot is reused, then it is stale.
    /// Slots under a live guard are reused only once the guard drops (the
    /// puts go around them).
    pub fn clear(&mut self) {
        if !self.is_owner() {
            return;
        }
        for span in self.space.ring.iter_mut() {
            span.value.key = None;
            span.value.protected = false;
            span.value.hit = false;
        }
        self.space.ring.rewind();
        self.keys.clear();
        tracing::debug!(held = self.space.ring.len(), "store cleared (soft)");
    }

    /// Forgets every object and starts a new epoch: every handle from
    /// before is stale at once. Slots under a live guard are freed once the
    /// guard drops.
    pub fn clear_hard(&mut self) {
        if !self.is_owner() {
            return;
        }
        let geo = self.space.geo;
        for span in self.space.ring.iter_mut() {
            let e = &mut span.value;
            e.key = None;
            e.protected = false;
            if e.pending.is_none() && !e.invalid {
                geo.slot(span.pos)
                    .expect("ring slots are in bounds")
                    .invalidate();
                e.invalid = true;
            }
        }
        self.keys.clear();
        self.space.geo.header().set_cleared_below(self.next_id);
        self.epoch = next_epoch(self.epoch);
        self.space.geo.header().set_epoch(self.epoch);
        let freed = self.space.reclaim_all(&mut self.keys, &mut self.stats);
        tracing::debug!(freed, held = self.space.ring.len(), "store cleared (hard)");
        self.publish_progress();
    }
}
