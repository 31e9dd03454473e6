//! Reclamation: which objects may go (the read accounting, the hazard and
//! hold checks, dead and stuck readers), the allocation that reclaims
//! around objects still in use, and what blocks when nothing fits.

use super::config::Eviction;
use super::keys::{Entry, Keys};
use super::stats::StoreStats;
use crate::atomics::SlotPtr;
use crate::error::{Blocker, Error, Result};
use crate::geometry::StoreGeometry;
use crate::layout::reader_state;
use crate::ring::{Plan, Ring, Span, SpanId};
use crate::sys::clock;
use crate::sys::liveness;
use crate::sys::segment::{Backing, Segment};

use super::ahead::Ahead;

/// How many times a put plans again after a reader took a hold on an
/// object between the plan and its reclaim (a race, not a loop).
const REPLANS: usize = 8;

/// The read-only half of reclamation: whether an object may go. Borrows
/// only the geometry, so the allocator can be walked mutably beside it.
pub(super) struct Judge<'a> {
    pub(super) geo: &'a StoreGeometry,
    pub(super) reader_timeout_ns: Option<u64>,
}

impl Judge<'_> {
    /// The readers that still owe a read of `e`.
    fn owing<'s>(&'s self, e: &'s Entry, slot: SlotPtr) -> impl Iterator<Item = u32> + 's {
        let short = self.aggregate_short(e, slot);
        (0..self.geo.n_readers)
            .filter(move |&i| self.owes(i, self.geo.reader(i).word(), e, slot, short))
    }

    /// In aggregate mode readers owe together: whether the slot's one
    /// counter is short of `refs` × the readers counted (worked out once
    /// per object, not per reader). `None` in per-reader mode.
    fn aggregate_short(&self, e: &Entry, slot: SlotPtr) -> Option<bool> {
        self.geo.aggregate.then(|| {
            let readers = (0..self.geo.n_readers)
                .filter(|&j| {
                    matches!(
                        self.geo.reader(j).state(),
                        reader_state::VACANT | reader_state::ATTACHING | reader_state::ATTACHED
                    )
                })
                .count() as u64;
            (slot.reads_acquire(0) as u64) < e.refs as u64 * readers
        })
    }

    /// Whether reader `i`, whose state word is `word`, owes a read of `e`
    /// (`short`: [`Judge::aggregate_short`]).
    #[inline]
    fn owes(&self, i: u32, word: u64, e: &Entry, slot: SlotPtr, short: Option<bool>) -> bool {
        let counted = match reader_state::state(word) {
            // Attaching: its first counted id is being chosen; wait for it
            // (microseconds; an attacher that dies is reaped).
            reader_state::VACANT | reader_state::ATTACHING => true,
            reader_state::ATTACHED => short.is_some() || e.id >= self.geo.reader(i).counted_from(),
            _ => false,
        };
        counted && short.unwrap_or_else(|| slot.reads_acquire(i) < e.refs) && !self.stuck(i)
    }

    /// Whether reader `i`, whose state word is `word`, has a hazard or a
    /// hold on object `id` in `slot`. After `invalidate`, the writer's half
    /// of the hold protocol (see crate::atomics); before it, a hint that may
    /// miss a hold being taken.
    #[inline]
    fn holds(&self, i: u32, word: u64, id: u64, slot: SlotPtr) -> bool {
        reader_state::state(word) != reader_state::LEFT
            && (self.geo.reader(i).has_hazard_on(id)
                || slot.held_by(i, reader_state::generation(word)))
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

    /// Readers with a hazard or a hold on object `id` in `slot`.
    fn holders(&self, slot: SlotPtr, id: u64) -> impl Iterator<Item = u32> + '_ {
        (0..self.geo.n_readers).filter(move |&i| self.holds(i, self.geo.reader(i).word(), id, slot))
    }

    /// Whether a reader keeps `e` (in `slot`): owes it a read (when
    /// `owed` is asked and it has a key), or (with `holds`) holds it. One
    /// pass over the reader table, each entry's state word read once.
    fn in_use(&self, e: &Entry, slot: SlotPtr, owed: bool, holds: bool) -> bool {
        // A cache's objects, and a cleared object (no key), are owed nothing.
        let owed = owed && e.key.is_some() && !self.geo.cache;
        let short = if owed {
            self.aggregate_short(e, slot)
        } else {
            None
        };
        // The two passes a reclaim makes, each its own loop with nothing
        // decided per reader that is the same for all: the read check
        // (per-reader accounting, no stuck-reader timeout) and the hold
        // check after `invalidate`. The same loads, in the same order, as
        // the general loop below.
        match (owed, holds) {
            (false, false) => return false,
            (true, false) if short.is_none() && self.reader_timeout_ns.is_none() => {
                return self.owed_by_any(e, slot)
            }
            (false, true) => return self.held_by_any(e.id, slot),
            _ => {}
        }
        (0..self.geo.n_readers).any(|i| {
            let word = self.geo.reader(i).word();
            (owed && self.owes(i, word, e, slot, short))
                || (holds && self.holds(i, word, e.id, slot))
        })
    }

    /// [`Judge::owes`] for any reader, per-reader accounting and no
    /// timeout: a reader attaching, or attached and counted for `e`, that
    /// has read it fewer times than it is referenced.
    ///
    /// The slot's read counters first, the reader table only for a reader
    /// short of `refs`: the counters lie side by side in the slot (a line
    /// for 16 readers), each entry's state in a line of its own that its
    /// reader dirties at every get (the hazard beside it), and a reader
    /// that has read the object owes nothing whatever its state. The
    /// answer is the conjunction `owes` computes, of the same words with
    /// the same orderings; only the loads it cannot change are skipped. A
    /// count at or above `refs` is never a previous holder's for an object
    /// the entry's holder is counted for: those were published, and their
    /// counters zeroed, after the holder took its first counted id.
    #[inline]
    fn owed_by_any(&self, e: &Entry, slot: SlotPtr) -> bool {
        (0..self.geo.n_readers).any(|i| {
            slot.reads_acquire(i) < e.refs && {
                let r = self.geo.reader(i);
                match reader_state::state(r.word()) {
                    reader_state::VACANT | reader_state::ATTACHING => true,
                    reader_state::ATTACHED => e.id >= r.counted_from(),
                    _ => false,
                }
            }
        })
    }

    /// [`Judge::holds`] for any reader: the writer's half of the hold
    /// protocol, after `invalidate`.
    ///
    /// The hazard and the hold word first (in that order, both Acquire
    /// after the SeqCst fence, as the protocol of crate::atomics has
    /// them), the state word only for a reader whose hazard names `id` or
    /// whose hold word counts anything: a reader with neither holds
    /// nothing, whatever its state, which only tells a live holder from a
    /// leftover. So an idle reader costs two loads, one of them in the
    /// slot, beside the other readers' words.
    ///
    /// Why the state may be loaded last: the Dekker pair rests on the
    /// hazard load and the hold load alone (a get whose fence came first
    /// is seen there; one whose fence came later sees id 0 and takes no
    /// hold). The state then only discards what an ended attachment left:
    /// an entry becomes `LEFT`, or of a newer generation, only after its
    /// holder has given back every hold and cleared its hazard, or has
    /// died (the kernel released its lock), so a word seen before that
    /// change keeps nothing alive. A hazard on `id` under a newer live
    /// generation still counts, as it does with the state loaded first.
    #[inline]
    fn held_by_any(&self, id: u64, slot: SlotPtr) -> bool {
        (0..self.geo.n_readers).any(|i| {
            let r = self.geo.reader(i);
            let hazard = r.has_hazard_on(id);
            let hold = slot.hold_word_acquire(i);
            (hazard || hold as u32 != 0) && {
                let word = r.word();
                reader_state::state(word) != reader_state::LEFT
                    && (hazard
                        || crate::layout::hold::count_for(hold, reader_state::generation(word))
                            != 0)
            }
        })
    }

    fn slot(&self, pos: u64) -> SlotPtr {
        self.geo.slot(pos).expect("ring addresses are in bounds")
    }

    /// Whether `e` may go as far as the writer can tell without touching
    /// the slot: nothing pending, protected, owed, or (with `holds`) held.
    /// The walk looks at holds only for objects a reclaim found held
    /// before (`Entry::held_seen`): `try_free`'s check after invalidating
    /// is the one that decides, so skipping the hint for the others saves
    /// two loads per reader per object and never frees a held slot.
    fn may_go(&self, pos: u64, e: &Entry, holds: bool) -> bool {
        if let Some(p) = &e.pending {
            // Never published, so no reader is in it; free it only once the
            // copy into it has stopped and nobody will finish the put.
            return p.is_done() && p.abandoned();
        }
        if e.protected {
            return false;
        }
        // A cleared object (no key) is owed nothing.
        let free = !self.in_use(e, self.slot(pos), true, holds);
        if free && holds {
            e.held_seen.set(false);
        }
        free
    }

    /// As `may_go`, for a span the allocator's walk meets: under
    /// [`Eviction::SecondChance`] an object hit since the walk last passed
    /// it stays once more (its bit is cleared).
    pub(super) fn may_go_in_walk(&self, span: &mut Span<Entry>, policy: Eviction) -> bool {
        let e = &mut span.value;
        if policy == Eviction::SecondChance && e.pending.is_none() {
            // A reader's hit by key (shared key index) counts as the
            // writer's own: both are cleared here.
            // A cleared object (no key, or invalidated) gets no extra lap.
            let touched = self.geo.index_entries != 0
                && e.key.is_some()
                && !e.invalid
                && self.slot(span.pos).take_touched();
            if std::mem::take(&mut e.hit) | touched {
                return false;
            }
        }
        self.may_go(span.pos, e, e.held_seen.get())
    }

    /// The reclaim protocol of crate::atomics: on success the slot is invalid
    /// and no reader can be inside it. `owed_checked`: [`Judge::may_go`]
    /// just found no read owed, and reads owed only decrease while the
    /// writer does not add references (it does not, inside one call).
    fn try_free(&self, pos: u64, e: &Entry, owed_checked: bool) -> bool {
        if e.pending.is_some() || e.protected {
            return self.may_go(pos, e, true);
        }
        let slot = self.slot(pos);
        if !owed_checked && e.key.is_some() && self.owing(e, slot).next().is_some() {
            return false;
        }
        // A slot invalidated before (a hard clear) has no tag to put back.
        let tag = (!e.invalid).then(|| slot.invalidate());
        if self.in_use(e, slot, false, true) {
            if let Some(tag) = tag {
                slot.restore(e.id, tag);
            }
            // The walk looks at its holds from now on.
            e.held_seen.set(true);
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

/// Why [`Space::allocate`] found no room.
#[derive(Debug)]
pub(super) enum NoRoom {
    /// Nothing fits below the limit around the objects that must stay
    /// ([`Error::Full`]).
    Full(Error),
    /// A run was found, but its pages could not be backed (the error of
    /// [`Backing::ensure`], `NoSpace` on a full /dev/shm). Nothing was
    /// freed for the plan that could not be backed (an earlier plan that a
    /// racing reader spoiled may have freed some of its victims).
    Unbacked(Error),
}

/// The writer's data region: its validated bounds, the allocator over it,
/// the backing of a sparse segment, and the policies that decide what may
/// be reclaimed. The writer owns one; its keys, ids and segment stay the
/// writer's, and are handed in where reclamation needs them.
#[derive(Debug)]
pub(super) struct Space {
    pub(super) geo: StoreGeometry,
    pub(super) ring: Ring<Entry>,
    /// Which pages of a sparse segment are backed (all, if reserved).
    pub(super) backing: Backing,
    /// A sparse segment's background backer, until its first lap is
    /// backed ([`StoreConfig::back_ahead`](crate::StoreConfig::back_ahead)).
    pub(super) ahead: Option<Ahead>,
    /// What the allocator does with an object hit since it last passed.
    eviction: Eviction,
    reader_timeout_ns: Option<u64>,
}

impl Space {
    pub(super) fn new(
        geo: StoreGeometry,
        ring: Ring<Entry>,
        backing: Backing,
        eviction: Eviction,
        reader_timeout_ns: Option<u64>,
    ) -> Space {
        Space {
            geo,
            ring,
            backing,
            ahead: None,
            eviction,
            reader_timeout_ns,
        }
    }

    fn judge(&self) -> Judge<'_> {
        Judge {
            geo: &self.geo,
            reader_timeout_ns: self.reader_timeout_ns,
        }
    }

    /// Marks readers whose process is gone (the kernel's word on `seg`'s
    /// locks) as left, so reclamation stops waiting for them; returns their
    /// indices.
    pub(super) fn reap_dead_readers(&mut self, seg: &Segment, stats: &mut StoreStats) -> Vec<u32> {
        let mut reaped = Vec::new();
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
            if !seg.held_by_other(liveness::reader_slot(i))
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
        stats.dead_readers_reaped += reaped.len() as u64;
        reaped
    }

    /// Finds room for `slot_len` bytes below `limit`, reclaiming the
    /// objects in the way that may go and allocating around those that must
    /// stay. Returns the plan, its run free (not yet committed) and backed:
    /// the pages of a sparse segment under it (at `data_at +` its position
    /// in the segment) are allocated before any victim goes.
    /// Reclaimed objects' keys are forgotten in `keys`; what happens is
    /// counted in `stats`; dead readers are told by `seg`'s locks.
    pub(super) fn allocate(
        &mut self,
        slot_len: u64,
        limit: u64,
        data_at: u64,
        keys: &mut Keys,
        stats: &mut StoreStats,
        seg: &Segment,
    ) -> Result<Plan, NoRoom> {
        let mut reaped = false;
        let mut passes = 0;
        let mut replans = 0;
        // Each object found held for the first time costs one plan more
        // (the walk then looks at its holds): bounded by the objects there
        // are, whatever readers do.
        let mut newly_held_left = self.ring.len();
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
                    // Pages first, victims after: a span that cannot be
                    // backed (a full /dev/shm) must cost no object. Freed
                    // first, they would be forgotten, and the caller's
                    // fallback into the backed part evict others besides.
                    let before = self.backing.backed();
                    if let Err(e) = self.back(seg, data_at + plan.pos, slot_len, stats) {
                        return Err(NoRoom::Unbacked(e));
                    }
                    if self.backing.backed() != before {
                        // Readers touch nothing past this (a forged or
                        // stale handle allocates no page there).
                        self.geo
                            .header()
                            .set_backed(self.backing.backed().saturating_sub(data_at));
                    }
                    let Err(kept) = self.free_all(&plan.victims, keys, stats) else {
                        return Ok(plan);
                    };
                    // Every victim had `held_seen` clear when planned: if
                    // the one kept has it set, it was found held (the walk
                    // skips it next time); otherwise a reader raced the plan.
                    let newly_held = self.ring.get(kept).value.held_seen.get();
                    if newly_held && newly_held_left > 0 {
                        newly_held_left -= 1;
                        continue;
                    }
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
                    if !self.reap_dead_readers(seg, stats).is_empty() {
                        continue;
                    }
                }
                None => {}
            }
            return Err(NoRoom::Full(self.full(slot_len, stats)));
        }
    }

    /// Backs `offset..offset + len` of the segment before it is written:
    /// through the backer while there is one (what it has backed ahead
    /// costs nothing here), else in this call. Counts the bytes backed
    /// here in `stats.backed_in_put`.
    fn back(&mut self, seg: &Segment, offset: u64, len: u64, stats: &mut StoreStats) -> Result<()> {
        let own = match &mut self.ahead {
            Some(a) => a.ensure(&mut self.backing, seg, offset, len)?,
            None => {
                let before = self.backing.backed();
                self.backing.ensure(seg, offset, len)?;
                self.backing.backed() - before
            }
        };
        stats.backed_in_put += own;
        if self
            .ahead
            .as_ref()
            .is_some_and(|a| a.finished(&self.backing))
        {
            // The first lap is backed: the backer has nothing left to do.
            self.ahead = None;
        }
        Ok(())
    }

    /// An object was published: the backer, if any, may go on ahead.
    pub(super) fn published(&mut self) {
        if let Some(a) = &mut self.ahead {
            a.kick();
        }
    }

    /// Frees `victims` in order; `Err` names the first that had to stay
    /// (those before it are freed, those after it untouched).
    fn free_all(
        &mut self,
        victims: &[SpanId],
        keys: &mut Keys,
        stats: &mut StoreStats,
    ) -> Result<(), SpanId> {
        match victims
            .iter()
            .find(|&&s| !self.free_at(s, true, keys, stats))
        {
            Some(&kept) => Err(kept),
            None => Ok(()),
        }
    }

    /// Frees the span at `pos` if it may go, and forgets its key.
    fn free_at(
        &mut self,
        s: SpanId,
        owed_checked: bool,
        keys: &mut Keys,
        stats: &mut StoreStats,
    ) -> bool {
        let judge = Judge {
            geo: &self.geo,
            reader_timeout_ns: self.reader_timeout_ns,
        };
        let Some(span) = self
            .ring
            .remove_if(s, |s| judge.try_free(s.pos, &s.value, owed_checked))
        else {
            return false;
        };
        if let Some(key) = span.value.key {
            keys.forget(&key, span.value.id, span.value.fp);
        }
        // Its header (id 0 now, its length) still spans it for the walk.
        stats.evictions += 1;
        true
    }

    /// Frees object `id` now if it may go (and forgets its key); whether
    /// it went.
    pub(super) fn free_object(&mut self, id: u64, keys: &mut Keys, stats: &mut StoreStats) -> bool {
        match self.ring.span_of(id) {
            Some(s) => self.free_at(s, false, keys, stats),
            None => false,
        }
    }

    /// Frees every object that may go, oldest first, around the ones that
    /// must stay; returns how many went.
    pub(super) fn reclaim_all(&mut self, keys: &mut Keys, stats: &mut StoreStats) -> usize {
        let mut freed = 0;
        for s in self.ring.by_age() {
            if self.free_at(s, false, keys, stats) {
                freed += 1;
            }
        }
        if freed > 0 {
            tracing::debug!(freed, "reclaimed objects");
        }
        freed
    }

    /// The `Full` error for `requested` bytes, naming the oldest object
    /// that stays.
    fn full(&self, requested: u64, stats: &mut StoreStats) -> Error {
        stats.full_errors += 1;
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
            .by_age()
            .into_iter()
            .map(|s| self.ring.get(s))
            .find(|s| !judge.may_go(s.pos, &s.value, true))
            .map(|s| judge.blocker(s.pos, &s.value))
    }

    /// Marks the free run `pos..end` with its length, if it is not empty
    /// (for the inspector's walk).
    pub(super) fn mark_free_run(&self, pos: u64, end: u64) {
        if end > pos {
            if let Some(s) = self.geo.slot(pos) {
                s.mark_skip(end - pos);
            }
        }
    }
}
