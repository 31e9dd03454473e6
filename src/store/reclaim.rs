//! Reclamation: FIFO freeing from the oldest end, the read accounting that
//! decides what may go, the hazard scan, dead readers, and what blocks.

use super::writer::{Entry, ObjectStore};
use crate::error::{Blocker, Error, Result};
use crate::layout::reader_state;
use crate::shm::SlotPtr;
use crate::sys::clock;
use crate::sys::liveness;

impl ObjectStore {
    /// Marks readers whose process is gone as left, so reclamation stops
    /// waiting for them; returns their indices.
    pub fn reap_dead_readers(&mut self) -> Vec<u32> {
        let mut reaped = Vec::new();
        if !self.is_owner() {
            return reaped;
        }
        for i in 0..self.geo.n_readers {
            let r = self.geo.reader(i);
            let word = r.word();
            if !matches!(
                reader_state::state(word),
                reader_state::ATTACHED | reader_state::ATTACHING
            ) {
                continue;
            }
            // Dead only on the kernel's word that nobody holds the entry's
            // lock (an error counts as alive). The CAS of the whole word
            // fails if a new reader took the entry since `word` was read.
            if !self.map.seg().held_by_other(liveness::reader_slot(i))
                && r.transition(
                    word,
                    reader_state::word(reader_state::generation(word), reader_state::LEFT),
                )
            {
                tracing::warn!(
                    reader = i,
                    pid = r.pid(),
                    "reader is gone (its lock was released); no longer waiting for its reads"
                );
                reaped.push(i);
            }
        }
        self.stats.dead_readers_reaped += reaped.len() as u64;
        reaped
    }

    pub(super) fn allocate(&mut self, slot_len: u64) -> Result<u64> {
        if let Some(pos) = self.ring.reserve(slot_len) {
            return Ok(pos);
        }
        self.reclaim(Some(slot_len));
        if let Some(pos) = self.ring.reserve(slot_len) {
            return Ok(pos);
        }
        if !self.reap_dead_readers().is_empty() {
            self.reclaim(Some(slot_len));
            if let Some(pos) = self.ring.reserve(slot_len) {
                return Ok(pos);
            }
        }
        self.stats.full_errors += 1;
        let blocker = self
            .ring
            .front()
            .map(|s| Box::new(self.blocker(s.pos, &s.value)));
        let err = Error::Full {
            requested: slot_len,
            free: self.ring.capacity() - self.ring.used(),
            capacity: self.ring.capacity(),
            blocker,
        };
        tracing::debug!(%err, "allocation failed");
        Err(err)
    }

    /// Frees from the oldest end until `need` bytes fit (or, with `None`,
    /// as far as possible); stops at the first object still in use.
    pub(super) fn reclaim(&mut self, need: Option<u64>) -> usize {
        let mut freed = 0;
        while let Some(front) = self.ring.front() {
            if need.is_some_and(|n| self.ring.reserve(n).is_some()) {
                break;
            }
            let address = self.ring.address(front.pos);
            if !self.try_free(address, &front.value) {
                break;
            }
            let span = self.ring.pop_front().expect("front exists");
            if let Some(key) = span.value.key {
                self.index.remove(&key);
                if !self.pending_keys.is_empty() {
                    self.pending_keys.remove(&key);
                }
            }
            self.stats.evictions += 1;
            freed += 1;
        }
        if freed > 0 {
            tracing::debug!(freed, "reclaimed objects");
            self.publish_progress();
        }
        freed
    }

    /// The readers that still owe a read of `e`. In aggregate mode they owe
    /// together: each counted one owes while the slot's one counter is short
    /// of `refs` × the readers counted (worked out once, not per reader).
    fn owing<'a>(&'a self, e: &'a Entry, slot: SlotPtr) -> impl Iterator<Item = u32> + 'a {
        let n = self.geo.n_readers;
        let short = self.geo.aggregate.then(|| {
            let readers = (0..n)
                .filter(|&j| {
                    matches!(
                        self.geo.reader(j).state(),
                        reader_state::VACANT | reader_state::ATTACHING | reader_state::ATTACHED
                    )
                })
                .count() as u64;
            (slot.reads_acquire(0) as u64) < e.refs as u64 * readers
        });
        (0..n).filter(move |&i| {
            let r = self.geo.reader(i);
            let counted = match r.state() {
                // Attaching: its first counted id is being chosen; wait for
                // it (microseconds; an attacher that dies is reaped).
                reader_state::VACANT | reader_state::ATTACHING => true,
                reader_state::ATTACHED => short.is_some() || e.id >= r.counted_from(),
                _ => false,
            };
            counted && !self.stuck(i) && short.unwrap_or_else(|| slot.reads_acquire(i) < e.refs)
        })
    }

    /// Whether reader `i` is past the stuck-reader timeout.
    fn stuck(&self, i: u32) -> bool {
        let Some(limit) = self.reader_timeout_ns else {
            return false;
        };
        let r = self.geo.reader(i);
        let last = r.last_ack_ns().max(r.attached_ns());
        let idle = clock::monotonic_ns().saturating_sub(last);
        if idle > limit {
            tracing::warn!(
                reader = i,
                idle_ms = idle / 1_000_000,
                "reader is stuck; no longer waiting for its reads"
            );
            true
        } else {
            false
        }
    }

    /// The reclaim protocol of crate::ring: on success the slot is invalid
    /// and no reader can be inside it.
    fn try_free(&self, address: u64, e: &Entry) -> bool {
        let slot = self.slot_at(address);
        if let Some(p) = &e.pending {
            // Never published, so no reader is in it; free it only once the
            // copy into it has stopped and nobody will finish the put.
            return p.is_done() && p.abandoned();
        }
        if e.protected {
            return false;
        }
        // A cleared object (no key) is owed nothing.
        if e.key.is_some() && self.owing(e, slot).next().is_some() {
            return false;
        }
        if !e.invalid {
            slot.invalidate();
        }
        if self.holders(e.id).next().is_some() {
            if !e.invalid {
                slot.restore(e.id);
            }
            return false;
        }
        true
    }

    /// Readers (not left) with a guard on object `id`: after `invalidate`,
    /// the writer's half of the hazard protocol.
    fn holders(&self, id: u64) -> impl Iterator<Item = u32> + '_ {
        (0..self.geo.n_readers).filter(move |&i| {
            let r = self.geo.reader(i);
            r.state() != reader_state::LEFT && r.holds(id)
        })
    }

    pub(super) fn blocker(&self, pos: u64, e: &Entry) -> Blocker {
        let address = self.ring.address(pos);
        let slot = self.slot_at(address);
        Blocker {
            address,
            monotonic_id: e.id,
            key: e.key.as_deref().map(str::to_owned),
            protected: e.protected,
            // A cleared object (no key) is owed nothing.
            unread_by: match e.key {
                Some(_) => self.owing(e, slot).collect(),
                None => Vec::new(),
            },
            held_by: self.holders(e.id).collect(),
        }
    }
}
