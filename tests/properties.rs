//! Property tests (proptest): random handles, random slot-header bytes and
//! random sequences of operations over a segment that is being scribbled
//! on give typed errors only: no panic, no out-of-bounds read, never bytes
//! of another object. This is the CI stand-in for a fuzzer: raise
//! PROPTEST_CASES for a longer local run.

mod common;

use common::{pattern, scribble, Name};
use pinshm::testing as layout;
use pinshm::{store::ObjectHandle, ObjectStore, StoreConfig, StoreReader};
use proptest::prelude::*;

const KIB: usize = 1024;

fn setup(test: &str, objects: u64) -> (Name, ObjectStore, Vec<ObjectHandle>, usize) {
    let name = Name::new(test);
    let len = 4 * KIB;
    let cap = 16 * layout::slot_len(2, len);
    let mut w =
        ObjectStore::create(StoreConfig::new(cap, len, 2).name(&*name).prefault(false)).unwrap();
    let hs = (0..objects)
        .map(|i| {
            w.put(&format!("k{i}"), &pattern(i, (i as usize * 397) % len))
                .unwrap()
        })
        .collect();
    (name, w, hs, cap)
}

/// Whatever a read returns must be the bytes that were put under that
/// handle, or an error.
fn check_read(r: &StoreReader, h: ObjectHandle, known: &[ObjectHandle]) {
    let len = 4 * KIB;
    if let Ok(g) = r.get(h) {
        let i = known
            .iter()
            .position(|k| *k == h)
            .expect("only handles that were put can succeed");
        assert_eq!(&*g, &pattern(i as u64, (i * 397) % len)[..]);
    }
    if let Ok(v) = r.get_copy(h) {
        let i = known
            .iter()
            .position(|k| *k == h)
            .expect("only handles that were put can succeed");
        assert_eq!(v, pattern(i as u64, (i * 397) % len));
    }
    let _ = r.get_item(h);
    let _ = r.get_tensor(h);
    let _ = r.acknowledge(h);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn random_handles_are_answered_with_the_right_bytes_or_an_error(
        address in prop_oneof![any::<u64>(), 0u64..70_000, (0u64..1100).prop_map(|x| x * 64)],
        id in prop_oneof![any::<u64>(), 0u64..20],
        epoch_flip in any::<bool>(),
    ) {
        let (_name, w, hs, _) = setup("prop-handle", 12);
        let r = StoreReader::attach(&w.handle()).unwrap();
        let epoch = if epoch_flip { hs[0].epoch ^ 1 } else { hs[0].epoch };
        check_read(&r, ObjectHandle { address, monotonic_id: id, epoch }, &hs);
    }

    #[test]
    fn random_slot_header_bytes_give_typed_errors(
        which in 0usize..12,
        offset in 0u64..192,
        bytes in proptest::collection::vec(any::<u8>(), 1..16),
    ) {
        let (name, w, hs, _) = setup("prop-slot", 12);
        let r = StoreReader::attach(&w.handle()).unwrap();
        let at = layout::header_len(2) as u64 + hs[which].address + offset;
        scribble(&name, at, &bytes);
        for h in &hs {
            // A scribbled slot may read as stale, or (payload bytes only)
            // differ; never panic or read out of bounds.
            if let Ok(g) = r.get(*h) {
                prop_assert!(g.len() <= 4 * KIB);
            }
            let _ = r.get_copy(*h);
            let _ = r.get_item(*h);
            let _ = r.acknowledge(*h);
        }
    }

    #[test]
    fn random_operations_over_a_scribbled_segment_give_typed_errors_only(
        ops in proptest::collection::vec((0u8..8, any::<u64>(), any::<u64>()), 1..60),
    ) {
        let (name, mut w, mut hs, cap) = setup("prop-ops", 4);
        let r = StoreReader::attach(&w.handle()).unwrap();
        let total = (layout::header_len(2) + cap) as u64;
        for (op, a, b) in ops {
            match op {
                0 | 1 => {
                    let i = hs.len();
                    if let Ok(h) = w.put(&format!("k{i}"), &pattern(i as u64, (i * 397) % (4 * KIB))) {
                        hs.push(h);
                    }
                }
                2 => { let _ = hs.get(a as usize % hs.len().max(1)).map(|h| r.get(*h).map(|g| g.len())); }
                3 => { let _ = hs.get(a as usize % hs.len().max(1)).map(|h| r.get_copy(*h)); }
                4 => { let _ = w.get_cached(&format!("k{}", a % (hs.len() as u64 + 1))); }
                5 => { w.free_unused(); }
                6 => { scribble(&name, a % total, &b.to_le_bytes()[..1 + (b % 8) as usize]); }
                _ => {
                    let h = ObjectHandle { address: a % (cap as u64 + 128), monotonic_id: b % 64, epoch: hs[0].epoch };
                    let _ = r.get(h).map(|g| g.len());
                    let _ = r.acknowledge(h);
                }
            }
        }
        let _ = pinshm::inspect::inspect(&name).map(|s| s.to_string());
    }
}
