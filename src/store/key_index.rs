//! The shared key index: the writer's half (insert, remove, clear) and the
//! reader's probe, over the table and sequence word of
//! [`IndexPtr`](crate::atomics::IndexPtr) (whose orderings are chosen in
//! `crate::atomics::index`).
//!
//! Open addressing with linear probing from `fp[0] mod entries`; removal
//! shifts the entries after a hole back (no tombstones, so chains stay as
//! short as the load allows). The table is kept at most three quarters
//! full: a key past that is not indexed (readers miss it; the writer's
//! own lookup still finds it) and counted in `StoreStats::unindexed`.

use crate::atomics::IndexPtr;

/// The writer's side of the index.
#[derive(Debug)]
pub(super) struct SharedIndex {
    ptr: IndexPtr,
    /// Entries in use.
    len: u64,
    /// Most entries in use (three quarters of the table).
    limit: u64,
}

// SAFETY: the pointer is into the writer's mapping, which the store keeps
// alive and moves with it; the writer uses it from one thread at a time.
unsafe impl Send for SharedIndex {}

impl SharedIndex {
    pub(super) fn new(ptr: IndexPtr) -> SharedIndex {
        SharedIndex {
            ptr,
            len: 0,
            limit: ptr.entries() / 4 * 3,
        }
    }

    fn mask(&self) -> u64 {
        self.ptr.entries() - 1
    }

    /// Indexes `fp` at object `id` in the slot at `address`; false if the
    /// table is at its limit (the key is then not indexed).
    pub(super) fn insert(&mut self, fp: [u64; 2], id: u64, address: u64) -> bool {
        if self.len >= self.limit {
            return false;
        }
        let mask = self.mask();
        let mut i = fp[0] & mask;
        // Below the limit there is an empty entry on every chain, unless
        // another process scribbled over the table: a lap at most.
        let mut steps = 0;
        while self.ptr.read(i).1 != 0 {
            i = (i + 1) & mask;
            steps += 1;
            if steps == self.ptr.entries() {
                tracing::warn!(
                    "the shared key index has no empty entry (corrupted?): key not indexed"
                );
                return false;
            }
        }
        let s = self.ptr.begin_change();
        self.ptr.write(i, fp, id, address);
        self.ptr.end_change(s);
        self.len += 1;
        true
    }

    /// Removes the entry of object `id` (key fingerprint `fp`), if any.
    pub(super) fn remove(&mut self, fp: [u64; 2], id: u64) {
        let mask = self.mask();
        let mut i = fp[0] & mask;
        let mut steps = 0;
        loop {
            let (_, eid, _) = self.ptr.read(i);
            if eid == 0 || steps == self.ptr.entries() {
                return; // not indexed (the table was full at its put)
            }
            if eid == id {
                break;
            }
            i = (i + 1) & mask;
            steps += 1;
        }
        let s = self.ptr.begin_change();
        // Backward shift (Knuth's algorithm R): each later entry of the run
        // whose home is not cyclically in (hole, its place] moves into the
        // hole, which moves to where it was.
        let mut j = i;
        for _ in 1..self.ptr.entries() {
            j = (j + 1) & mask;
            let (efp, eid, eaddr) = self.ptr.read(j);
            if eid == 0 {
                break;
            }
            let home = efp[0] & mask;
            let stays = if i <= j {
                i < home && home <= j
            } else {
                i < home || home <= j
            };
            if !stays {
                self.ptr.write(i, efp, eid, eaddr);
                i = j;
            }
        }
        self.ptr.write(i, [0, 0], 0, 0);
        self.ptr.end_change(s);
        self.len -= 1;
    }

    /// Empties the table (a clear).
    pub(super) fn clear(&mut self) {
        if self.len == 0 {
            return;
        }
        let s = self.ptr.begin_change();
        for i in 0..self.ptr.entries() {
            if self.ptr.read(i).1 != 0 {
                self.ptr.write(i, [0, 0], 0, 0);
            }
        }
        self.ptr.end_change(s);
        self.len = 0;
    }

    /// Entries in use.
    pub(super) fn len(&self) -> u64 {
        self.len
    }
}

/// How many times a reader probes again after the writer changed the
/// table under its probe, yielding the CPU between tries, before it
/// reports a miss (a writer that died in the middle of a change leaves the
/// sequence word odd: its readers miss, they never spin forever).
const RETRIES: usize = 32;

/// A reader's probe for `fp`: `Some((id, address))` of an entry whose
/// fingerprint is `fp`, read whole between two equal even values of the
/// sequence word (still to be checked against its slot: the writer may
/// change the table right after), or `None` if the table had no such
/// entry then (or the writer kept changing it through every retry).
#[inline]
pub(super) fn probe(ptr: &IndexPtr, fp: [u64; 2]) -> Option<(u64, u64)> {
    let mask = ptr.entries() - 1;
    for _ in 0..RETRIES {
        let s = ptr.seq_begin();
        if s & 1 == 0 {
            let mut i = fp[0] & mask;
            let mut found = None;
            // At most a lap: a table the writer keeps below 3/4 full always
            // has an empty entry, but a hostile one need not.
            for _ in 0..ptr.entries() {
                let (efp, id, address) = ptr.read(i);
                if id == 0 {
                    break;
                }
                if efp == fp {
                    found = Some((id, address));
                    break;
                }
                i = (i + 1) & mask;
            }
            // A hit is checked against its slot anyway; checking it here too
            // turns a torn entry (mid-move) into a retry, not a miss.
            if ptr.seq_end() == s {
                return found;
            }
        }
        crate::atomics::word::yield_now();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::atomics::HeaderPtr;

    /// A table and a header in heap memory, laid out as in a segment.
    struct Table {
        _mem: Vec<u64>,
        ptr: IndexPtr,
    }

    fn table(entries: u64) -> Table {
        let mut mem = vec![0u64; 512 + 4 * entries as usize];
        let base = mem.as_mut_ptr() as *mut u8;
        // SAFETY: `mem` is 8-aligned and holds a 4096-byte header followed
        // by `entries` 32-byte entries; it outlives `ptr` (both in Table).
        let ptr = unsafe { IndexPtr::new(base.add(4096), entries, HeaderPtr::new(base)) };
        Table { _mem: mem, ptr }
    }

    fn fp(home: u64, n: u64) -> [u64; 2] {
        [home, n]
    }

    #[test]
    fn entries_are_found_after_removals_in_the_middle_of_their_chain() {
        let t = table(16);
        let mut ix = SharedIndex::new(t.ptr);
        // Five keys on home 14 (wrapping past the end), two on home 15.
        let keys: Vec<_> = (0..5)
            .map(|n| fp(14, n))
            .chain((0..2).map(|n| fp(15, 10 + n)))
            .collect();
        for (k, f) in keys.iter().enumerate() {
            assert!(ix.insert(*f, k as u64 + 1, 64 * k as u64));
        }
        let mut removed = Vec::new();
        for remove in [2usize, 0, 5] {
            ix.remove(keys[remove], remove as u64 + 1);
            removed.push(remove);
            for (k, f) in keys.iter().enumerate() {
                let want = (!removed.contains(&k)).then_some((k as u64 + 1, 64 * k as u64));
                assert_eq!(
                    probe(&t.ptr, *f),
                    want,
                    "key {k} after removing {removed:?}"
                );
            }
        }
        assert_eq!(ix.len(), 4);
        ix.clear();
        assert!(keys.iter().all(|f| probe(&t.ptr, *f).is_none()));
    }

    #[test]
    fn a_full_table_refuses_keys_past_three_quarters() {
        let t = table(8);
        let mut ix = SharedIndex::new(t.ptr);
        for n in 0..6 {
            assert!(ix.insert(fp(n, n), n + 1, 0));
        }
        assert!(!ix.insert(fp(6, 6), 7, 0), "6 of 8 is the limit");
        assert_eq!(probe(&t.ptr, fp(6, 6)), None);
        ix.remove(fp(3, 3), 4);
        assert!(ix.insert(fp(6, 6), 7, 0));
        assert_eq!(probe(&t.ptr, fp(6, 6)), Some((7, 0)));
    }

    #[test]
    fn removing_an_unindexed_key_changes_nothing() {
        let t = table(8);
        let mut ix = SharedIndex::new(t.ptr);
        ix.insert(fp(1, 1), 1, 64);
        ix.remove(fp(1, 2), 9);
        ix.remove(fp(1, 1), 9);
        assert_eq!(probe(&t.ptr, fp(1, 1)), Some((1, 64)));
        assert_eq!(ix.len(), 1);
    }
}

/// loom runs the shipped index code (its atomics are loom's under
/// `--cfg pinshm_loom`): a reader probing for a key that is present before and
/// after a removal that moves it finds it, whatever the interleaving
/// (`.ci/run`: `--cfg pinshm_loom`, `store::key_index::loom_model`).
#[cfg(all(test, pinshm_loom))]
mod loom_model {
    use super::*;
    use crate::atomics::word::table;
    use crate::atomics::HeaderPtr;

    #[test]
    fn a_key_moved_by_a_removal_is_never_missed() {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b.check(|| {
            table::reset();
            let base = table::mapping(4096);
            // SAFETY: a page of zeroes: a 256-byte header, then a table of
            // 4 entries (128 bytes), 8-aligned, live until the next reset.
            let ptr = unsafe { IndexPtr::new(base.add(256), 4, HeaderPtr::new(base)) };
            let mut ix = SharedIndex::new(ptr);
            // Both keys' home is entry 0: k2 sits at 1, and moves to 0
            // when k1 goes.
            assert!(ix.insert([4, 1], 1, 64));
            assert!(ix.insert([8, 2], 2, 128));
            // Every word made before the threads start (the shim makes a
            // word's loom atomic on its first access).
            (0..4).for_each(|i| {
                let _ = ptr.read(i);
            });
            ptr.seq_begin();
            struct P(IndexPtr);
            // SAFETY: the mapping outlives the model's threads (freed at
            // the next reset); every access goes through loom's atomics.
            unsafe impl Send for P {}
            let p = P(ptr);
            let reader = loom::thread::spawn(move || {
                let p = p;
                probe(&p.0, [8, 2])
            });
            ix.remove([4, 1], 1);
            assert_eq!(reader.join().unwrap(), Some((2, 128)));
        });
    }
}
