//! Reclamation: which objects may go (the read accounting, the hazard and
//! hold checks, dead and stuck readers), the allocation that reclaims
//! around objects still in use, and what blocks when nothing fits.

use super::config::Eviction;
use super::writer::{Entry, ObjectStore};
use crate::error::{Blocker, Error, Result};
use crate::geometry::Geometry;
use crate::layout::reader_state;
use crate::ring::Span;
use crate::shm::SlotPtr;
use crate::sys::clock;
use crate::sys::liveness;

/// How many times a put plans again after a reader took a hold on an
/// object between the plan and its reclaim (a race, not a loop).
const REPLANS: usize = 8;

/// The read-only half of reclamation: whether an object may go. Borrows
/// only the geometry, so the allocator can be walked mutably beside it.
pub(super) struct Judge<'a> {
    pub(super) geo: &'a Geometry,
    pub(super) reader_timeout_ns: Option<u64>,
}

impl Judge<'_> {
    /// The readers that still owe a read of `e`. In aggregate mode they owe
    /// together: each counted one owes while the slot's one counter is short
    /// of `refs` × the readers counted (worked out once, not per reader).
    fn owing<'s>(&'s self, e: &'s Entry, slot: SlotPtr) -> impl Iterator<Item = u32> + 's {
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

    /// Readers (not left) with a hazard or a hold on object `id` in `slot`.
    /// After `invalidate`, the writer's half of the hold protocol (see
    /// crate::shm); before it, a hint that may miss a hold being taken.
    fn holders(&self, slot: SlotPtr, id: u64) -> impl Iterator<Item = u32> + '_ {
        (0..self.geo.n_readers).filter(move |&i| {
            let r = self.geo.reader(i);
            let word = r.word();
            reader_state::state(word) != reader_state::LEFT
                && (r.holds(id) || slot.held_by(i, reader_state::generation(word)))
        })
    }

    /// Whether a reader keeps `e` (in `slot`): owes it a read (when
    /// `owed` is asked and it has a key), or holds it. One pass over the
    /// reader table, each entry's state word read once; the same answers
    /// as [`Judge::owing`] and [`Judge::holders`].
    fn in_use(&self, e: &Entry, slot: SlotPtr, owed: bool) -> bool {
        let owed = owed && e.key.is_some();
        let short = (owed && self.geo.aggregate).then(|| {
            let readers = (0..self.geo.n_readers)
                .filter(|&j| {
                    matches!(
                        self.geo.reader(j).state(),
                        reader_state::VACANT | reader_state::ATTACHING | reader_state::ATTACHED
                    )
                })
                .count() as u64;
            (slot.reads_acquire(0) as u64) < e.refs as u64 * readers
        });
        (0..self.geo.n_readers).any(|i| {
            let r = self.geo.reader(i);
            let word = r.word();
            let state = reader_state::state(word);
            if state == reader_state::LEFT {
                return false;
            }
            if owed {
                let counted = match state {
                    reader_state::VACANT | reader_state::ATTACHING => true,
                    reader_state::ATTACHED => short.is_some() || e.id >= r.counted_from(),
                    _ => false,
                };
                if counted
                    && short.unwrap_or_else(|| slot.reads_acquire(i) < e.refs)
                    && !self.stuck(i)
                {
                    return true;
                }
            }
            r.holds(e.id) || slot.held_by(i, reader_state::generation(word))
        })
    }

    fn slot(&self, pos: u64) -> SlotPtr {
        self.geo.slot(pos).expect("ring addresses are in bounds")
    }

    /// Whether `e` may go as far as the writer can tell without touching
    /// the slot: nothing pending, protected, owed or held.
    fn may_go(&self, pos: u64, e: &Entry) -> bool {
        if let Some(p) = &e.pending {
            // Never published, so no reader is in it; free it only once the
            // copy into it has stopped and nobody will finish the put.
            return p.is_done() && p.abandoned();
        }
        if e.protected {
            return false;
        }
        // A cleared object (no key) is owed nothing.
        !self.in_use(e, self.slot(pos), true)
    }

    /// As `may_go`, for a span the allocator's walk meets: under
    /// [`Eviction::SecondChance`] an object hit since the walk last passed
    /// it stays once more (its bit is cleared).
    pub(super) fn may_go_in_walk(&self, span: &mut Span<Entry>, policy: Eviction) -> bool {
        let e = &mut span.value;
        if policy == Eviction::SecondChance && e.hit && e.pending.is_none() {
            e.hit = false;
            return false;
        }
        self.may_go(span.pos, e)
    }

    /// The reclaim protocol of crate::shm: on success the slot is invalid
    /// and no reader can be inside it. `owed_checked`: [`Judge::may_go`]
    /// just found no read owed, and reads owed only decrease while the
    /// writer does not add references (it does not, inside one call).
    fn try_free(&self, pos: u64, e: &Entry, owed_checked: bool) -> bool {
        if e.pending.is_some() || e.protected {
            return self.may_go(pos, e);
        }
        let slot = self.slot(pos);
        if !owed_checked && e.key.is_some() && self.owing(e, slot).next().is_some() {
            return false;
        }
        if !e.invalid {
            slot.invalidate();
        }
        if self.in_use(e, slot, false) {
            if !e.invalid {
                slot.restore(e.id);
            }
            return false;
        }
        true
    }

    pub(super) fn blocker(&self, pos: u64, e: &Entry) -> Blocker {
        let slot = self.slot(pos);
        Blocker {
            address: pos,
            monotonic_id: e.id,
            key: e.key.as_deref().map(str::to_owned),
            protected: e.protected,
            // A cleared object (no key) is owed nothing.
            unread_by: match e.key {
                Some(_) => self.owing(e, slot).collect(),
                None => Vec::new(),
            },
            held_by: self.holders(slot, e.id).collect(),
        }
    }
}

impl ObjectStore {
    pub(super) fn judge(&self) -> Judge<'_> {
        Judge {
            geo: &self.geo,
            reader_timeout_ns: self.reader_timeout_ns,
        }
    }

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

    /// Finds room for `slot_len` bytes, reclaiming the objects in the way
    /// that may go and allocating around those that must stay. Returns the
    /// position, free (not yet committed).
    pub(super) fn allocate(&mut self, slot_len: u64, limit: u64) -> Result<u64> {
        let mut reaped = false;
        let mut passes = 0;
        let mut replans = 0;
        loop {
            let judge = Judge {
                geo: &self.geo,
                reader_timeout_ns: self.reader_timeout_ns,
            };
            let policy = self.eviction;
            let plan = self
                .ring
                .plan_within(slot_len, limit, |span| judge.may_go_in_walk(span, policy));
            match plan {
                Some(plan) => {
                    if self.free_all(&plan.victims) {
                        return Ok(plan.pos);
                    }
                    // A reader took a hold after the plan: plan again.
                    replans += 1;
                    if replans < REPLANS {
                        continue;
                    }
                }
                // A second walk: the first one used up the second chances.
                None if passes == 0 && self.eviction == Eviction::SecondChance => {
                    passes += 1;
                    continue;
                }
                None if !reaped => {
                    reaped = true;
                    if !self.reap_dead_readers().is_empty() {
                        continue;
                    }
                }
                None => {}
            }
            return Err(self.full(slot_len));
        }
    }

    /// Frees the spans at `victims` (in order), stopping at the first that
    /// may not go after all; whether all went.
    fn free_all(&mut self, victims: &[u64]) -> bool {
        for &pos in victims {
            if !self.free_at(pos, true) {
                return false;
            }
        }
        if !victims.is_empty() {
            self.publish_progress();
        }
        true
    }

    /// Frees the span at `pos` if it may go, and forgets its key.
    fn free_at(&mut self, pos: u64, owed_checked: bool) -> bool {
        let span = self.ring.find_at(pos).expect("victims are live spans");
        if !self.judge().try_free(pos, &span.value, owed_checked) {
            return false;
        }
        let span = self.ring.remove(pos).expect("found above");
        if let Some(key) = span.value.key {
            self.index.remove(&key);
            if !self.pending_keys.is_empty() {
                self.pending_keys.remove(&key);
            }
        }
        // Its header (id 0 now, its length) still spans it for the walk.
        self.stats.evictions += 1;
        true
    }

    /// Frees every object that may go, oldest first, around the ones that
    /// must stay; returns how many went.
    pub(super) fn reclaim_all(&mut self) -> usize {
        let mut freed = 0;
        for pos in self.ring.positions_by_age() {
            if self.free_at(pos, false) {
                freed += 1;
            }
        }
        if freed > 0 {
            tracing::debug!(freed, "reclaimed objects");
            self.publish_progress();
        }
        freed
    }

    /// The `Full` error for `requested` bytes, naming the oldest object
    /// that stays.
    fn full(&mut self, requested: u64) -> Error {
        self.stats.full_errors += 1;
        let blocker = self.oldest_blocker().map(Box::new);
        let err = Error::Full {
            requested,
            free: self.ring.capacity() - self.ring.used(),
            capacity: self.ring.capacity(),
            blocker,
        };
        tracing::debug!(%err, "allocation failed");
        err
    }

    /// The oldest object that may not go, and why.
    pub(super) fn oldest_blocker(&self) -> Option<Blocker> {
        let judge = self.judge();
        self.ring
            .positions_by_age()
            .into_iter()
            .filter_map(|pos| self.ring.find_at(pos))
            .find(|s| !judge.may_go(s.pos, &s.value))
            .map(|s| judge.blocker(s.pos, &s.value))
    }

    /// Marks the free run that starts at `pos` with its length, where one
    /// starts there below the high-water mark (for the inspector's walk).
    pub(super) fn mark_free_run(&self, pos: u64) {
        let end = self.ring.free_run_end(pos);
        if end > pos {
            if let Some(s) = self.geo.slot(pos) {
                s.mark_skip(end - pos);
            }
        }
    }
}
