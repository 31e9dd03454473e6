//! Single-process behaviour of the store: semantics of the reference,
//! stale handles, torn reads, guards, read-only views (attaching and
//! validation: tests/attach.rs).

mod common;

use common::{pattern, slot, store, Name};
use pinshm::testing as layout;
use pinshm::{store::ObjectHandle, Error, ObjectStore, StoreConfig, StoreReader};

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;

fn assert_stale(r: pinshm::Result<impl std::fmt::Debug>, h: ObjectHandle) {
    match r {
        Err(e @ Error::Stale { .. }) => assert_eq!(
            e.to_string(),
            format!(
                "Data for address:id '{}:{}' has been modified or is invalid.",
                h.address, h.monotonic_id
            )
        ),
        other => panic!("expected Stale for {h:?}, got {other:?}"),
    }
}

#[test]
fn put_then_get_returns_the_same_bytes_by_guard_and_by_copy() {
    let name = Name::new("roundtrip");
    let mut w = store(&name, 4 * MIB, MIB, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    for (i, len) in [0usize, 1, 63, 64, 65, 4096, 100_000, MIB]
        .into_iter()
        .enumerate()
    {
        let data = pattern(i as u64, len);
        let h = w.put(&format!("k{i}"), &data).unwrap();
        assert_eq!(h.address % 64, 0);
        {
            let g = r.get(h).unwrap();
            assert_eq!(&*g, &data[..]);
            assert_eq!(g.as_ptr() as usize % 64, 0, "payload is 64-byte aligned");
        }
        let h2 = w.get_cached(&format!("k{i}")).unwrap();
        assert_eq!(h, h2);
        assert_eq!(r.get_copy(h).unwrap(), data);
    }
}

#[test]
fn put_with_fills_in_place() {
    let name = Name::new("putwith");
    let mut w = store(&name, MIB, 64 * KIB, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let h = w
        .put_with("k", 1000, |s| {
            for (i, b) in s.iter_mut().enumerate() {
                *b = (i % 251) as u8;
            }
        })
        .unwrap();
    let g = r.get(h).unwrap();
    assert!(g.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
}

#[test]
fn duplicate_key_is_an_error_and_changes_nothing() {
    let name = Name::new("dup");
    let mut w = store(&name, MIB, 64 * KIB, 1);
    let h = w.put("k", b"one").unwrap();
    let e = w.put("k", b"two").unwrap_err();
    assert!(matches!(e, Error::DuplicateKey { .. }));
    assert!(e.to_string().contains("already exists"), "{e}");
    let r = StoreReader::attach(&w.handle()).unwrap();
    assert_eq!(&*r.get(h).unwrap(), b"one");
    assert_eq!(w.stats().puts, 1);
}

#[test]
fn object_over_the_limit_names_both_sizes() {
    let name = Name::new("toolarge");
    let mut w = store(&name, MIB, 1000, 1);
    let e = w.put("k", &[0; 1001]).unwrap_err();
    assert!(matches!(
        e,
        Error::TooLarge {
            size: 1001,
            max: 1000
        }
    ));
    let msg = e.to_string();
    assert!(
        msg.contains("exceeds max object size") && msg.contains("1001") && msg.contains("1000"),
        "{msg}"
    );
    assert!(w.put("k", &[0; 1000]).is_ok());
}

#[test]
fn the_largest_object_a_ring_accepts_is_created_filled_and_one_byte_more_is_refused() {
    for readers in [1, 3, 64] {
        let capacity = 64 * 1024;
        let largest = StoreConfig::largest_object(capacity, readers);
        assert_eq!(
            StoreConfig::slot_len(readers, largest) + StoreConfig::SLOT_ALIGN,
            capacity,
            "{readers} readers"
        );
        let name = Name::new("largest");
        let mut w = store(&name, capacity, largest, readers);
        w.put("k", &vec![7; largest]).unwrap();
        drop(w);
        let name = Name::new("largest1");
        let e = ObjectStore::create(StoreConfig::new(capacity, largest + 1, readers).name(&*name))
            .unwrap_err();
        assert!(matches!(e, Error::InvalidConfig(_)), "{e}");
    }
    // Smaller than one slot header: nothing fits, not even an empty object.
    assert_eq!(StoreConfig::largest_object(64, 1), 0);
    let name = Name::new("largest0");
    assert!(ObjectStore::create(StoreConfig::new(64, 0, 1).name(&*name)).is_err());
}

#[test]
fn an_unread_object_stays_where_it_is_and_the_writer_allocates_around_it() {
    let name = Name::new("fifo");
    let len = 10 * KIB;
    // Room for exactly three slots.
    let mut w = store(&name, 3 * slot(1, len), len, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let a = w.put("a", &pattern(1, len)).unwrap();
    let b = w.put("b", &pattern(2, len)).unwrap();
    let c = w.put("c", &pattern(3, len)).unwrap();
    drop(r.get(b).unwrap());
    // `a` is unread: it stays, and `b`, the oldest object read, goes.
    let d = w.put("d", &pattern(4, len)).unwrap();
    assert_eq!(d.address, b.address);
    assert!(w.is_cached("a") && !w.is_cached("b") && w.is_cached("c"));
    assert_stale(r.get(b), b);
    // Now every object is unread: Full names the oldest, `a`.
    let e = w.put("e", &pattern(5, len)).unwrap_err();
    match &e {
        Error::Full {
            blocker: Some(b), ..
        } => {
            assert_eq!(b.monotonic_id, a.monotonic_id);
            assert_eq!(b.key.as_deref(), Some("a"));
            assert_eq!(b.unread_by, vec![0]);
            assert!(b.held_by.is_empty());
        }
        other => panic!("expected Full, got {other:?}"),
    }
    let msg = e.to_string();
    assert!(
        msg.contains("still unread by reader(s) [0]") && msg.contains("bytes asked for"),
        "{msg}"
    );
    assert_eq!(w.stats().full_errors, 1);

    drop(r.get(c).unwrap());
    let e = w.put("e", &pattern(5, len)).unwrap();
    assert_eq!(e.address, c.address, "only as much as needed is reclaimed");
    assert!(w.is_cached("a") && w.is_cached("d"));
    assert_eq!(r.get_copy(a).unwrap(), pattern(1, len), "a is untouched");
    assert_eq!(r.get_copy(e).unwrap(), pattern(5, len));
}

#[test]
fn every_reader_must_read_before_reclaim() {
    let name = Name::new("allreaders");
    let len = 4 * KIB;
    let mut w = store(&name, 2 * slot(2, len), len, 2);
    let r0 = StoreReader::attach_as(&w.handle(), 0).unwrap();
    let r1 = StoreReader::attach_as(&w.handle(), 1).unwrap();
    let a = w.put("a", &pattern(1, len)).unwrap();
    w.put("b", &pattern(2, len)).unwrap();
    drop(r0.get(a).unwrap());
    // Reader 0 reading twice does not stand in for reader 1.
    drop(r0.get(a).unwrap());
    r0.acknowledge(a).unwrap();
    match w.put("c", &pattern(3, len)).unwrap_err() {
        Error::Full {
            blocker: Some(b), ..
        } => assert_eq!(b.unread_by, vec![1]),
        e => panic!("{e:?}"),
    }
    drop(r1.get(a).unwrap());
    w.put("c", &pattern(3, len)).unwrap();
}

#[test]
fn get_cached_asks_every_reader_for_one_more_read() {
    let name = Name::new("getcached");
    let len = 4 * KIB;
    let mut w = store(&name, 2 * slot(1, len), len, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let a = w.put("a", &pattern(1, len)).unwrap();
    drop(r.get(a).unwrap());
    assert_eq!(w.get_cached("a"), Some(a));
    assert_eq!(w.stats().hits, 1);
    w.put("b", &pattern(2, len)).unwrap();
    assert!(
        matches!(w.put("c", &pattern(3, len)), Err(Error::Full { .. })),
        "a owes a second read"
    );
    assert_eq!(&*r.get(a).unwrap(), &pattern(1, len)[..]);
    w.put("c", &pattern(3, len)).unwrap();
    assert!(!w.is_cached("a"));
    assert_eq!(w.get_cached("a"), None);
    assert!(matches!(
        w.add_reference("a"),
        Err(Error::KeyNotFound { .. })
    ));
}

#[test]
fn add_reference_counts_like_get_cached_and_acknowledge_like_a_read() {
    let name = Name::new("addref");
    let len = 4 * KIB;
    let mut w = store(&name, 2 * slot(1, len), len, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let a = w.put("a", &pattern(1, len)).unwrap();
    w.add_reference("a").unwrap();
    r.acknowledge(a).unwrap();
    w.put("b", &pattern(2, len)).unwrap();
    assert!(
        w.put("c", &pattern(3, len)).is_err(),
        "one acknowledgement of two is not enough"
    );
    r.acknowledge(a).unwrap();
    w.put("c", &pattern(3, len)).unwrap();
    assert_stale(r.acknowledge(a), a);
}

#[test]
fn free_unused_frees_everything_all_readers_are_done_with_around_the_rest() {
    let name = Name::new("freeunused");
    let mut w = store(&name, MIB, 4 * KIB, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let hs: Vec<_> = (0..5)
        .map(|i| w.put(&format!("k{i}"), b"x").unwrap())
        .collect();
    for h in &hs[..2] {
        r.acknowledge(*h).unwrap();
    }
    r.acknowledge(hs[3]).unwrap();
    assert_eq!(w.free_unused(), 3, "k2, unread, stays; k3 goes around it");
    assert_eq!(w.stats().objects, 2);
    assert_eq!(w.stats().evictions, 3);
    assert!(w.is_cached("k2") && w.is_cached("k4"));
}

#[test]
fn stale_handles_are_rejected_never_answered_with_other_bytes() {
    let name = Name::new("stale");
    let len = 4 * KIB;
    let mut w = store(&name, 2 * slot(1, len), len, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let a = w.put("a", &pattern(1, len)).unwrap();
    r.acknowledge(a).unwrap();
    w.put("b", &pattern(2, len)).unwrap();
    // Reclaims `a` and reuses its slot for `c`.
    let c = w.put("c", &pattern(3, len)).unwrap();
    assert_eq!(c.address, a.address, "the slot was reused");
    assert_stale(r.get(a), a);
    assert_stale(r.get_copy(a), a);
    // Wrong id at a live address.
    let wrong = ObjectHandle {
        monotonic_id: c.monotonic_id + 7,
        ..c
    };
    assert_stale(r.get(wrong), wrong);
    let zero = ObjectHandle {
        monotonic_id: 0,
        ..c
    };
    assert_stale(r.get(zero), zero);
    // Out of range, misaligned, and the far end of u64.
    for address in [
        2 * slot(1, len) as u64,
        1 << 40,
        c.address + 8,
        u64::MAX - 63,
        u64::MAX,
    ] {
        let h = ObjectHandle { address, ..c };
        assert_stale(r.get(h), h);
        assert_stale(r.get_copy(h), h);
    }
    // Right address and id, wrong epoch.
    let other_epoch = ObjectHandle {
        epoch: c.epoch ^ 1,
        ..c
    };
    assert_stale(r.get(other_epoch), other_epoch);
    assert_eq!(&*r.get(c).unwrap(), &pattern(3, len)[..]);
}

#[test]
fn handles_from_before_a_hard_clear_are_stale() {
    let name = Name::new("clear");
    let mut w = store(&name, MIB, 4 * KIB, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let a = w.put("a", b"before").unwrap();
    w.clear_hard();
    assert!(!w.is_cached("a"));
    assert_eq!(w.stats().objects, 0, "unread objects are dropped by clear");
    assert_stale(r.get(a), a);
    let a2 = w.put("a", b"after").unwrap();
    assert_ne!(a2.epoch, a.epoch, "a hard clear starts a new epoch");
    assert_ne!(a2.monotonic_id, a.monotonic_id, "ids are never reused");
    assert_eq!(&*r.get(a2).unwrap(), b"after");
}

#[test]
fn clear_waits_for_live_guards_before_reusing_their_slots() {
    let name = Name::new("clearguard");
    let len = 4 * KIB;
    let mut w = store(&name, 2 * slot(1, len), len, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let a = w.put("a", &pattern(1, len)).unwrap();
    let g = r.get(a).unwrap();
    w.clear();
    w.put("b", &pattern(2, len)).unwrap();
    match w.put("c", &pattern(3, len)).unwrap_err() {
        Error::Full {
            blocker: Some(b), ..
        } => {
            assert_eq!(b.key, None);
            assert_eq!(b.held_by, vec![0]);
        }
        e => panic!("{e:?}"),
    }
    assert_eq!(&*g, &pattern(1, len)[..], "the guard's bytes are untouched");
    drop(g);
    w.put("c", &pattern(3, len)).unwrap();
}

#[test]
fn handle_of_another_segment_is_stale_even_at_a_live_address_and_id() {
    let n1 = Name::new("seg1");
    let n2 = Name::new("seg2");
    let mut w1 = store(&n1, MIB, 4 * KIB, 1);
    let mut w2 = store(&n2, MIB, 4 * KIB, 1);
    let h1 = w1.put("k", b"one").unwrap();
    let h2 = w2.put("k", b"two").unwrap();
    assert_eq!((h1.address, h1.monotonic_id), (h2.address, h2.monotonic_id));
    let r2 = StoreReader::attach(&w2.handle()).unwrap();
    assert_stale(r2.get(h1), h1);
    assert_eq!(&*r2.get(h2).unwrap(), b"two");
}

#[test]
fn a_guard_keeps_its_slot_even_after_the_read_is_acknowledged() {
    let name = Name::new("guardholds");
    let len = 4 * KIB;
    let mut w = store(&name, 2 * slot(1, len), len, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let a = w.put("a", &pattern(1, len)).unwrap();
    let g = r.get(a).unwrap();
    r.acknowledge(a).unwrap(); // the read is counted; only the guard holds it now
    w.put("b", &pattern(2, len)).unwrap();
    match w.put("c", &pattern(3, len)).unwrap_err() {
        Error::Full {
            blocker: Some(b), ..
        } => {
            assert!(b.unread_by.is_empty());
            assert_eq!(b.held_by, vec![0]);
            assert!(Error::Full {
                requested: 1,
                free: 0,
                capacity: 1,
                blocker: Some(b)
            }
            .to_string()
            .contains("held by a guard"));
        }
        e => panic!("{e:?}"),
    }
    assert_eq!(&*g, &pattern(1, len)[..]);
    drop(g);
    w.put("c", &pattern(3, len)).unwrap();
}

#[test]
fn two_guards_of_one_object_count_two_reads_and_hold_until_both_drop() {
    let name = Name::new("twoguards");
    let len = 4 * KIB;
    let mut w = store(&name, 2 * slot(1, len), len, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let a = w.put("a", &pattern(1, len)).unwrap();
    w.get_cached("a").unwrap();
    let g1 = r.get(a).unwrap();
    let g2 = r.get(a).unwrap();
    drop(g1);
    w.put("b", &pattern(2, len)).unwrap();
    assert!(w.put("c", &pattern(3, len)).is_err(), "g2 still reads a");
    drop(g2);
    w.put("c", &pattern(3, len)).unwrap();
}

#[test]
fn a_reader_holds_a_hundred_thousand_guards_and_gives_every_one_back() {
    let name = Name::new("manyguards");
    let n_objects = 1000;
    let mut w = store(&name, n_objects * slot(1, 64) + 4 * slot(1, 64), 64, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let hs: Vec<_> = (0..n_objects)
        .map(|i| w.put(&format!("k{i}"), &pattern(i as u64, 64)).unwrap())
        .collect();
    // 100 guards on each of 1,000 objects, all alive at once.
    let guards: Vec<_> = (0..100_000)
        .map(|i| r.get(hs[i % n_objects]).unwrap())
        .collect();
    for (i, g) in guards.iter().enumerate().step_by(997) {
        assert_eq!(&g[..], &pattern((i % n_objects) as u64, 64)[..]);
    }
    let snap = pinshm::inspect::inspect(&name).unwrap();
    assert_eq!(snap.readers[0].guards, 100_000);
    // Every object is held: nothing can go.
    for _ in 0..3 {
        w.free_unused();
    }
    assert_eq!(w.stats().objects, n_objects as u64);
    drop(guards);
    assert_eq!(
        pinshm::inspect::inspect(&name).unwrap().readers[0].guards,
        0
    );
    assert_eq!(w.free_unused(), n_objects);
}

#[test]
fn a_slot_reused_during_a_copy_gives_stale_never_mixed_bytes() {
    // The reader acknowledges every object first, so its copies are not
    // counted and the writer may reuse the slot under them.
    let name = Name::new("torn");
    let len = 2 * MIB;
    let mut w = store(&name, 2 * slot(1, len), len, 1);
    let sh = w.handle();
    let first = w.put("k0", &vec![0u8; len]).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel::<ObjectHandle>();
    let reader = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let r = StoreReader::attach(&sh).unwrap();
            let (mut whole, mut stale) = (0u64, 0u64);
            // Copy the older of the two newest objects: the next to be reused.
            let (mut older, mut newest) = (first, first);
            let t0 = std::time::Instant::now();
            while t0.elapsed().as_secs() < 30 && (stale < 20 || whole < 20) {
                while let Ok(h) = rx.try_recv() {
                    let _ = r.acknowledge(h);
                    (older, newest) = (newest, h);
                }
                match r.get_copy(older) {
                    Ok(v) => {
                        // Object i is filled with byte i % 256: one value throughout.
                        assert!(v.iter().all(|&b| b == v[0]), "mixed bytes in a copy");
                        whole += 1;
                    }
                    Err(Error::Stale { .. }) => stale += 1,
                    Err(e) => panic!("{e}"),
                }
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            (whole, stale)
        })
    };
    tx.send(first).unwrap();
    let mut i = 1u64;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        match w.put(&format!("k{i}"), &vec![i as u8; len]) {
            Ok(h) => {
                if tx.send(h).is_err() {
                    break;
                }
                i += 1;
            }
            Err(Error::Full { .. }) => std::thread::yield_now(),
            Err(e) => panic!("{e}"),
        }
    }
    let (whole, stale) = reader.join().unwrap();
    assert!(stale > 0, "the race was never hit ({whole} whole copies)");
    assert!(whole > 0);
}

/// The 64 bytes of a slot header for `h`, as a payload can spell them
/// from the handle alone: its id, size and kind, and the tag's unkeyed mix
/// of them with the address and the epoch (what layout v5 stored).
fn forged_header(h: ObjectHandle, size: u64, slot_len: u64) -> Vec<u8> {
    let tag = layout::slot_tag(h.monotonic_id, h.address, h.epoch, size, 0);
    let mut v = Vec::with_capacity(64);
    for w in [h.monotonic_id, tag, size, slot_len] {
        v.extend_from_slice(&w.to_le_bytes());
    }
    v.extend_from_slice(&1u32.to_le_bytes()); // refs
    v.extend_from_slice(&0u32.to_le_bytes()); // kind: raw
    v.resize(64, 0);
    v
}

#[test]
fn a_newer_payload_spelling_the_old_header_never_passes_for_the_old_object() {
    // Objects of mixed sizes: p, then a at its end, then
    // f filling the ring but for a tail too short for b. Once p and a are read, b (as long as both) wraps
    // to 0 and its payload covers a's old header, where it spells a's id,
    // size, kind, slot length and unkeyed tag. A stale handle of a must
    // still be refused, never answered with b's bytes.
    let name = Name::new("forged");
    let capacity = 64 * KIB;
    let mut w = store(&name, capacity, capacity / 2, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let p = w.put("p", &pattern(1, 64)).unwrap();
    let a = w.put("a", &pattern(2, 256)).unwrap();
    assert_eq!(a.address, p.address + slot(1, 64) as u64, "a follows p");
    let used = slot(1, 64) + slot(1, 256);
    for (i, len) in [capacity / 2, capacity / 2 - used - 2 * slot(1, 0) - 64]
        .into_iter()
        .enumerate()
    {
        w.put(&format!("f{i}"), &pattern(3 + i as u64, len))
            .unwrap();
    }
    r.acknowledge(p).unwrap();
    assert_eq!(r.get_copy(a).unwrap(), pattern(2, 256));
    // b's slot is p's and a's; its payload starts one prefix in.
    let b_len = used - slot(1, 0);
    let off = (a.address - p.address) as usize - slot(1, 0);
    let mut bytes = pattern(4, b_len);
    bytes[off..off + 64].copy_from_slice(&forged_header(a, 256, slot(1, 256) as u64));
    let b = w.put("b", &bytes).unwrap();
    assert_eq!(b.address, p.address, "b took p's and a's place");
    assert_stale(r.get_copy(a), a);
    assert_stale(r.get(a), a);
    assert_stale(r.validate(a), a);
    assert_eq!(r.get_copy(b).unwrap(), bytes, "b itself reads whole");
}

#[test]
fn reader_slots_are_limited_and_freed_on_detach() {
    let name = Name::new("slots");
    let w = store(&name, MIB, 4 * KIB, 2);
    let sh = w.handle();
    let r0 = StoreReader::attach(&sh).unwrap();
    let r1 = StoreReader::attach(&sh).unwrap();
    assert_eq!((r0.index(), r1.index()), (0, 1));
    assert!(matches!(
        StoreReader::attach(&sh),
        Err(Error::NoReaderSlot { n_readers: 2 })
    ));
    assert!(matches!(
        StoreReader::attach_as(&sh, 1),
        Err(Error::ReaderSlotTaken { index: 1, .. })
    ));
    assert!(matches!(
        StoreReader::attach_as(&sh, 2),
        Err(Error::ReaderIndexOutOfRange { .. })
    ));
    drop(r1);
    let again = StoreReader::attach_as(&sh, 1).unwrap();
    assert_eq!(again.index(), 1);
}

#[test]
fn a_detached_reader_stops_blocking_and_its_successor_inherits_no_counts() {
    let name = Name::new("detach");
    let len = 4 * KIB;
    let mut w = store(&name, 3 * slot(2, len), len, 2);
    let sh = w.handle();
    let r0 = StoreReader::attach_as(&sh, 0).unwrap();
    let r1 = StoreReader::attach_as(&sh, 1).unwrap();
    let put = |w: &mut ObjectStore, k: &str| w.put(k, &pattern(k.len() as u64, len));
    let a = put(&mut w, "a").unwrap();
    r0.acknowledge(a).unwrap();
    drop(r1); // leaves without reading a
    let b = put(&mut w, "b").unwrap();
    let c = put(&mut w, "c").unwrap();
    r0.acknowledge(b).unwrap();
    r0.acknowledge(c).unwrap();
    let d = put(&mut w, "d").unwrap(); // a goes: reader 1 left
    assert!(!w.is_cached("a"));
    // A new reader 1 owes nothing for objects put before it came...
    let r1 = StoreReader::attach_as(&sh, 1).unwrap();
    let e = put(&mut w, "e").unwrap(); // b goes: only reader 0 counts for it
    assert!(!w.is_cached("b"));
    r0.acknowledge(d).unwrap();
    r0.acknowledge(e).unwrap();
    put(&mut w, "f").unwrap(); // c goes
    put(&mut w, "g").unwrap(); // d goes
                               // ...but does for objects put after it came.
    match put(&mut w, "h").unwrap_err() {
        Error::Full {
            blocker: Some(bl), ..
        } => {
            assert_eq!(bl.monotonic_id, e.monotonic_id);
            assert_eq!(bl.unread_by, vec![1]);
        }
        other => panic!("{other:?}"),
    }
    drop(r1.get(e).unwrap());
    put(&mut w, "h").unwrap();
}

#[test]
fn read_only_views_show_the_same_bytes_through_another_mapping() {
    use pinshm::store::ReaderOptions;
    let name = Name::new("roviews");
    let mut w = store(&name, MIB, 4 * KIB, 2);
    let h = w.put("k", &pattern(3, 4 * KIB)).unwrap();
    let plain = StoreReader::attach_as(&w.handle(), 0).unwrap();
    let ro = StoreReader::attach_with(
        &w.handle(),
        ReaderOptions::default().index(1).read_only_views(true),
    )
    .unwrap();
    let (a, b) = (plain.get(h).unwrap(), ro.get(h).unwrap());
    assert_eq!(&a[..], &b[..]);
    assert_ne!(a.as_ptr(), b.as_ptr(), "a view of the read-only mapping");
    drop((a, b));
    // The read counted as any other: both readers are done with it.
    assert_eq!(w.free_unused(), 1);
}

#[test]
fn a_read_only_view_of_an_empty_object_at_the_end_of_the_ring_is_valid() {
    use pinshm::store::ReaderOptions;
    let name = Name::new("roviewsend");
    // One object fills the ring but for one slot prefix: the empty object
    // put next lies last, its (empty) payload at the end of the segment.
    let len = 4 * KIB;
    let prefix = layout::slot_prefix_len(1);
    let capacity = slot(1, len) + prefix;
    let mut w = store(&name, capacity, len, 1);
    let ro = StoreReader::attach_with(&w.handle(), ReaderOptions::default().read_only_views(true))
        .unwrap();
    let a = w.put("a", &pattern(1, len)).unwrap();
    let e = w.put("e", b"").unwrap();
    assert_eq!(
        e.address as usize,
        capacity - prefix,
        "the empty object lies last"
    );
    assert_eq!(&ro.get(a).unwrap()[..], &pattern(1, len)[..]);
    let g = ro.get(e).unwrap();
    assert!(g.is_empty());
    assert_eq!(&g[..], b"");
    drop(g);
    assert_eq!(ro.get_copy(e).unwrap(), b"");
    assert_eq!(w.free_unused(), 2);
}

#[test]
fn a_put_walks_past_many_objects_found_held_for_the_first_time() {
    let name = Name::new("manyheld");
    let len = 1000;
    let mut w = store(&name, 40 * slot(1, len), len, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let hs: Vec<_> = (0..40)
        .map(|i| w.put(&format!("k{i}"), &pattern(i, len)).unwrap())
        .collect();
    // Every object is read; the 20 oldest stay held (owed nothing: only
    // their holds keep them, which the walk does not know of yet).
    for &h in &hs {
        r.acknowledge(h).unwrap();
    }
    let held: Vec<_> = hs[..20].iter().map(|&h| r.get(h).unwrap()).collect();
    // The walk starts at the oldest: 20 held objects in a row before room.
    let h = w.put("new", &pattern(99, len)).unwrap();
    assert_eq!(h.address, hs[20].address);
    for (i, g) in held.iter().enumerate() {
        assert_eq!(&g[..], &pattern(i as u64, len)[..]);
    }
}
