//! Sparse segments: memory as used, and a full /dev/shm is an error from
//! the put or send that needed pages, never a SIGBUS.
//!
//! The small-/dev/shm tests re-run this binary in a private mount
//! namespace (`unshare -m`) over a 32 MiB tmpfs; where that is not allowed
//! they say so and pass without checking.

mod common;

use std::process::{Command, Stdio};

use common::{pattern, Name};
use pinshm::{
    channel::BroadcastConfig, Broadcast, BroadcastReader, Error, ObjectStore, StoreConfig,
    StoreReader,
};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Bytes of /dev/shm the file of `name` has allocated.
fn allocated(name: &str) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/dev/shm/{name}"))
        .map(|m| m.blocks() * 512)
        .unwrap_or(0)
}

/// What a sparse store allocates: the pages its objects touch, plus at
/// most one step ahead of them (`back_ahead`; 0: none), whenever it is
/// looked at (the backer thread may be anywhere in its step).
#[test]
fn a_sparse_store_costs_the_pages_its_objects_touch_plus_one_step() {
    for ahead in [0, 8 * MIB as u64] {
        let name = Name::new("sparsecost");
        let mut w = ObjectStore::create(
            StoreConfig::new(256 * MIB, 4 * MIB, 1)
                .name(&*name)
                .reserve(false)
                .prefault(false)
                .back_ahead(ahead),
        )
        .unwrap();
        let r = StoreReader::attach(&w.handle()).unwrap();
        // The header page and the backer's rounding (a 64 KiB chunk).
        let slack = MIB as u64 + ahead;
        assert!(allocated(&name) < slack, "{ahead}: {}", allocated(&name));
        for i in 0..4 {
            let h = w.put(&format!("k{i}"), &pattern(i, 4 * MIB)).unwrap();
            assert_eq!(r.get_copy(h).unwrap(), pattern(i, 4 * MIB));
            let used = allocated(&name);
            let touched = (i + 1) * 4 * MIB as u64;
            assert!(
                (touched..touched + slack).contains(&used),
                "{ahead}: {} puts of 4 MiB allocated {used} bytes",
                i + 1
            );
        }
        if ahead > 0 {
            // Once the backer has its step (it gets there: a hang guard,
            // not a timing assertion), it stops: given time to take more
            // (a backer that took everything would have taken it by then),
            // it has not.
            let want = 16 * MIB as u64 + ahead;
            let t0 = std::time::Instant::now();
            while allocated(&name) < want {
                assert!(t0.elapsed() < std::time::Duration::from_secs(60));
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            std::thread::sleep(std::time::Duration::from_millis(300));
            let used = allocated(&name);
            assert!(used < 16 * MIB as u64 + slack, "{ahead}: {used} bytes");
        }
    }
}

/// With a backer, a put into pages never written before finds them backed
/// (and mapped): it backs nothing itself. The backer is given time to get
/// its step ahead first (a put that outruns it backs its own pages, as
/// without one).
#[test]
fn puts_into_a_sparse_store_find_their_pages_backed_ahead() {
    let name = Name::new("ahead");
    let step = 8 * MIB as u64;
    let mut w = ObjectStore::create(
        StoreConfig::new(64 * MIB, 4 * MIB, 1)
            .name(&*name)
            .reserve(false)
            .prefault(false)
            .back_ahead(step),
    )
    .unwrap();
    let r = StoreReader::attach(&w.handle()).unwrap();
    let wait_for = |bytes: u64| {
        let t0 = std::time::Instant::now();
        while allocated(&name) < bytes {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(60),
                "the backer never got to {bytes} bytes: {}",
                allocated(&name)
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    };
    // 15 objects fill the ring: the first lap, then two more.
    for i in 0..45u64 {
        if i < 15 {
            // Each put of 4 MiB moves the backer's target 4 MiB further,
            // up to the end of the ring.
            wait_for((i * 4 * MIB as u64 + step).min(64 * MIB as u64));
        }
        let h = w.put(&format!("k{i}"), &pattern(i, 4 * MIB)).unwrap();
        assert_eq!(r.get_copy(h).unwrap(), pattern(i, 4 * MIB));
        assert_eq!(w.stats().backed_in_put, 0, "put {i} backed its own pages");
    }
    // Without a backer, the same puts back every page themselves.
    let name0 = Name::new("ahead0");
    let mut w0 = ObjectStore::create(
        StoreConfig::new(64 * MIB, 4 * MIB, 1)
            .name(&*name0)
            .reserve(false)
            .prefault(false)
            .back_ahead(0),
    )
    .unwrap();
    w0.put("k", &pattern(0, 4 * MIB)).unwrap();
    assert!(
        w0.stats().backed_in_put >= 4 * MIB as u64,
        "{:?}",
        w0.stats()
    );
}

#[test]
fn a_sparse_channel_costs_the_pages_its_messages_touch() {
    let name = Name::new("sparsechan");
    // vLLM's default queue: 10 slots of 24 MiB.
    let mut tx = Broadcast::create(BroadcastConfig::new(1, 10, 24 * MIB).name(&*name)).unwrap();
    let rx = BroadcastReader::attach(&tx.handle()).unwrap();
    for i in 0..100u64 {
        tx.send(&pattern(i, 200)).unwrap();
        assert_eq!(&*rx.recv().unwrap(), &pattern(i, 200)[..]);
    }
    let used = allocated(&name);
    assert!(
        used <= 2 * MIB as u64,
        "100 small messages allocated {used} bytes"
    );
}

/// Runs `role` of this binary in a mount namespace whose /dev/shm is a
/// 32 MiB tmpfs; its stdout, or `None` where that cannot be done here.
fn in_small_dev_shm(role: &str) -> Option<String> {
    in_small_dev_shm_with(role, &[])
}

/// As [`in_small_dev_shm`], with more environment for the child.
fn in_small_dev_shm_with(role: &str, env: &[(&str, &str)]) -> Option<String> {
    if !common::namespaces_allowed(&["-m"], "a mount namespace") {
        return None;
    }
    let out = Command::new("unshare")
        .args([
            "-m",
            "sh",
            "-c",
            "mount -t tmpfs -o size=32m pinshm-test /dev/shm && exec \"$0\" \"$1\" --exact --ignored --nocapture",
        ])
        .arg(std::env::current_exe().unwrap())
        .arg(role)
        .env("PINSHM_CHILD", role)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    // Exit 0: no signal (a SIGBUS would end it with 135), every check held.
    assert!(
        out.status.success(),
        "{role}: {:?}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Some(text)
}

#[test]
fn a_sparse_store_larger_than_dev_shm_fails_puts_cleanly_and_keeps_working() {
    if let Some(text) = in_small_dev_shm("child_store_on_small_shm") {
        assert!(text.contains("RESULT store ok"), "{text}");
    }
}

#[test]
fn a_sparse_channel_larger_than_dev_shm_fails_sends_cleanly_and_keeps_working() {
    if let Some(text) = in_small_dev_shm("child_channel_on_small_shm") {
        assert!(text.contains("RESULT channel ok"), "{text}");
    }
}

#[test]
#[ignore = "child process entry point: its parent test runs it with --ignored"]
fn child_store_on_small_shm() {
    if std::env::var("PINSHM_CHILD").as_deref() == Ok("child_store_on_small_shm") {
        // A 256 MiB sparse store on a 32 MiB /dev/shm.
        let mut w = ObjectStore::create(
            StoreConfig::new(256 * MIB, 4 * MIB, 1)
                .name("pinshm-test-small-store")
                .reserve(false)
                .prefault(false),
        )
        .unwrap();
        let r = StoreReader::attach(&w.handle()).unwrap();
        // A stream of 4 MiB objects, each read at once: once /dev/shm is full
        // the store carries on in what it has (a smaller cache).
        let mut nospace = 0;
        for i in 0..200u64 {
            match w.put(&format!("k{i}"), &pattern(i, 4 * MIB)) {
                Ok(h) => assert_eq!(r.get_copy(h).unwrap(), pattern(i, 4 * MIB)),
                Err(Error::NoSpace { .. }) => nospace += 1,
                Err(e) => panic!("put {i}: {e}"),
            }
        }
        assert!(w.stats().nospace_fallbacks > 0, "{:?}", w.stats());
        // Everything it has is held now: the next put cannot fit anywhere, and
        // fails with NoSpace (naming /dev/shm), not Full and not a signal.
        let mut guards = Vec::new();
        let mut err = None;
        for i in 200..300u64 {
            match w.put(&format!("k{i}"), &pattern(i, 4 * MIB)) {
                Ok(h) => guards.push(r.get(h).unwrap()),
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        let err = err.expect("a full /dev/shm stops the puts");
        assert!(matches!(err, Error::NoSpace { .. }), "{err}");
        assert!(err.to_string().contains("/dev/shm"), "{err}");
        // Space comes back: the store works again.
        drop(guards);
        let h = w.put("after", &pattern(7, 4 * MIB)).unwrap();
        assert_eq!(r.get_copy(h).unwrap(), pattern(7, 4 * MIB));
        println!("RESULT store ok ({nospace} NoSpace in the stream, then: {err})");
    }
}

#[test]
fn a_put_that_cannot_get_pages_evicts_nothing() {
    if let Some(text) = in_small_dev_shm("child_nospace_keeps_the_cache") {
        assert!(text.contains("RESULT nospace ok"), "{text}");
    }
}

/// Fills what is left of /dev/shm with a file of `name`.
fn fill_dev_shm(name: &str) {
    use std::io::Write;
    let mut f = std::fs::File::create(format!("/dev/shm/{name}")).unwrap();
    for chunk in [64 * KIB, 4 * KIB, 1] {
        let block = vec![1u8; chunk];
        while f.write_all(&block).is_ok() {}
    }
}

#[test]
#[ignore = "child process entry point: its parent test runs it with --ignored"]
fn child_nospace_keeps_the_cache() {
    if std::env::var("PINSHM_CHILD").as_deref() == Ok("child_nospace_keeps_the_cache") {
        // A 256 MiB sparse store on a 32 MiB /dev/shm, with no backer: the
        // scenario needs the pages past the high-water mark missing (a
        // backer would have taken them ahead of the writer).
        let mut w = ObjectStore::create(
            StoreConfig::new(256 * MIB, 24 * MIB, 1)
                .name("pinshm-test-nospace-cache")
                .reserve(false)
                .prefault(false)
                .back_ahead(0),
        )
        .unwrap();
        let r = StoreReader::attach(&w.handle()).unwrap();
        // Six cached objects, read (so they may go), then /dev/shm is full.
        for i in 0..6u64 {
            let h = w.put(&format!("k{i}"), &pattern(i, 4 * MIB)).unwrap();
            assert_eq!(r.get_copy(h).unwrap(), pattern(i, 4 * MIB));
        }
        fill_dev_shm("pinshm-test-nospace-filler");
        // An unread 8 MiB object: no pages past the high-water mark, so it
        // wraps into what is backed, in k0's and k1's place.
        w.put("big", &pattern(9, 8 * MIB)).unwrap();
        let before = w.stats();
        assert_eq!(before.nospace_fallbacks, 1, "{before:?}");
        assert_eq!(before.evictions, 2, "{before:?}");
        let kept: Vec<String> = (2..6).map(|i| format!("k{i}")).collect();
        assert!(kept.iter().all(|k| w.is_cached(k)), "{before:?}");
        // 20 MiB from the cursor (after big) would take k2..k5 and pages past
        // the high-water mark, which /dev/shm has not got; what is backed
        // has no 20 MiB beside the unread big. The put fails, and displaces
        // nothing: no span that could not be backed costs an eviction.
        let err = w.put("x", &pattern(10, 20 * MIB)).unwrap_err();
        assert!(matches!(err, Error::NoSpace { .. }), "{err}");
        let after = w.stats();
        assert_eq!(after.evictions, before.evictions, "{after:?}");
        for (i, k) in (2..6u64).zip(&kept) {
            let h = w
                .lookup(k)
                .unwrap_or_else(|| panic!("{k} was forgotten: {after:?}"));
            assert_eq!(r.get_copy(h).unwrap(), pattern(i, 4 * MIB), "{k}");
        }
        // A put that fits in what is backed displaces what it covers, and
        // that is what is counted: k2 alone.
        let h = w.put("y", &pattern(11, 4 * MIB)).unwrap();
        assert_eq!(r.get_copy(h).unwrap(), pattern(11, 4 * MIB));
        assert_eq!(w.stats().evictions, before.evictions + 1, "{:?}", w.stats());
        assert!(!w.is_cached("k2"));
        assert!(kept[1..].iter().all(|k| w.is_cached(k)));
        println!("RESULT nospace ok ({err})");
    }
}

#[test]
#[ignore = "child process entry point: its parent test runs it with --ignored"]
fn child_channel_on_small_shm() {
    if std::env::var("PINSHM_CHILD").as_deref() == Ok("child_channel_on_small_shm") {
        // vLLM's default queue size, 10 × 24 MiB = 240 MiB, on a 32 MiB /dev/shm.
        let mut tx =
            Broadcast::create(BroadcastConfig::new(1, 10, 24 * MIB).name("pinshm-test-small-chan"))
                .unwrap();
        let rx = BroadcastReader::attach(&tx.handle()).unwrap();
        for i in 0..100u64 {
            tx.send(&pattern(i, KIB)).unwrap();
            assert_eq!(&*rx.recv().unwrap(), &pattern(i, KIB)[..]);
        }
        // Large messages fill /dev/shm: the one that cannot get pages fails.
        let mut err = None;
        for i in 0..10u64 {
            match tx.send(&pattern(i, 20 * MIB)) {
                Ok(()) => assert_eq!(rx.recv().unwrap().len(), 20 * MIB),
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        let err = err.expect("a full /dev/shm stops the large sends");
        assert!(matches!(err, Error::NoSpace { .. }), "{err}");
        // Small messages go on in the slots already backed.
        for i in 0..20u64 {
            tx.send(&pattern(i, KIB)).unwrap();
            assert_eq!(&*rx.recv().unwrap(), &pattern(i, KIB)[..]);
        }
        println!("RESULT channel ok ({err})");
    }
}

/// Handles at `count` addresses the writer of a `capacity`-byte store
/// never wrote (the first MiB holds what it did write): what a stale handle
/// of an earlier segment of the name, one of another store, or a corrupted
/// message carries.
fn handles_past_the_written(
    h: pinshm::store::ObjectHandle,
    capacity: usize,
    count: u64,
) -> Vec<pinshm::store::ObjectHandle> {
    let step = ((capacity - MIB) as u64 / count) & !63;
    (0..count)
        .map(|i| pinshm::store::ObjectHandle {
            address: MIB as u64 + i * step,
            monotonic_id: h.monotonic_id + 1 + i,
            epoch: h.epoch,
        })
        .collect()
}

/// Every read of such a handle is `Stale`, refused before it touches a
/// byte there: a read fault on a hole of a shared tmpfs mapping would
/// allocate a page.
fn refuse_all(r: &StoreReader, forged: &[pinshm::store::ObjectHandle]) {
    let mut out = Vec::new();
    for &f in forged {
        let stale = |what: &str, e: Error| assert!(e.is_stale(), "{what} of {f:?}: {e}");
        stale("get", r.get(f).map(drop).unwrap_err());
        stale("get_copy_into", r.get_copy_into(f, &mut out).unwrap_err());
        stale("validate", r.validate(f).unwrap_err());
        stale("acknowledge", r.acknowledge(f).unwrap_err());
    }
}

#[test]
fn handles_past_what_the_writer_wrote_allocate_no_page() {
    let name = Name::new("pastwritten");
    let capacity = 64 * MIB;
    // No backer: its pages ahead would change the count below meanwhile.
    let mut w = ObjectStore::create(
        StoreConfig::new(capacity, MIB, 1)
            .name(&*name)
            .reserve(false)
            .prefault(false)
            .back_ahead(0),
    )
    .unwrap();
    let r = StoreReader::attach(&w.handle()).unwrap();
    let h = w.put("a", &pattern(1, 4 * KIB)).unwrap();
    assert_eq!(r.get_copy(h).unwrap(), pattern(1, 4 * KIB));
    let before = allocated(&name);
    // 192 handles, four reads each: 768 reads that must touch nothing.
    refuse_all(&r, &handles_past_the_written(h, capacity, 192));
    assert_eq!(allocated(&name), before, "pages allocated by reads");
    // What was written still reads.
    assert_eq!(r.get_copy(h).unwrap(), pattern(1, 4 * KIB));
}

#[test]
fn handles_past_what_the_writer_wrote_raise_no_sigbus_on_a_full_dev_shm() {
    if let Some(text) = in_small_dev_shm("child_reads_past_written_on_full_shm") {
        assert!(text.contains("RESULT past ok"), "{text}");
    }
}

#[test]
#[ignore = "child process entry point: its parent test runs it with --ignored"]
fn child_reads_past_written_on_full_shm() {
    if std::env::var("PINSHM_CHILD").as_deref() == Ok("child_reads_past_written_on_full_shm") {
        // A 256 MiB sparse store on a 32 MiB /dev/shm, then /dev/shm full: a
        // read fault on a hole would be SIGBUS (the child would end with 135).
        let capacity = 256 * MIB;
        // No backer: its pages ahead could race the filler below.
        let mut w = ObjectStore::create(
            StoreConfig::new(capacity, MIB, 1)
                .name("pinshm-test-past-written")
                .reserve(false)
                .prefault(false)
                .back_ahead(0),
        )
        .unwrap();
        let r = StoreReader::attach(&w.handle()).unwrap();
        let h = w.put("a", &pattern(1, 4 * KIB)).unwrap();
        fill_dev_shm("pinshm-test-past-written-filler");
        refuse_all(&r, &handles_past_the_written(h, capacity, 192));
        assert_eq!(r.get_copy(h).unwrap(), pattern(1, 4 * KIB));
        println!("RESULT past ok");
    }
}

/// A cache (a sparse store) and a queue (a sparse
/// channel) share a 32 MiB /dev/shm; the cache is filled with far more than
/// fits, then the queue's larger messages come. With a headroom the cache
/// stops growing before it takes what the queue needs; without one it
/// starves the queue (the control, which shows the test can fail).
#[test]
fn a_cache_with_a_headroom_never_starves_the_queue_beside_it() {
    if let Some(with) =
        in_small_dev_shm_with("child_cache_beside_queue", &[("PINSHM_HEADROOM", "1")])
    {
        assert!(with.contains("RESULT queue ok 10 of 10"), "{with}");
        let without =
            in_small_dev_shm_with("child_cache_beside_queue", &[("PINSHM_HEADROOM", "0")])
                .expect("allowed once");
        assert!(without.contains("RESULT queue starved"), "{without}");
    }
}

#[test]
#[ignore = "child process entry point: its parent test runs it with --ignored"]
fn child_cache_beside_queue() {
    if std::env::var("PINSHM_CHILD").as_deref() == Ok("child_cache_beside_queue") {
        let headroom = std::env::var("PINSHM_HEADROOM").as_deref() == Ok("1");
        // The queue: 10 slots of 2 MiB, as vLLM's (smaller), small messages
        // first, so its pages are not taken yet.
        let mut tx =
            Broadcast::create(BroadcastConfig::new(1, 10, 2 * MIB).name("pinshm-test-beside-chan"))
                .unwrap();
        let rx = BroadcastReader::attach(&tx.handle()).unwrap();
        tx.send(b"hello").unwrap();
        assert_eq!(&*rx.recv().unwrap(), b"hello");
        // The cache: 256 MiB on a 32 MiB /dev/shm, 100 distinct 512 KiB
        // objects, each read (so it may go): every put must succeed.
        let mut cfg = StoreConfig::new(256 * MIB, MIB, 1)
            .name("pinshm-test-beside-cache")
            .reserve(false)
            .prefault(false);
        if headroom {
            // What the queue's slots can take, and a little more.
            cfg = cfg.shm_headroom(22 * MIB as u64);
        }
        let mut w = ObjectStore::create(cfg).unwrap();
        let r = StoreReader::attach(&w.handle()).unwrap();
        for i in 0..100u64 {
            let h = w
                .put(&format!("k{i}"), &pattern(i, 512 * KIB))
                .unwrap_or_else(|e| panic!("put {i}: {e}"));
            assert_eq!(r.get_copy(h).unwrap(), pattern(i, 512 * KIB));
        }
        // The queue's large messages.
        let mut sent = 0;
        for i in 0..10u64 {
            match tx.send(&pattern(i, 2 * MIB - 4 * KIB)) {
                Ok(()) => {
                    assert_eq!(rx.recv().unwrap().len(), 2 * MIB - 4 * KIB);
                    sent += 1;
                }
                Err(Error::NoSpace { .. }) => break,
                Err(e) => panic!("send {i}: {e}"),
            }
        }
        if sent == 10 {
            println!(
                "RESULT queue ok {sent} of 10 ({:?})",
                w.stats().nospace_fallbacks
            );
        } else {
            println!("RESULT queue starved after {sent} of 10");
        }
    }
}
