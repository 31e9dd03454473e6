//! The pure FIFO allocator of the data region.
//!
//! [`Ring`] is arithmetic over virtual positions, kept in the writer's own
//! memory (never read back from shared memory). Positions only grow; a
//! slot's address is `pos % capacity`. A slot never straddles the end: an
//! allocation that would is moved to the next lap and the skipped tail
//! counts as used until the slot before it is freed. Tested under Miri.

use std::collections::VecDeque;

/// One allocation of the ring.
#[derive(Debug, Clone)]
pub struct Span<T> {
    /// Virtual start position.
    pub pos: u64,
    /// The caller's bookkeeping.
    pub value: T,
}

/// FIFO allocator over `capacity` bytes (writer memory only).
#[derive(Debug)]
pub struct Ring<T> {
    capacity: u64,
    tail: u64,
    spans: VecDeque<Span<T>>,
}

impl<T> Ring<T> {
    /// An empty ring of `capacity` bytes (> 0).
    pub fn new(capacity: u64) -> Self {
        assert!(capacity > 0, "ring capacity must be positive");
        Ring {
            capacity,
            tail: 0,
            spans: VecDeque::new(),
        }
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Virtual position of the oldest slot (or the tail when empty).
    pub fn head(&self) -> u64 {
        self.spans.front().map_or(self.tail, |s| s.pos)
    }

    /// Virtual position one past the newest slot.
    pub fn tail(&self) -> u64 {
        self.tail
    }

    /// Bytes between head and tail (live slots plus skipped lap ends).
    pub fn used(&self) -> u64 {
        self.tail - self.head()
    }

    /// Physical address of a virtual position.
    pub fn address(&self, pos: u64) -> u64 {
        pos % self.capacity
    }

    /// Largest allocation that would succeed now.
    pub fn largest_free(&self) -> u64 {
        if self.spans.is_empty() {
            return self.capacity;
        }
        let head = self.head();
        let free = self.capacity - (self.tail - head);
        let to_end = self.capacity - self.tail % self.capacity;
        // Either up to the end of this lap, or from the next lap's start up to head.
        if to_end >= free {
            free
        } else {
            to_end.max(free - to_end)
        }
    }

    /// Where a slot of `len` bytes would start, without taking it.
    pub fn reserve(&self, len: u64) -> Option<u64> {
        if len == 0 || len > self.capacity {
            return None;
        }
        let (tail, head) = if self.spans.is_empty() {
            // An empty ring restarts at the beginning of a lap: no skip needed.
            let t = self.tail.div_ceil(self.capacity) * self.capacity;
            (t, t)
        } else {
            (self.tail, self.head())
        };
        let phys = tail % self.capacity;
        let start = if phys + len > self.capacity {
            tail + (self.capacity - phys)
        } else {
            tail
        };
        (start + len - head <= self.capacity).then_some(start)
    }

    /// Takes the slot `reserve` proposed.
    pub fn commit(&mut self, pos: u64, len: u64, value: T) {
        debug_assert_eq!(Some(pos), self.reserve(len));
        self.tail = pos + len;
        self.spans.push_back(Span { pos, value });
    }

    /// The oldest slot.
    pub fn front(&self) -> Option<&Span<T>> {
        self.spans.front()
    }

    /// Whether no slot is live.
    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Frees the oldest slot.
    pub fn pop_front(&mut self) -> Option<Span<T>> {
        self.spans.pop_front()
    }

    /// Live slots, oldest first, mutable bookkeeping.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Span<T>> {
        self.spans.iter_mut()
    }

    /// Number of live slots.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// The live slot whose value matches `key`, by binary search on a key
    /// that grows with position (the monotonic id).
    pub fn find_by<K: Ord>(&self, key: K, f: impl Fn(&T) -> K) -> Option<&Span<T>> {
        self.spans.get(self.index_of(key, f)?)
    }

    /// As [`Ring::find_by`], mutable.
    pub fn find_by_mut<K: Ord>(&mut self, key: K, f: impl Fn(&T) -> K) -> Option<&mut Span<T>> {
        let i = self.index_of(key, f)?;
        self.spans.get_mut(i)
    }

    fn index_of<K: Ord>(&self, key: K, f: impl Fn(&T) -> K) -> Option<usize> {
        match self.spans.back() {
            // The newest slot is the common case (publishing a put).
            Some(b) if f(&b.value) == key => Some(self.spans.len() - 1),
            _ => self.spans.binary_search_by(|s| f(&s.value).cmp(&key)).ok(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_allocates_in_order_and_wraps_without_straddling() {
        let mut r: Ring<u32> = Ring::new(1000);
        let a = r.reserve(400).unwrap();
        r.commit(a, 400, 1);
        let b = r.reserve(400).unwrap();
        r.commit(b, 400, 2);
        assert_eq!((a, b), (0, 400));
        // 200 left at the end, 300 does not fit: nothing freed yet.
        assert_eq!(r.reserve(300), None);
        assert_eq!(r.reserve(200), Some(800));
        r.pop_front();
        // Now 300 goes to the next lap's start, skipping 200 at the end.
        let c = r.reserve(300).unwrap();
        assert_eq!(c, 1000);
        assert_eq!(r.address(c), 0);
        r.commit(c, 300, 3);
        assert_eq!(r.used(), 900);
        // 100 left before b (at 400): 150 does not fit.
        assert_eq!(r.reserve(150), None);
        assert_eq!(r.reserve(100), Some(1300));
    }

    #[test]
    fn empty_ring_restarts_at_a_lap_start() {
        let mut r: Ring<()> = Ring::new(1000);
        let a = r.reserve(700).unwrap();
        r.commit(a, 700, ());
        r.pop_front();
        // A 900-byte slot fits in an empty ring even though the tail is at 700.
        assert_eq!(r.reserve(900), Some(1000));
        assert_eq!(r.reserve(1000), Some(1000));
        assert_eq!(r.reserve(1001), None);
        assert_eq!(r.reserve(0), None);
    }

    #[test]
    fn largest_free_matches_reserve() {
        let mut r: Ring<()> = Ring::new(1024);
        let mut rng = 12345u64;
        for _ in 0..2000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let len = (rng % 512 + 1) * 2 / 2;
            if rng % 3 == 0 {
                r.pop_front();
            }
            let lf = r.largest_free();
            assert!(
                lf == 0 || r.reserve(lf).is_some(),
                "largest_free {lf} must fit"
            );
            assert!(
                r.reserve(lf + 1).is_none(),
                "largest_free {lf} must be largest"
            );
            if let Some(p) = r.reserve(len) {
                assert!(r.address(p) + len <= 1024, "no slot straddles the end");
                r.commit(p, len, ());
            }
            assert!(r.used() <= 1024);
        }
    }

    #[test]
    fn find_by_locates_ids_across_the_deque_seam() {
        let mut r: Ring<u64> = Ring::new(10);
        for id in 1..=10 {
            let p = r.reserve(1).unwrap();
            r.commit(p, 1, id);
        }
        for _ in 0..5 {
            r.pop_front();
        }
        for id in 11..=15 {
            let p = r.reserve(1).unwrap();
            r.commit(p, 1, id);
        }
        for id in 6..=15 {
            assert_eq!(r.find_by_mut(id, |v| *v).map(|s| s.value), Some(id));
        }
        assert!(r.find_by_mut(5, |v| *v).is_none());
    }
}
