//! Cache stores, the shared key index and leases, in real processes: readers
//! that look keys up without the writer while it evicts and reuses slots
//! (never a wrong object), leases that outlive laps of puts, a killed
//! leaseholder's leases ignored, and unread objects reclaimed. The readers
//! are this test binary re-executed; they take lines on stdin and answer
//! on stdout.

mod common;

use std::io::{BufRead, Write};

use common::{checksum, pattern, Name, Peer, Rng};
use pinshm::{codec::DType, store::StoreHandle, Error, ObjectStore, StoreConfig, StoreReader};

const KIB: usize = 1 << 10;

/// A cache of `slots` objects of `len` bytes for `n_readers`, with a key
/// index for twice as many keys.
fn cache(name: &Name, slots: usize, len: usize, n_readers: u32) -> ObjectStore {
    ObjectStore::create(
        StoreConfig::new(
            slots * StoreConfig::slot_len(n_readers, len),
            len,
            n_readers,
        )
        .name(&**name)
        .cache(true)
        .key_index(2 * slots),
    )
    .unwrap()
}

/// The bytes of key `k{i}`: the key decides them, so any reader can check
/// that what it found under a key is that key's object.
fn bytes_of(i: u64, len: usize) -> Vec<u8> {
    pattern(i, len)
}

#[test]
fn a_reader_finds_stored_keys_without_the_writer_and_misses_evicted_ones() {
    let name = Name::new("lookup");
    let len = 4 * KIB;
    let mut w = cache(&name, 8, len, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let mut handles = Vec::new();
    for i in 0..20u64 {
        handles.push(w.put(&format!("k{i}"), &bytes_of(i, len)).unwrap());
    }
    // The inspector explains a cache's evicted object by the cache's own
    // reason, not a store's reads.
    let snap = pinshm::inspect::inspect(&name).unwrap();
    assert!(snap.cache, "{snap}");
    assert!(snap.to_string().contains("kind      cache"), "{snap}");
    let why = snap.explain(handles[0].address, handles[0].monotonic_id);
    assert!(why.starts_with("evicted: the cache reclaimed it"), "{why}");
    let mut found = 0;
    for i in 0..20u64 {
        let key = format!("k{i}");
        let got = r.lookup(&key).unwrap();
        assert_eq!(got, w.lookup(&key), "reader and writer agree on {key}");
        if let Some(h) = got {
            assert_eq!(&*r.get(h).unwrap(), &bytes_of(i, len)[..]);
            let g = r.get_key(&key).unwrap().expect("found, so held");
            assert_eq!(&*g, &bytes_of(i, len)[..]);
            found += 1;
        }
    }
    assert!((1..20).contains(&found), "some evicted, some kept: {found}");
    assert_eq!(r.lookup("never-stored").unwrap(), None);
    assert_eq!(w.stats().indexed, found as u64);
    w.clear();
    assert!((0..20).all(|i| r.lookup(&format!("k{i}")).unwrap().is_none()));
}

#[test]
fn a_cache_reclaims_objects_nobody_read_where_a_store_would_be_full() {
    let len = 4 * KIB;
    for cache_mode in [true, false] {
        let name = Name::new("unread");
        let mut w = ObjectStore::create(
            StoreConfig::new(8 * StoreConfig::slot_len(1, len), len, 1)
                .name(&*name)
                .cache(cache_mode),
        )
        .unwrap();
        // Attached, never reading: a store waits for it, a cache does not.
        let _r = StoreReader::attach(&w.handle()).unwrap();
        let outcome =
            (0..80u64).try_for_each(|i| w.put(&format!("k{i}"), &bytes_of(i, len)).map(|_| ()));
        match (cache_mode, outcome) {
            (true, Ok(())) => assert!(w.stats().evictions >= 72),
            (false, Err(Error::Full { .. })) => {}
            (mode, other) => panic!("cache {mode}: {other:?}"),
        }
    }
}

#[test]
fn get_cached_in_a_cache_counts_a_hit_and_owes_no_read() {
    let name = Name::new("cachehit");
    let len = 4 * KIB;
    let mut w = cache(&name, 8, len, 1);
    let _r = StoreReader::attach(&w.handle()).unwrap();
    w.put("hot", &bytes_of(0, len)).unwrap();
    // Hit on every put: second chance keeps it, and it owes no read, so
    // the unread stream behind it never fills the ring.
    for i in 1..80u64 {
        assert!(w.get_cached("hot").is_some());
        w.put(&format!("k{i}"), &bytes_of(i, len)).unwrap();
    }
    assert!(w.is_cached("hot"));
    assert_eq!(w.stats().hits, 79);
}

#[test]
fn lookups_racing_a_writer_that_evicts_and_reuses_slots_never_return_a_wrong_object() {
    let name = Name::new("lookuprace");
    let len = 2 * KIB;
    // A ring of 16 objects and a stream of 6000 of random sizes: every put
    // evicts, and slots are reused at other addresses and sizes all along.
    let mut w = cache(&name, 16, len, 2);
    let mut peers = [
        Peer::spawn("lookups", &w.handle()),
        Peer::spawn("lookups", &w.handle()),
    ];
    let mut rng = Rng(0xcafe);
    let mut i = 0u64;
    let mut put = |w: &mut ObjectStore, i: u64| {
        let size = 1 + rng.below(len as u64) as usize;
        w.put(&format!("k{i}"), &bytes_of(i, size)).unwrap();
    };
    // Each reader is told how far the writer has come, every 50 puts, and
    // looks up keys from the last 40 (about half of them evicted by then)...
    for _ in 0..120 {
        for _ in 0..50 {
            put(&mut w, i);
            i += 1;
        }
        for p in peers.iter_mut() {
            p.send(&format!("upto {}", i - 1));
        }
    }
    // ...while the writer goes on evicting and reusing their slots until
    // both have checked every byte of every object they found.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let answers = std::thread::spawn({
        let done = done.clone();
        move || {
            let a: Vec<String> = peers.into_iter().map(Peer::finish).collect();
            done.store(true, std::sync::atomic::Ordering::Release);
            a
        }
    });
    // The last 40 keys come back as they go (a key is free again once its
    // object is evicted), between fillers, so lookups of them keep meeting
    // both outcomes at any pace.
    let mut n = 0u64;
    while !done.load(std::sync::atomic::Ordering::Acquire) {
        let k = i - 40 + n % 40;
        if !w.is_cached(&format!("k{k}")) {
            put(&mut w, k);
        }
        let size = 1 + (n * 7919) as usize % len;
        w.put(&format!("filler{n}"), &pattern(u64::MAX - n, size))
            .unwrap();
        n += 1;
    }
    for a in answers.join().unwrap() {
        let f: Vec<u64> = a.split(' ').skip(1).map(|x| x.parse().unwrap()).collect();
        assert!(f[0] > 0 && f[1] > 0, "both hits and misses: {a}");
    }
}

#[test]
fn a_lease_keeps_its_unread_object_through_ten_laps_of_puts() {
    let name = Name::new("lease");
    let len = 8 * KIB;
    let slots = 16;
    let mut w = cache(&name, slots, len, 1);
    w.put("leased", &bytes_of(7, len)).unwrap();
    let mut peer = Peer::spawn("lease", &w.handle());
    assert_eq!(peer.ask("lease leased"), "leased");
    for i in 0..10 * slots as u64 {
        w.put(&format!("k{i}"), &bytes_of(i, len))
            .unwrap_or_else(|e| panic!("put {i} around a lease: {e}"));
    }
    assert!(w.is_cached("leased"), "a leased object is never reclaimed");
    // The leaseholder reads it now: the bytes are the ones put.
    assert_eq!(
        peer.ask("read"),
        format!("read {}", checksum(&bytes_of(7, len)))
    );
    assert_eq!(peer.ask("release"), "released");
    for i in 0..2 * slots as u64 {
        w.put(&format!("after{i}"), &bytes_of(i, len)).unwrap();
    }
    assert!(!w.is_cached("leased"), "released, it goes like any other");
    peer.finish();
}

#[test]
fn a_killed_leaseholders_leases_are_ignored() {
    let name = Name::new("leasekill");
    let len = 4 * KIB;
    let slots = 16;
    let mut w = cache(&name, slots, len, 1);
    for i in 0..slots as u64 {
        w.put(&format!("k{i}"), &bytes_of(i, len)).unwrap();
    }
    // Every object of the ring leased: while the holder lives, nothing fits.
    let mut peer = Peer::spawn("leaseall", &w.handle());
    assert_eq!(peer.ask(&slots.to_string()), format!("leased {slots}"));
    assert_eq!(
        pinshm::inspect::inspect(&name).unwrap().readers[0].guards,
        slots
    );
    assert!(matches!(
        w.put("blocked", &bytes_of(0, len)),
        Err(Error::Full { .. })
    ));
    peer.kill();
    for i in 0..4 * slots as u64 {
        w.put(&format!("after{i}"), &bytes_of(i, len))
            .unwrap_or_else(|e| panic!("put {i} after the leaseholder died: {e}"));
    }
    assert!(w.stats().dead_readers_reaped >= 1);
    assert!((0..slots).all(|i| !w.is_cached(&format!("k{i}"))));
}

#[test]
fn a_readers_hit_by_key_keeps_an_object_one_more_lap() {
    let len = 4 * KIB;
    let slots = 8;
    for hit in [true, false] {
        let name = Name::new("touch");
        let mut w = cache(&name, slots, len, 1);
        let r = StoreReader::attach(&w.handle()).unwrap();
        w.put("a", &bytes_of(0, len)).unwrap();
        for i in 1..slots as u64 {
            w.put(&format!("k{i}"), &bytes_of(i, len)).unwrap();
        }
        if hit {
            drop(r.get_key("a").unwrap().expect("stored"));
        }
        // The next put needs the oldest slot: a's.
        w.put("next", &bytes_of(99, len)).unwrap();
        assert_eq!(w.is_cached("a"), hit, "hit by a reader: {hit}");
    }
}

/// vLLM-style code looks a key up, then reads the object by its handle
/// (`lookup`, then `get`). That hit earns the second chance a `get_key`
/// earns: the reader, another process, finds `a` that way; the sweep the
/// next put makes keeps `a` for a lap and evicts `b`, the untouched
/// object after it. Without the lookup, `a` goes first.
#[test]
fn an_object_found_by_lookup_then_read_by_handle_survives_a_sweep_that_evicts_an_untouched_one() {
    let len = 4 * KIB;
    let slots = 8;
    for looked_up in [true, false] {
        let name = Name::new("lookuptouch");
        let mut w = cache(&name, slots, len, 1);
        let mut peer = Peer::spawn("lookupget", &w.handle());
        w.put("a", &bytes_of(0, len)).unwrap();
        w.put("b", &bytes_of(1, len)).unwrap();
        for i in 2..slots as u64 {
            w.put(&format!("k{i}"), &bytes_of(i, len)).unwrap();
        }
        if looked_up {
            let want = format!("read {}", checksum(&bytes_of(0, len)));
            assert_eq!(peer.ask("a"), want);
        }
        // The ring is full: the next put needs the oldest slot, a's.
        w.put("next", &bytes_of(99, len)).unwrap();
        assert_eq!(w.is_cached("a"), looked_up, "found by lookup: {looked_up}");
        assert_eq!(
            w.is_cached("b"),
            !looked_up,
            "untouched: evicted in a's stead"
        );
        assert!(w.is_cached("k2"));
        peer.finish();
    }
}

/// The index entry of a key that names a slot holding another object
/// (what an entry read just before the writer reused the slot names): the
/// lookup is a miss, and the object it found gets no second chance. Here
/// a's entry is rewritten to name b's slot, id and address (b's tag then
/// checks out; only b's key fingerprint tells it is not a's).
#[test]
fn a_lookup_that_meets_another_keys_object_is_a_miss_and_keeps_nothing() {
    let len = 4 * KIB;
    let slots = 8;
    let name = Name::new("lookupother");
    let mut w = cache(&name, slots, len, 1);
    let mut peer = Peer::spawn("lookupget", &w.handle());
    let a = w.put("a", &bytes_of(0, len)).unwrap();
    let b = w.put("b", &bytes_of(1, len)).unwrap();
    for i in 2..slots as u64 {
        w.put(&format!("k{i}"), &bytes_of(i, len)).unwrap();
    }
    let u64_at = |off: u64| u64::from_le_bytes(common::peek(&name, off, 8).try_into().unwrap());
    let entries = u64_at(160); // SegmentHeader::index_entries
    let table = pinshm::testing::index_offset(1, (slots * StoreConfig::slot_len(1, len)) as u64);
    let entry = (0..entries)
        .map(|i| table + 32 * i)
        .find(|&e| u64_at(e + 16) == a.monotonic_id)
        .expect("a is indexed");
    let mut forged = b.monotonic_id.to_le_bytes().to_vec();
    forged.extend_from_slice(&b.address.to_le_bytes());
    common::scribble(&name, entry + 16, &forged);
    assert_eq!(peer.ask("a"), "miss", "a's key never gives b's object");
    // The ring is full: a's slot goes, then b's, untouched.
    w.put("next", &bytes_of(98, len)).unwrap();
    w.put("next2", &bytes_of(99, len)).unwrap();
    assert!(
        !w.is_cached("b"),
        "b got a second chance from a lookup of a"
    );
    assert!(w.is_cached("k2"));
    peer.finish();
}

#[test]
fn a_lookup_in_a_store_without_a_key_index_says_so() {
    let name = Name::new("noindex");
    let mut w = ObjectStore::create(StoreConfig::new(1 << 20, 1 << 16, 1).name(&*name)).unwrap();
    w.put("k", b"v").unwrap();
    let r = StoreReader::attach(&w.handle()).unwrap();
    match r.lookup("k") {
        Err(e @ Error::NoKeyIndex { .. }) => assert!(e.to_string().contains("key_index")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_cache_with_aggregate_reads_is_refused() {
    let cfg = StoreConfig::new(1 << 20, 1 << 16, 1)
        .cache(true)
        .aggregate_reads(true);
    assert!(matches!(
        ObjectStore::create(cfg),
        Err(Error::InvalidConfig(_))
    ));
}

/// In aggregate mode a reader's `get_key` acknowledges a read that any
/// reader's read covers: reader 0's two hits would free an object that
/// reader 1 still owes a read of. Refused at create, saying what to use.
#[test]
fn a_key_index_with_aggregate_reads_is_refused_and_says_what_to_use() {
    let name = Name::new("aggindex");
    let cfg = StoreConfig::new(1 << 20, 1 << 16, 2)
        .name(&*name)
        .key_index(64)
        .aggregate_reads(true);
    match ObjectStore::create(cfg) {
        Err(e @ Error::InvalidConfig(_)) => {
            let msg = e.to_string();
            assert!(msg.contains("key_index with aggregate_reads"), "{msg}");
            assert!(msg.contains("cache(true)"), "says what to use: {msg}");
        }
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("a key index with aggregate reads was created"),
    }
    assert!(!name.exists(), "nothing left in /dev/shm");
    // Each alone is fine.
    for cfg in [
        StoreConfig::new(1 << 20, 1 << 16, 2).key_index(64),
        StoreConfig::new(1 << 20, 1 << 16, 2).aggregate_reads(true),
    ] {
        ObjectStore::create(cfg.name(&*name)).unwrap();
    }
}

#[test]
fn a_reservation_is_read_once_published_and_reclaimed_if_dropped() {
    let name = Name::new("reserve");
    let len = 4 * KIB;
    let mut w = cache(&name, 4, len + 256, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let mut res = w.reserve_tensor("t", DType::U8, &[len as u64]).unwrap();
    assert_eq!(res.len(), len);
    res.bytes_mut().copy_from_slice(&bytes_of(3, len));
    assert!(!w.is_cached("t"), "not visible before it is published");
    let h = w.publish(res).unwrap();
    assert_eq!(r.get_tensor(h).unwrap().bytes(), &bytes_of(3, len)[..]);
    assert_eq!(r.lookup("t").unwrap(), Some(h));
    // Dropped unpublished: never visible, and its slot comes back.
    let dropped = w.reserve_tensor("gone", DType::U8, &[len as u64]).unwrap();
    drop(dropped);
    for i in 0..8u64 {
        w.put(&format!("k{i}"), &bytes_of(i, len)).unwrap();
    }
    assert!(!w.is_cached("gone"));
    assert_eq!(r.lookup("gone").unwrap(), None);
    w.put("gone", b"reusable key").unwrap();
}

#[test]
fn a_byte_reservation_is_a_put_of_its_bytes_once_published() {
    let name = Name::new("reservebytes");
    let len = 4 * KIB;
    let mut w = cache(&name, 4, len + 256, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let mut res = w.reserve_bytes("b", len).unwrap();
    assert_eq!(res.len(), len, "no header: every byte is the caller's");
    res.bytes_mut().copy_from_slice(&bytes_of(5, len));
    assert!(w.is_pending("b") && !w.is_cached("b"));
    assert_eq!(
        r.lookup("b").unwrap(),
        None,
        "nobody sees it before it is published"
    );
    let h = w.publish(res).unwrap();
    // Read as a put's: the whole object is the bytes, a tensor it is not.
    assert_eq!(r.get_copy(h).unwrap(), bytes_of(5, len));
    assert!(r.get_tensor(h).is_err());
    assert_eq!(w.get_cached("b"), Some(h));
    // An empty one is an empty object; an aborted one frees its key.
    let e = w.reserve_bytes("e", 0).unwrap();
    assert_eq!(r.get_copy(w.publish(e).unwrap()).unwrap(), b"");
    let gone = w.reserve_bytes("g", len).unwrap();
    w.abort(gone);
    assert_eq!(
        r.get_copy(w.put("g", b"put after").unwrap()).unwrap(),
        b"put after"
    );
    assert!(matches!(
        w.reserve_bytes("big", 1 << 20),
        Err(Error::TooLarge { .. })
    ));
}

#[test]
fn an_aborted_reservation_frees_its_key_at_once() {
    let name = Name::new("abortkey");
    let len = 4 * KIB;
    let mut w = cache(&name, 4, len + 256, 1);
    let r = StoreReader::attach(&w.handle()).unwrap();
    // Dropped unpublished: the key is free at once, the slot in turn.
    let res = w.reserve_tensor("t", DType::U8, &[len as u64]).unwrap();
    assert!(w.is_pending("t") && !w.is_cached("t"));
    assert!(matches!(
        w.put("t", b"x"),
        Err(Error::DuplicateKey { pending: true, .. })
    ));
    drop(res);
    assert!(!w.is_pending("t"));
    let h = w.put("t", b"saved again").unwrap();
    assert_eq!(r.get_copy(h).unwrap(), b"saved again");
    assert_eq!(r.lookup("t").unwrap(), Some(h));
    // Aborted: the key and the slot are free at once.
    let objects = w.stats().objects;
    let res = w.reserve_tensor("u", DType::U8, &[len as u64]).unwrap();
    assert_eq!(w.stats().objects, objects + 1);
    w.abort(res);
    assert_eq!(w.stats().objects, objects, "the aborted slot went at once");
    assert!(!w.is_pending("u"));
    w.put("u", b"u again").unwrap();
    // Abandoned while still open (a binding's view outlives the abort): the
    // key is free at once; the bytes stay the caller's, seen by nobody.
    let mut res = w.reserve_tensor("v", DType::U8, &[len as u64]).unwrap();
    res.abandon();
    assert!(!w.is_pending("v"));
    let hv = w.put("v", b"v again").unwrap();
    res.bytes_mut().fill(7);
    assert!(matches!(w.publish(res), Err(Error::PutNotPending { .. })));
    assert_eq!(r.lookup("v").unwrap(), Some(hv));
    assert_eq!(r.get_copy(hv).unwrap(), b"v again");
}

#[test]
fn an_index_size_the_segment_cannot_hold_is_refused_at_attach() {
    let name = Name::new("badindex");
    let w = cache(&name, 4, 4 * KIB, 1);
    let sh = w.handle();
    // index_entries (offset 160): not a power of two, then far too large.
    for bad in [3u64, 1 << 20] {
        common::scribble(&name, 160, &bad.to_le_bytes());
        match StoreReader::attach(&sh) {
            Err(Error::BadHeader { field, .. }) => assert_eq!(field, "index_entries"),
            other => panic!("{bad}: {other:?}"),
        }
    }
}

#[test]
#[ignore = "child process entry point: its parent test runs it with --ignored"]
fn child_reader() {
    if let Ok(role) = std::env::var("PINSHM_CHILD") {
        let sh: StoreHandle =
            serde_json::from_str(&std::env::var("PINSHM_HANDLE").unwrap()).unwrap();
        child_body(&role, &sh);
    }
}

fn child_body(role: &str, sh: &StoreHandle) {
    let r = StoreReader::attach(sh).unwrap();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines().map(|l| l.unwrap());
    let answer = |s: &str| {
        println!("ANSWER {s}");
        std::io::stdout().flush().unwrap();
    };
    match role {
        "lookups" => {
            let mut rng = Rng(std::process::id() as u64);
            let (mut hits, mut misses) = (0u64, 0u64);
            for l in lines.by_ref() {
                let upto: u64 = l.strip_prefix("upto ").unwrap().parse().unwrap();
                for _ in 0..200 {
                    let i = upto.saturating_sub(rng.below(40));
                    let key = format!("k{i}");
                    // Both ways: a held get by key, and lookup-then-copy.
                    let got = if rng.below(2) == 0 {
                        r.get_key(&key).unwrap().map(|g| g.to_vec())
                    } else {
                        match r.lookup(&key).unwrap() {
                            Some(h) => match r.get_copy(h) {
                                Ok(b) => Some(b),
                                Err(Error::Stale { .. }) => None,
                                Err(e) => panic!("{e}"),
                            },
                            None => None,
                        }
                    };
                    match got {
                        Some(b) => {
                            assert_eq!(b, bytes_of(i, b.len()), "{key} gave another object");
                            hits += 1;
                        }
                        None => misses += 1,
                    }
                }
            }
            answer(&format!("lookups {hits} {misses}"));
        }
        "lease" => {
            let mut lease = None;
            for l in lines.by_ref() {
                match l.split_once(' ').map_or((l.as_str(), ""), |(a, b)| (a, b)) {
                    ("lease", key) => {
                        lease = r.lease_key(key).unwrap();
                        assert!(lease.is_some());
                        answer("leased");
                    }
                    ("read", _) => {
                        let h = lease.as_ref().unwrap().handle();
                        answer(&format!("read {}", checksum(&r.get(h).unwrap())));
                    }
                    ("release", _) => {
                        lease.take().unwrap().release();
                        answer("released");
                    }
                    (other, _) => panic!("unknown command {other}"),
                }
            }
            answer("done");
        }
        "lookupget" => {
            // vLLM-style: key to handle, then a read by handle.
            for key in lines.by_ref() {
                match r.lookup(&key).unwrap() {
                    Some(h) => answer(&format!("read {}", checksum(&r.get(h).unwrap()))),
                    None => answer("miss"),
                }
            }
            answer("done");
        }
        "leaseall" => {
            let n: u64 = lines.next().unwrap().parse().unwrap();
            let leases: Vec<_> = (0..n)
                .map(|i| r.lease_key(&format!("k{i}")).unwrap().expect("stored"))
                .collect();
            answer(&format!("leased {}", leases.len()));
            // Killed here, holding every lease.
            std::thread::sleep(std::time::Duration::from_secs(60));
        }
        other => panic!("unknown role {other}"),
    }
}
