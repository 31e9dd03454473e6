//! The writer's allocator of the data region: next-fit from the oldest
//! object, around objects still in use.
//!
//! [`Ring`] is arithmetic over byte positions of the data region, kept in
//! the writer's own memory (never read back from shared memory). Objects
//! are laid down one after another from a cursor that sweeps the region and
//! wraps at its end, so the objects just ahead of the cursor are the oldest.
//! To place `len` bytes, [`Ring::plan`] walks forward from the cursor and
//! asks, for each object in the way, whether it may go: the run is built
//! from free space and objects that may go; an object that must stay (held,
//! unread, protected, or given a second chance) ends the run, and the walk
//! starts again just past it. So one object in use costs only the bytes it
//! covers, never the ring behind it (a FIFO stops at the first object in
//! use). A slot never straddles the end of the region. Tested under Miri.
//!
//! Positions below [`Ring::high_water`] are all either an object or free,
//! and every free run is a chain of headers whose lengths cover it: a freed
//! slot keeps its header (id 0, its length), and where a new slot takes
//! only the start of a free run the writer marks the rest
//! ([`Ring::free_run_end`]), so an inspector can walk the region.

use std::collections::{BTreeMap, HashMap};

/// Ids are the writer's own counter: a fast non-cryptographic hash is enough.
type IdHasher = foldhash::fast::RandomState;

/// One allocation.
#[derive(Debug, Clone)]
pub struct Span<T> {
    /// Start position in the data region.
    pub pos: u64,
    /// Bytes it spans.
    pub len: u64,
    /// The object's id: spans are also found by id, and ids give the age.
    pub id: u64,
    /// The caller's bookkeeping.
    pub value: T,
}

impl<T> Span<T> {
    /// One past its last byte.
    pub fn end(&self) -> u64 {
        self.pos + self.len
    }
}

/// Where [`Ring::plan`] would put an allocation, and what must go first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Start position of the allocation.
    pub pos: u64,
    /// Positions of the spans inside it that must be freed first, in order.
    pub victims: Vec<u64>,
}

/// Next-fit allocator over `capacity` bytes (writer memory only).
#[derive(Debug)]
pub struct Ring<T> {
    capacity: u64,
    /// Where the next walk starts: the end of the last allocation.
    cursor: u64,
    /// One past the furthest byte ever allocated.
    high: u64,
    used: u64,
    spans: BTreeMap<u64, Span<T>>,
    /// id → position.
    ids: HashMap<u64, u64, IdHasher>,
}

impl<T> Ring<T> {
    /// An empty ring of `capacity` bytes (> 0).
    pub fn new(capacity: u64) -> Self {
        assert!(capacity > 0, "ring capacity must be positive");
        Ring {
            capacity,
            cursor: 0,
            high: 0,
            used: 0,
            spans: BTreeMap::new(),
            ids: HashMap::default(),
        }
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Where the next walk starts.
    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    /// One past the furthest byte ever allocated: below it, every position
    /// is an object or a gap (with a marker).
    pub fn high_water(&self) -> u64 {
        self.high
    }

    /// Bytes allocated.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Number of live spans.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// The span that covers `pos`, if any.
    fn covering(&self, pos: u64) -> Option<&Span<T>> {
        self.spans
            .range(..=pos)
            .next_back()
            .map(|(_, s)| s)
            .filter(|s| s.end() > pos)
    }

    /// The first span that ends after `pos` (covering it, or after it).
    fn first_after(&self, pos: u64) -> Option<&Span<T>> {
        self.covering(pos)
            .or_else(|| self.spans.range(pos..).next().map(|(_, s)| s))
    }

    /// Where `len` bytes would go: a run from the cursor onwards (wrapping
    /// once) of free space and of spans `may_go` accepts. `may_go` is asked
    /// about each span the walk meets, in order, and may update it (clear a
    /// second-chance bit, say); a span it refuses ends the run. `None` when
    /// no such run exists (or `len` is 0 or larger than the ring).
    #[cfg(test)]
    pub fn plan(&mut self, len: u64, may_go: impl FnMut(&mut Span<T>) -> bool) -> Option<Plan> {
        self.plan_within(len, self.capacity, may_go)
    }

    /// As [`Ring::plan`], for a run that ends at or below `limit` (the
    /// part of a sparse region already backed, say).
    pub fn plan_within(
        &mut self,
        len: u64,
        limit: u64,
        mut may_go: impl FnMut(&mut Span<T>) -> bool,
    ) -> Option<Plan> {
        let limit = limit.min(self.capacity);
        if len == 0 || len > limit {
            return None;
        }
        // Runs starting at or after the cursor first, then (one wrap) those
        // starting before it. The walk is greedy and complete: a run that
        // would start before a refused span would cover its start, so the
        // next candidate is just past it.
        let origin = self.cursor.min(limit);
        let mut start = origin;
        let mut wrapped = false;
        let mut victims = Vec::new();
        // The walk point inside the run being built.
        let mut at = start;
        loop {
            if start + len > limit {
                if wrapped || origin == 0 {
                    return None;
                }
                wrapped = true;
                start = 0;
                at = 0;
                victims.clear();
            }
            let end = start + len;
            let next = self.first_after(at).map(|s| (s.pos, s.end()));
            match next {
                Some((pos, span_end)) if pos < end => {
                    let span = self.spans.get_mut(&pos).expect("found above");
                    if may_go(span) {
                        victims.push(pos);
                        at = span_end;
                    } else {
                        start = span_end;
                        at = start;
                        victims.clear();
                        if wrapped && start >= origin {
                            // Every start from here on was tried before the wrap.
                            return None;
                        }
                    }
                }
                _ => {
                    return Some(Plan {
                        pos: start,
                        victims,
                    })
                }
            }
        }
    }

    /// Takes `len` bytes at `pos` for object `id`. The range must be free
    /// (its victims removed).
    pub fn commit(&mut self, pos: u64, len: u64, id: u64, value: T) {
        debug_assert!(pos + len <= self.capacity);
        debug_assert!(
            self.first_after(pos).is_none_or(|s| s.pos >= pos + len),
            "committing over a live span"
        );
        self.used += len;
        self.high = self.high.max(pos + len);
        self.cursor = pos + len;
        self.ids.insert(id, pos);
        self.spans.insert(
            pos,
            Span {
                pos,
                len,
                id,
                value,
            },
        );
    }

    /// Frees the span at `pos`.
    pub fn remove(&mut self, pos: u64) -> Option<Span<T>> {
        let span = self.spans.remove(&pos)?;
        self.ids.remove(&span.id);
        self.used -= span.len;
        Some(span)
    }

    /// Largest run of free bytes.
    pub fn largest_free(&self) -> u64 {
        let mut best = 0;
        let mut prev = 0;
        for s in self.spans.values() {
            best = best.max(s.pos - prev);
            prev = s.end();
        }
        best.max(self.capacity - prev)
    }

    /// The span that starts at `pos`.
    pub fn find_at(&self, pos: u64) -> Option<&Span<T>> {
        self.spans.get(&pos)
    }

    /// The span of object `id`.
    pub fn find(&self, id: u64) -> Option<&Span<T>> {
        self.spans.get(self.ids.get(&id)?)
    }

    /// As [`Ring::find`], mutable.
    pub fn find_mut(&mut self, id: u64) -> Option<&mut Span<T>> {
        let pos = *self.ids.get(&id)?;
        self.spans.get_mut(&pos)
    }

    /// Positions of the live spans, oldest first.
    pub fn positions_by_age(&self) -> Vec<u64> {
        let mut by_id: Vec<(u64, u64)> = self.ids.iter().map(|(&id, &pos)| (id, pos)).collect();
        by_id.sort_unstable();
        by_id.into_iter().map(|(_, pos)| pos).collect()
    }

    /// Where the free run that starts at `pos` ends: the next span's start,
    /// bounded by the high-water mark (`pos` itself if a span starts there).
    pub fn free_run_end(&self, pos: u64) -> u64 {
        self.spans
            .range(pos..)
            .next()
            .map_or(self.high, |(_, s)| s.pos)
            .min(self.high)
            .max(pos)
    }

    /// Live spans in position order.
    #[cfg(test)]
    pub fn iter(&self) -> impl Iterator<Item = &Span<T>> {
        self.spans.values()
    }

    /// Live spans in position order, mutable bookkeeping.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Span<T>> {
        self.spans.values_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Allocates with every span in the way allowed to go (FIFO-like).
    fn put(r: &mut Ring<bool>, id: u64, len: u64, keep: bool) -> Option<u64> {
        let plan = r.plan(len, |s| !s.value)?;
        for v in plan.victims {
            r.remove(v).expect("victim is live");
        }
        r.commit(plan.pos, len, id, keep);
        Some(plan.pos)
    }

    #[test]
    fn allocates_in_order_and_wraps_without_straddling() {
        let mut r: Ring<bool> = Ring::new(1000);
        assert_eq!(put(&mut r, 1, 400, false), Some(0));
        assert_eq!(put(&mut r, 2, 400, false), Some(400));
        // 200 left at the end, 300 does not fit there: the oldest goes.
        assert_eq!(put(&mut r, 3, 300, false), Some(0));
        assert!(r.find(1).is_none(), "the oldest was reclaimed");
        assert_eq!(r.used(), 700);
        assert_eq!(r.cursor(), 300);
        // Next: from the cursor, 100 free then object 2 goes.
        assert_eq!(put(&mut r, 4, 150, false), Some(300));
        assert!(r.find(2).is_none());
        assert_eq!(r.high_water(), 800);
    }

    #[test]
    fn an_object_in_use_is_allocated_around() {
        let mut r: Ring<bool> = Ring::new(1000);
        for id in 0..10 {
            put(&mut r, id, 100, id == 3).unwrap();
        }
        // Ten laps of 100-byte objects: every one fits, none at 300.
        for id in 10..110 {
            let p = put(&mut r, id, 100, false).expect("room around the kept one");
            assert_ne!(p, 300);
        }
        assert_eq!(r.find(3).map(|s| s.pos), Some(300), "kept where it was");
        // A 400-byte object fits only on either side of it.
        let p = put(&mut r, 200, 400, false).unwrap();
        assert!(p + 400 <= 300 || p >= 400, "{p}");
        // 701 bytes cannot fit anywhere while it stays.
        assert_eq!(r.plan(701, |s| !s.value), None);
        assert!(r.plan(600, |s| !s.value).is_some());
        // Within the first 300 bytes only: at most what lies below it.
        let p = r.plan_within(200, 300, |s| !s.value).unwrap();
        assert!(p.pos + 200 <= 300);
        assert_eq!(r.plan_within(301, 300, |_| true), None);
    }

    #[test]
    fn a_refused_run_frees_nothing() {
        let mut r: Ring<bool> = Ring::new(1000);
        for id in 0..10 {
            put(&mut r, id, 100, id % 2 == 1).unwrap();
        }
        // Every other object stays: no run of 200 exists.
        assert_eq!(r.plan(200, |s| !s.value), None);
        assert_eq!(r.len(), 10, "planning frees nothing");
        assert!(r.plan(100, |s| !s.value).is_some());
    }

    #[test]
    fn may_go_sees_each_span_in_the_way_once_per_walk() {
        let mut r: Ring<u32> = Ring::new(1000);
        for id in 0..10 {
            let p = r.plan(100, |_| true).unwrap();
            assert!(p.victims.is_empty());
            r.commit(p.pos, 100, id, 0);
        }
        // A second chance: refuse a span once, then let it go.
        let p = r
            .plan(250, |s| {
                s.value += 1;
                s.value > 1 || s.id != 0
            })
            .unwrap();
        assert_eq!(p.pos, 100, "the run restarts after the refused span");
        assert_eq!(p.victims, vec![100, 200, 300]);
        assert_eq!(r.find(0).unwrap().value, 1);
    }

    #[test]
    fn free_runs_end_at_the_next_span_or_the_high_water_mark() {
        let mut r: Ring<bool> = Ring::new(1024);
        for id in 0..4 {
            put(&mut r, id, 128, false).unwrap();
        }
        assert_eq!(r.high_water(), 512);
        assert_eq!(r.free_run_end(0), 0, "a span starts there");
        r.remove(128);
        r.remove(256);
        assert_eq!(r.free_run_end(128), 384);
        r.remove(384);
        assert_eq!(r.free_run_end(128), 512, "bounded by the high-water mark");
        assert_eq!(
            r.free_run_end(600),
            600,
            "past the high-water mark: nothing"
        );
        assert_eq!(r.largest_free(), 1024 - 128);
        assert_eq!(r.positions_by_age().first(), Some(&0));
    }

    #[test]
    fn random_traffic_keeps_spans_disjoint_and_accounting_exact() {
        let mut r: Ring<bool> = Ring::new(4096);
        let mut rng = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let iters = if cfg!(miri) { 300 } else { 5000 };
        for id in 0..iters {
            let len = (next() % 16 + 1) * 64;
            let keep = next() % 5 == 0;
            if next() % 7 == 0 {
                // A kept object is let go.
                let kept: Vec<u64> = r.iter().filter(|s| s.value).map(|s| s.pos).collect();
                if let Some(&p) = kept.first() {
                    r.spans.get_mut(&p).unwrap().value = false;
                }
            }
            let got = put(&mut r, id, len, keep);
            if got.is_none() {
                // Only when no run exists: check by brute force.
                let mut ok = false;
                for start in (0..=4096 - len).step_by(64) {
                    if r.iter()
                        .all(|s| !s.value || s.end() <= start || s.pos >= start + len)
                    {
                        ok = true;
                    }
                }
                assert!(!ok, "a run of {len} existed but plan found none");
            }
            let mut prev = 0;
            let mut sum = 0;
            for s in r.iter() {
                assert!(s.pos >= prev, "spans overlap");
                assert!(s.end() <= 4096, "a span straddles the end");
                prev = s.end();
                sum += s.len;
            }
            assert_eq!(sum, r.used());
            assert_eq!(r.ids.len(), r.spans.len());
            let lf = r.largest_free();
            assert!(r.plan(lf, |_| false).is_some() || lf == 0);
            assert!(r.plan(lf + 64, |_| false).is_none());
        }
    }
}
