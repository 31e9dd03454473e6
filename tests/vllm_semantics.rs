//! vLLM 0.33's shared-memory cache semantics, as first-class features of the
//! store: aggregate read accounting, writer protection, validate-only reads,
//! soft clear, handle signatures, attach by name.

mod common;

use common::{pattern, Name};
use pinshm::{store::StoreHandle, Error, ObjectStore, StoreConfig, StoreReader};

const KIB: usize = 1024;
const LEN: usize = 4 * KIB;

fn store(name: &Name, slots: usize, readers: u32, aggregate: bool) -> ObjectStore {
    ObjectStore::create(
        StoreConfig::new(slots * StoreConfig::slot_len(readers, LEN), LEN, readers)
            .name(&**name)
            .aggregate_reads(aggregate),
    )
    .unwrap()
}

#[test]
fn aggregate_reads_free_an_object_after_refs_times_readers_reads_from_anyone() {
    let name = Name::new("aggregate");
    let mut w = store(&name, 8, 2, true);
    let r0 = StoreReader::attach_as(&w.handle(), 0).unwrap();
    let _r1 = StoreReader::attach_as(&w.handle(), 1).unwrap();
    let h = w.put("a", &pattern(1, LEN)).unwrap();
    drop(r0.get(h).unwrap());
    assert_eq!(w.free_unused(), 0, "1 read of 2 expected");
    // Reader 1 never reads: reader 0's second read covers it.
    drop(r0.get(h).unwrap());
    assert_eq!(w.free_unused(), 1);
}

#[test]
fn per_reader_accounting_needs_each_readers_own_read() {
    let name = Name::new("perreader");
    let mut w = store(&name, 8, 2, false);
    let r0 = StoreReader::attach_as(&w.handle(), 0).unwrap();
    let r1 = StoreReader::attach_as(&w.handle(), 1).unwrap();
    let h = w.put("a", &pattern(1, LEN)).unwrap();
    drop(r0.get(h).unwrap());
    drop(r0.get(h).unwrap());
    assert_eq!(w.free_unused(), 0, "reader 1 still owes its read");
    drop(r1.get(h).unwrap());
    assert_eq!(w.free_unused(), 1);
}

#[test]
fn aggregate_counting_with_get_cached_expects_refs_times_readers() {
    let name = Name::new("aggrefs");
    let mut w = store(&name, 8, 2, true);
    let r0 = StoreReader::attach_as(&w.handle(), 0).unwrap();
    let r1 = StoreReader::attach_as(&w.handle(), 1).unwrap();
    let h = w.put("a", &pattern(1, LEN)).unwrap();
    assert_eq!(w.get_cached("a"), Some(h));
    for _ in 0..3 {
        drop(r1.get(h).unwrap());
    }
    assert_eq!(w.free_unused(), 0, "3 reads of 2 refs x 2 readers");
    r0.acknowledge(h).unwrap();
    assert_eq!(w.free_unused(), 1);
}

#[test]
fn a_protected_key_survives_reclaim_until_get_cached_or_release() {
    let name = Name::new("protect");
    let mut w = store(&name, 8, 1, false);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let a = w.put("a", &pattern(1, LEN)).unwrap();
    drop(r.get(a).unwrap());
    w.protect("a").unwrap();
    assert_eq!(w.free_unused(), 0, "protected");
    assert!(matches!(w.protect("nope"), Err(Error::KeyNotFound { .. })));
    let blocker = w
        .stats()
        .oldest_unread
        .expect("the protected object blocks");
    assert!(blocker.protected && blocker.unread_by.is_empty());
    assert!(blocker.to_string().contains("protected"), "{blocker}");
    // get_cached ends the protection and asks for one more read.
    assert_eq!(w.get_cached("a"), Some(a));
    assert_eq!(w.free_unused(), 0, "one more read owed");
    drop(r.get(a).unwrap());
    assert_eq!(w.free_unused(), 1);
    // release_protections ends every protection.
    let b = w.put("b", &pattern(2, LEN)).unwrap();
    drop(r.get(b).unwrap());
    w.protect("b").unwrap();
    assert_eq!(w.free_unused(), 0);
    w.release_protections();
    assert_eq!(w.free_unused(), 1);
}

#[test]
fn validate_checks_a_handle_and_acknowledges_nothing() {
    let name = Name::new("validate");
    let mut w = store(&name, 3, 1, false);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let a = w.put("a", &pattern(1, LEN)).unwrap();
    for _ in 0..3 {
        r.validate(a).unwrap();
    }
    assert_eq!(w.free_unused(), 0, "validate acknowledges no read");
    let mut forged = a;
    forged.epoch ^= 1;
    assert!(matches!(r.validate(forged), Err(Error::Stale { .. })));
    drop(r.get(a).unwrap());
    assert_eq!(w.free_unused(), 1);
    assert!(matches!(r.validate(a), Err(Error::Stale { .. })));
}

#[test]
fn a_soft_clear_forgets_keys_and_old_handles_read_until_their_slot_is_reused() {
    let name = Name::new("softclear");
    let mut w = store(&name, 3, 1, false);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let a = w.put("a", &pattern(1, LEN)).unwrap();
    let b = w.put("b", &pattern(2, LEN)).unwrap();
    w.clear();
    assert!(!w.is_cached("a") && !w.is_cached("b"));
    assert_eq!(w.get_cached("a"), None);
    // Old handles still read their own bytes; nothing is owed any more.
    assert_eq!(&*r.get(a).unwrap(), &pattern(1, LEN)[..]);
    // Ids keep increasing; the key can be put again. As in vLLM, the
    // puts after a clear go from the first byte: a's slot, unread.
    let a2 = w.put("a", &pattern(3, LEN)).unwrap();
    assert!(a2.monotonic_id > b.monotonic_id);
    assert_eq!(a2.epoch, a.epoch, "a soft clear keeps the epoch");
    assert_eq!(a2.address, a.address);
    assert!(
        matches!(r.get(a), Err(Error::Stale { .. })),
        "a's slot was reused"
    );
    assert_eq!(&*r.get(b).unwrap(), &pattern(2, LEN)[..], "b's was not");
    // The next put takes b's slot.
    let c = w.put("c", &pattern(4, LEN)).unwrap();
    assert_eq!(c.address, b.address);
    assert!(matches!(r.get(b), Err(Error::Stale { .. })));
    assert_eq!(&*r.get(a2).unwrap(), &pattern(3, LEN)[..]);
}

#[test]
fn signatures_bind_a_handle_to_its_key_for_writer_and_reader() {
    let name = Name::new("signature");
    let mut w = store(&name, 8, 1, false);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let a = w.put("a", &pattern(1, LEN)).unwrap();
    let b = w.put("b", &pattern(2, LEN)).unwrap();
    let sig = w.signature("a").unwrap();
    assert_eq!(w.signature("nope"), None);
    assert!(r.verify("a", a, &sig) && w.verify("a", a, &sig));
    assert!(!r.verify("b", a, &sig), "wrong key");
    assert!(!r.verify("a", b, &sig), "wrong handle");
    assert!(!r.verify("a", a, &sig[..16]), "wrong length");
    let mut bad = sig;
    bad[0] ^= 0x80;
    assert!(!r.verify("a", a, &bad), "tampered");
    // The writer also checks that the key still maps to the handle.
    w.clear();
    assert!(r.verify("a", a, &sig), "the MAC itself still holds");
    assert!(!w.verify("a", a, &sig), "but 'a' is no longer stored");
    // Another segment has another secret.
    let other = Name::new("signature2");
    let mut w2 = store(&other, 8, 1, false);
    let a_other = w2.put("a", &pattern(1, LEN)).unwrap();
    assert_eq!(
        (a_other.address, a_other.monotonic_id),
        (a.address, a.monotonic_id)
    );
    assert_ne!(w2.signature("a").unwrap(), sig);
}

#[test]
fn a_reader_attaches_by_name_alone() {
    let name = Name::new("byname");
    let mut w = store(&name, 8, 2, true);
    let h = w.put("a", &pattern(1, LEN)).unwrap();
    let sh = StoreHandle::of(&name).unwrap();
    assert_eq!(sh, w.handle());
    let r = StoreReader::attach_by_name(&name).unwrap();
    assert_eq!(&*r.get(h).unwrap(), &pattern(1, LEN)[..]);
    assert!(matches!(
        StoreReader::attach_by_name("pinshm-test-no-such-segment"),
        Err(Error::NotFound { .. })
    ));
}

#[test]
fn lookup_and_keys_count_no_read_and_peek_reads_the_writers_own_bytes() {
    let name = Name::new("peek");
    let mut w = store(&name, 2, 1, true);
    let _r = StoreReader::attach_as(&w.handle(), 0).unwrap();
    let a = w.put("a", &pattern(1, LEN)).unwrap();
    let b = w.put("b", &pattern(2, 100)).unwrap();
    assert_eq!((w.lookup("a"), w.lookup("zz")), (Some(a), None));
    let mut keys: Vec<_> = w.keys().collect();
    keys.sort_by_key(|&(k, _)| k);
    assert_eq!(keys, vec![("a", a), ("b", b)]);
    assert_eq!((w.len(), w.is_empty()), (2, false));
    assert_eq!(w.peek(a).unwrap(), &pattern(1, LEN)[..]);
    assert_eq!(w.peek(b).unwrap(), &pattern(2, 100)[..]);
    // Peeks and lookups count nothing: both still wait for their reads.
    assert_eq!(w.free_unused(), 0);
    for bad in [
        pinshm::store::ObjectHandle {
            monotonic_id: a.monotonic_id + 7,
            ..a
        },
        pinshm::store::ObjectHandle {
            address: b.address,
            ..a
        },
        pinshm::store::ObjectHandle {
            epoch: a.epoch ^ 1,
            ..a
        },
    ] {
        assert!(w.peek(bad).unwrap_err().is_stale(), "{bad:?}");
    }
    // A soft clear keeps the bytes readable until the slot is reused.
    w.clear();
    assert_eq!((w.len(), w.lookup("a")), (0, None));
    assert_eq!(w.peek(a).unwrap(), &pattern(1, LEN)[..]);
    w.clear_hard();
    assert!(w.peek(a).unwrap_err().is_stale());
}

#[test]
fn a_reader_leaves_a_sparse_segment_sparse() {
    use std::os::unix::fs::MetadataExt;
    let name = Name::new("sparse");
    let cap = 64 << 20;
    let mut w = ObjectStore::create(
        StoreConfig::new(cap, LEN, 1)
            .name(&*name)
            .reserve(false)
            .prefault(false)
            .back_ahead(0)
            .aggregate_reads(true),
    )
    .unwrap();
    let r = StoreReader::attach(&w.handle()).unwrap();
    let h = w.put("a", &pattern(3, LEN)).unwrap();
    assert_eq!(&*r.get(h).unwrap(), &pattern(3, LEN)[..]);
    let taken = std::fs::metadata(format!("/dev/shm/{}", &*name))
        .unwrap()
        .blocks()
        * 512;
    assert!(
        taken < (cap / 8) as u64,
        "{taken} bytes of a sparse {cap}-byte ring allocated"
    );
}

#[test]
fn after_a_soft_clear_the_next_put_goes_from_the_first_byte_around_what_is_held() {
    let name = Name::new("clearfirst");
    let mut w = store(&name, 8, 1, true);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let hs: Vec<_> = (0..5)
        .map(|i| w.put(&format!("item_{i}"), &[i as u8; LEN]).unwrap())
        .collect();
    // Unread and one of them held: a clear forgives the reads, not holds.
    let held = r.get(hs[0]).unwrap();
    w.clear();
    let h = w.put("new_item", &[9; LEN]).unwrap();
    assert_eq!(
        h.address, hs[1].address,
        "from the first byte, around the held slot"
    );
    assert_eq!(h.monotonic_id, hs[4].monotonic_id + 1, "ids go on");
    drop(held);
    w.clear();
    let h = w.put("newer", &[8; LEN]).unwrap();
    assert_eq!(h.address, 0, "nothing held: the first byte");
}
