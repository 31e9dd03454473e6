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
//! only the start of a free run the writer marks the rest (the end of that
//! run is what [`Ring::commit`] returns), so an inspector can walk the
//! region.

use std::collections::HashMap;

/// Ids are the writer's own counter: a fast non-cryptographic hash is enough.
type IdHasher = foldhash::fast::RandomState;

/// No node.
const NIL: u32 = u32::MAX;

/// One allocation.
#[derive(Debug, Clone)]
pub(crate) struct Span<T> {
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
    pub(crate) fn end(&self) -> u64 {
        self.pos + self.len
    }
}

/// A live span's place in the ring (valid until that span is removed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SpanId(u32);

/// Where [`Ring::plan`] would put an allocation, and what must go first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Start position of the allocation.
    pub pos: u64,
    /// The spans inside it that must be freed first, in order.
    pub victims: Vec<SpanId>,
    /// The first span after the run (it stays), if any.
    next: Option<SpanId>,
}

#[derive(Debug)]
struct Node<T> {
    span: Span<T>,
    prev: u32,
    next: u32,
}

/// Next-fit allocator over `capacity` bytes (writer memory only): the
/// spans form a list in position order (nodes in a slab, linked by index),
/// so a put walks, unlinks and links in O(1) per span it meets, with no
/// search; ids map to nodes through a hash map.
#[derive(Debug)]
pub(crate) struct Ring<T> {
    capacity: u64,
    /// Where the next walk starts: the end of the last allocation.
    cursor: u64,
    /// The first node at or after the cursor (NIL: none).
    cursor_node: u32,
    /// One past the furthest byte ever allocated.
    high: u64,
    used: u64,
    nodes: Vec<Option<Node<T>>>,
    free_nodes: Vec<u32>,
    /// Lowest and highest node by position.
    head: u32,
    tail: u32,
    /// id → node.
    ids: HashMap<u64, u32, IdHasher>,
}

impl<T> Ring<T> {
    /// An empty ring of `capacity` bytes (> 0).
    pub(crate) fn new(capacity: u64) -> Self {
        assert!(capacity > 0, "ring capacity must be positive");
        Ring {
            capacity,
            cursor: 0,
            cursor_node: NIL,
            high: 0,
            used: 0,
            nodes: Vec::new(),
            free_nodes: Vec::new(),
            head: NIL,
            tail: NIL,
            ids: HashMap::default(),
        }
    }

    /// Capacity in bytes.
    pub(crate) fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Where the next walk starts.
    pub(crate) fn cursor(&self) -> u64 {
        self.cursor
    }

    /// One past the furthest byte ever allocated: below it, every position
    /// is an object or free.
    pub(crate) fn high_water(&self) -> u64 {
        self.high
    }

    /// Bytes allocated.
    pub(crate) fn used(&self) -> u64 {
        self.used
    }

    /// Number of live spans.
    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }

    fn node(&self, n: u32) -> &Node<T> {
        self.nodes[n as usize].as_ref().expect("a live node")
    }

    fn node_mut(&mut self, n: u32) -> &mut Node<T> {
        self.nodes[n as usize].as_mut().expect("a live node")
    }

    /// The first node that ends after `pos` (a linear walk: only for a walk
    /// that does not start at the cursor, the rare case).
    fn first_ending_after(&self, pos: u64) -> u32 {
        let mut n = self.head;
        while n != NIL && self.node(n).span.end() <= pos {
            n = self.node(n).next;
        }
        n
    }

    /// Where `len` bytes would go: a run from the cursor onwards (wrapping
    /// once) of free space and of spans `may_go` accepts. `may_go` is asked
    /// about each span the walk meets, in order, and may update it (clear a
    /// second-chance bit, say); a span it refuses ends the run. `None` when
    /// no such run exists (or `len` is 0 or larger than the ring).
    #[cfg(test)]
    pub(crate) fn plan(
        &mut self,
        len: u64,
        may_go: impl FnMut(&mut Span<T>) -> bool,
    ) -> Option<Plan> {
        self.plan_within(len, self.capacity, may_go)
    }

    /// As [`Ring::plan`], for a run that ends at or below `limit` (the
    /// part of a sparse region already backed, say).
    pub(crate) fn plan_within(
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
        // The first node ending after the walk point.
        let mut node = if origin == self.cursor {
            self.cursor_node
        } else {
            self.first_ending_after(origin)
        };
        loop {
            if start + len > limit {
                if wrapped || origin == 0 {
                    return None;
                }
                wrapped = true;
                start = 0;
                node = self.head;
                victims.clear();
            }
            let end = start + len;
            if node == NIL || self.node(node).span.pos >= end {
                let next = (node != NIL).then_some(SpanId(node));
                return Some(Plan {
                    pos: start,
                    victims,
                    next,
                });
            }
            let n = self.node_mut(node);
            let next = n.next;
            if may_go(&mut n.span) {
                victims.push(SpanId(node));
            } else {
                start = n.span.end();
                victims.clear();
                if wrapped && start >= origin {
                    // Every start from here on was tried before the wrap.
                    return None;
                }
            }
            node = next;
        }
    }

    /// Takes `len` bytes at `plan.pos` for object `id`, once the plan's
    /// victims are removed. Returns where the free run after it ends (the
    /// next span's start, bounded by the high-water mark as it was).
    pub(crate) fn commit(&mut self, plan: &Plan, len: u64, id: u64, value: T) -> u64 {
        let pos = plan.pos;
        debug_assert!(pos + len <= self.capacity);
        let next = plan.next.map_or(NIL, |s| s.0);
        let prev = if next == NIL {
            self.tail
        } else {
            self.node(next).prev
        };
        debug_assert!(
            prev == NIL || self.node(prev).span.end() <= pos,
            "overlaps the span before"
        );
        debug_assert!(
            next == NIL || self.node(next).span.pos >= pos + len,
            "overlaps the span after"
        );
        let run_end = if next == NIL {
            self.high
        } else {
            self.node(next).span.pos
        }
        .min(self.high);
        let node = Node {
            span: Span {
                pos,
                len,
                id,
                value,
            },
            prev,
            next,
        };
        let n = match self.free_nodes.pop() {
            Some(n) => {
                self.nodes[n as usize] = Some(node);
                n
            }
            None => {
                self.nodes.push(Some(node));
                (self.nodes.len() - 1) as u32
            }
        };
        if prev == NIL {
            self.head = n;
        } else {
            self.node_mut(prev).next = n;
        }
        if next == NIL {
            self.tail = n;
        } else {
            self.node_mut(next).prev = n;
        }
        self.used += len;
        self.high = self.high.max(pos + len);
        self.cursor = pos + len;
        self.cursor_node = next;
        self.ids.insert(id, n);
        run_end
    }

    /// Starts the next walk at the beginning of the region (a soft clear:
    /// the next objects go from the first byte, as in vLLM).
    pub(crate) fn rewind(&mut self) {
        self.cursor = 0;
        self.cursor_node = self.head;
    }

    /// Frees span `s` if `may_go` accepts it.
    pub(crate) fn remove_if(
        &mut self,
        s: SpanId,
        may_go: impl FnOnce(&Span<T>) -> bool,
    ) -> Option<Span<T>> {
        let n = s.0;
        if !may_go(&self.node(n).span) {
            return None;
        }
        let node = self.nodes[n as usize].take().expect("a live node");
        if node.prev == NIL {
            self.head = node.next;
        } else {
            self.node_mut(node.prev).next = node.next;
        }
        if node.next == NIL {
            self.tail = node.prev;
        } else {
            self.node_mut(node.next).prev = node.prev;
        }
        if self.cursor_node == n {
            self.cursor_node = node.next;
        }
        self.free_nodes.push(n);
        self.ids.remove(&node.span.id);
        self.used -= node.span.len;
        Some(node.span)
    }

    /// Frees span `s`.
    #[cfg(test)]
    pub(crate) fn remove(&mut self, s: SpanId) -> Option<Span<T>> {
        self.remove_if(s, |_| true)
    }

    /// Largest run of free bytes.
    pub(crate) fn largest_free(&self) -> u64 {
        let mut best = 0;
        let mut prev = 0;
        for s in self.iter() {
            best = best.max(s.pos - prev);
            prev = s.end();
        }
        best.max(self.capacity - prev)
    }

    /// The span `s`.
    pub(crate) fn get(&self, s: SpanId) -> &Span<T> {
        &self.node(s.0).span
    }

    /// The span of object `id`.
    pub(crate) fn find(&self, id: u64) -> Option<&Span<T>> {
        Some(&self.node(*self.ids.get(&id)?).span)
    }

    /// The span of object `id`, to free it by.
    pub(crate) fn span_of(&self, id: u64) -> Option<SpanId> {
        self.ids.get(&id).map(|&n| SpanId(n))
    }

    /// As [`Ring::find`], mutable.
    pub(crate) fn find_mut(&mut self, id: u64) -> Option<&mut Span<T>> {
        let n = *self.ids.get(&id)?;
        Some(&mut self.node_mut(n).span)
    }

    /// The live spans, oldest first.
    pub(crate) fn by_age(&self) -> Vec<SpanId> {
        let mut by_id: Vec<(u64, u32)> = self.ids.iter().map(|(&id, &n)| (id, n)).collect();
        by_id.sort_unstable();
        by_id.into_iter().map(|(_, n)| SpanId(n)).collect()
    }

    /// Live spans in position order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Span<T>> {
        let mut n = self.head;
        std::iter::from_fn(move || {
            (n != NIL).then(|| {
                let node = self.node(n);
                n = node.next;
                &node.span
            })
        })
    }

    /// Live spans (in no particular order), mutable bookkeeping.
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Span<T>> {
        self.nodes.iter_mut().flatten().map(|n| &mut n.span)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Allocates with every span in the way allowed to go (FIFO-like).
    fn put(r: &mut Ring<bool>, id: u64, len: u64, keep: bool) -> Option<u64> {
        let plan = r.plan(len, |s| !s.value)?;
        for &v in &plan.victims {
            r.remove(v).expect("victim is live");
        }
        r.commit(&plan, len, id, keep);
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
            r.commit(&p, 100, id, 0);
        }
        // A second chance: refuse a span once, then let it go.
        let p = r
            .plan(250, |s| {
                s.value += 1;
                s.value > 1 || s.id != 0
            })
            .unwrap();
        assert_eq!(p.pos, 100, "the run restarts after the refused span");
        let at: Vec<u64> = p.victims.iter().map(|&v| r.get(v).pos).collect();
        assert_eq!(at, vec![100, 200, 300]);
        assert_eq!(r.find(0).unwrap().value, 1);
    }

    #[test]
    fn a_commit_reports_where_the_free_run_after_it_ends() {
        let mut r: Ring<bool> = Ring::new(1024);
        for id in 0..4 {
            put(&mut r, id, 128, false).unwrap();
        }
        assert_eq!(r.high_water(), 512);
        // Free 1 and 2 (positions 128 and 256), then put 64 bytes after 0.
        let by_age = r.by_age();
        r.remove(by_age[1]);
        r.remove(by_age[2]);
        assert_eq!(r.largest_free(), 1024 - 512);
        // A walk from position 128: only the free run up to 384 is needed.
        r.cursor = 128;
        r.cursor_node = r.first_ending_after(128);
        let plan = r.plan(64, |_| false).unwrap();
        assert_eq!((plan.pos, plan.victims.len()), (128, 0));
        assert_eq!(r.commit(&plan, 64, 9, false), 384, "up to the span at 384");
        // At the end: bounded by the high-water mark.
        let plan = r.plan(64, |_| false).unwrap();
        assert_eq!(plan.pos, 192);
        assert_eq!(r.by_age().first().map(|&s| r.get(s).id), Some(0));
        assert_eq!(r.find(9).map(|s| s.pos), Some(128));
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
                let kept: Vec<u64> = r.iter().filter(|s| s.value).map(|s| s.id).collect();
                if let Some(&id) = kept.first() {
                    r.find_mut(id).unwrap().value = false;
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
            assert_eq!(r.ids.len(), r.iter().count());
            assert_eq!(r.iter().count(), r.nodes.iter().flatten().count());
            let lf = r.largest_free();
            assert!(r.plan(lf, |_| false).is_some() || lf == 0);
            assert!(r.plan(lf + 64, |_| false).is_none());
        }
    }
}
