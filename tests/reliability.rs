//! Crashes, hostile processes and limits, with real processes (this test
//! binary re-executed). Every test is bounded in time and removes its
//! segments.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{checksum, pattern, spawn_child, Name, Rng};
use pinshm::testing as layout;
use pinshm::{
    store::{ObjectHandle, StoreHandle},
    Error, ObjectStore, StoreConfig, StoreReader,
};

const KIB: usize = 1024;
const MIB: usize = 1 << 20;

fn handle_line(h: ObjectHandle) -> String {
    serde_json::to_string(&h).unwrap()
}

fn kill9(child: &mut std::process::Child) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let _ = child.wait();
}

/// Child roles. `hold`: attach as reader 1, take a guard on every handle
/// read from stdin and keep it, say "held" after each; wait to be killed.
/// `writer`: create the store named in PINSHM_NAME, print its handle, then
/// put objects forever, printing "addr id epoch len seed" for each.
/// `crash`: create PINSHM_NAME (replacing a dead writer's), put, say so.
#[test]
#[ignore = "child process entry point: its parent test runs it with --ignored"]
fn child_role() {
    if let Ok(role) = std::env::var("PINSHM_CHILD") {
        let mut out = std::io::stdout();
        match role.as_str() {
            "hold" => {
                let sh: StoreHandle =
                    serde_json::from_str(&std::env::var("PINSHM_HANDLE").unwrap()).unwrap();
                let r = StoreReader::attach_as(&sh, 1).unwrap();
                let mut guards = Vec::new();
                for line in std::io::stdin().lock().lines() {
                    let h: ObjectHandle = serde_json::from_str(&line.unwrap()).unwrap();
                    guards.push(r.get(h).unwrap());
                    writeln!(out, "RESULT held {}", guards.len()).unwrap();
                    out.flush().unwrap();
                }
                std::thread::sleep(Duration::from_secs(60));
            }
            "writer" => {
                let name = std::env::var("PINSHM_NAME").unwrap();
                let mut w =
                    ObjectStore::create(StoreConfig::new(8 * MIB, MIB, 1).name(name)).unwrap();
                writeln!(
                    out,
                    "RESULT {}",
                    serde_json::to_string(&w.handle()).unwrap()
                )
                .unwrap();
                let mut rng = Rng(99);
                let t0 = Instant::now();
                for i in 0u64.. {
                    // Bounded: a stuck parent must not leave this running.
                    assert!(
                        t0.elapsed() < Duration::from_secs(30),
                        "writer child gave up"
                    );
                    let len = 1 + rng.below(64 * KIB as u64) as usize;
                    let h = loop {
                        match w.put(&format!("k{i}"), &pattern(i, len)) {
                            Ok(h) => break h,
                            Err(Error::Full { .. }) => {
                                std::thread::sleep(Duration::from_micros(200))
                            }
                            Err(e) => panic!("{e}"),
                        }
                    };
                    writeln!(
                        out,
                        "RESULT {} {} {} {len} {i}",
                        h.address, h.monotonic_id, h.epoch
                    )
                    .unwrap();
                    out.flush().unwrap();
                }
            }
            "flip" => {
                // Flip random bytes of the segment file's mapping until stdin closes.
                let path = std::env::var("PINSHM_PATH").unwrap();
                let total: u64 = std::env::var("PINSHM_LEN").unwrap().parse().unwrap();
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(path)
                    .unwrap();
                // A raw shared mapping of the segment, written with volatile byte
                // stores: exactly the hostile writer this test wants.
                let map = memmap2::MmapOptions::new()
                    .len(total as usize)
                    .map_raw(&f)
                    .unwrap();
                let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
                let d = done.clone();
                std::thread::spawn(move || {
                    let mut line = String::new();
                    let _ = std::io::stdin().read_line(&mut line);
                    d.store(true, std::sync::atomic::Ordering::Relaxed);
                });
                writeln!(out, "RESULT flipping").unwrap();
                out.flush().unwrap();
                let mut rng = Rng(0xbad);
                let mut n = 0u64;
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    // Mostly the data region; sometimes the reader table.
                    let at = if rng.below(10) == 0 {
                        256 + rng.below(4096 - 256)
                    } else {
                        4096 + rng.below(total - 4096)
                    };
                    // SAFETY: at < total, inside the mapping.
                    unsafe {
                        map.as_mut_ptr()
                            .add(at as usize)
                            .write_volatile(rng.next() as u8)
                    };
                    n += 1;
                }
                writeln!(out, "RESULT {n}").unwrap();
            }
            "crash" => {
                let name = std::env::var("PINSHM_NAME").unwrap();
                let mut w =
                    ObjectStore::create(StoreConfig::new(MIB, 64 * KIB, 1).name(name)).unwrap();
                w.put("a", &pattern(1, 1000)).unwrap();
                writeln!(out, "RESULT created").unwrap();
                out.flush().unwrap();
                std::thread::sleep(Duration::from_secs(60));
            }
            other => panic!("unknown role {other}"),
        }
    }
}

fn read_result(r: &mut impl BufRead) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            r.read_line(&mut line).unwrap() > 0,
            "child closed its output"
        );
        if let Some((_, rest)) = line.split_once("RESULT ") {
            return rest.trim().to_owned();
        }
    }
}

#[test]
fn readers_killed_holding_guards_never_stall_the_writer_or_the_survivors() {
    let name = Name::new("killreaders");
    let len = 64 * KIB;
    let mut w =
        ObjectStore::create(StoreConfig::new(16 * layout::slot_len(2, len), len, 2).name(&*name))
            .unwrap();
    let sh = w.handle();
    let (tx, rx) = std::sync::mpsc::channel::<(ObjectHandle, u64)>();
    let survivor = {
        let sh = sh.clone();
        std::thread::spawn(move || {
            let r = StoreReader::attach_as(&sh, 0).unwrap();
            let mut n = 0u64;
            for (h, i) in rx {
                let g = r.get(h).unwrap_or_else(|e| panic!("survivor: {e}"));
                assert_eq!(checksum(&g), checksum(&pattern(i, len)), "object {i}");
                n += 1;
            }
            n
        })
    };
    let shj = serde_json::to_string(&sh).unwrap();
    let mut i = 0u64;
    let put = |w: &mut ObjectStore, i: &mut u64| -> ObjectHandle {
        let t0 = Instant::now();
        loop {
            match w.put(&format!("k{i}"), &pattern(*i, len)) {
                Ok(h) => {
                    tx.send((h, *i)).unwrap();
                    *i += 1;
                    return h;
                }
                Err(Error::Full { .. }) => {
                    assert!(
                        t0.elapsed() < Duration::from_secs(10),
                        "writer stalled after a reader died"
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => panic!("{e}"),
            }
        }
    };
    for _round in 0..100 {
        let mut victim = spawn_child("child_role", "hold", &[("PINSHM_HANDLE", shj.clone())]);
        let mut stdin = victim.stdin.take().unwrap();
        let mut out = BufReader::new(victim.stdout.take().unwrap());
        for k in 1..=3 {
            let h = put(&mut w, &mut i);
            writeln!(stdin, "{}", handle_line(h)).unwrap();
            assert_eq!(read_result(&mut out), format!("held {k}"));
        }
        kill9(&mut victim);
        // The ring holds 16 objects: these puts must reclaim past the
        // victim's unread, guarded objects, so the writer must notice it died.
        for _ in 0..20 {
            put(&mut w, &mut i);
        }
    }
    drop(tx);
    assert_eq!(
        survivor.join().unwrap(),
        i,
        "the survivor verified every object"
    );
    assert_eq!(
        w.stats().dead_readers_reaped,
        100,
        "every victim was found dead"
    );
}

#[test]
fn a_writer_killed_mid_stream_gives_readers_bytes_or_writer_gone_and_its_name_can_be_reused() {
    let name = Name::new("killwriter");
    let mut child = spawn_child("child_role", "writer", &[("PINSHM_NAME", name.0.clone())]);
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let sh: StoreHandle = serde_json::from_str(&read_result(&mut out)).unwrap();
    let r = StoreReader::attach(&sh).unwrap();
    let mut handles = Vec::new();
    for _ in 0..50 {
        let f: Vec<u64> = read_result(&mut out)
            .split(' ')
            .map(|x| x.parse().unwrap())
            .collect();
        handles.push((
            ObjectHandle {
                address: f[0],
                monotonic_id: f[1],
                epoch: f[2],
            },
            f[3] as usize,
            f[4],
        ));
    }
    // Read half, then kill the writer while it is putting.
    for (h, len, seed) in &handles[..25] {
        assert_eq!(
            checksum(&r.get(*h).unwrap()),
            checksum(&pattern(*seed, *len))
        );
    }
    kill9(&mut child);
    assert!(!r.writer_alive());
    assert!(matches!(r.check_writer(), Err(Error::WriterGone { .. })));
    for (h, len, seed) in &handles[25..] {
        match r.get(*h) {
            Ok(g) => assert_eq!(
                checksum(&g),
                checksum(&pattern(*seed, *len)),
                "whole bytes, never partial"
            ),
            Err(Error::WriterGone { .. }) => {}
            Err(e) => panic!("{e}"),
        }
    }
    // A handle that never existed: WriterGone, not a wait.
    let bogus = ObjectHandle {
        monotonic_id: 1 << 40,
        ..handles[0].0
    };
    assert!(matches!(r.get(bogus), Err(Error::WriterGone { .. })));
    // A new writer takes the name over from the dead one.
    assert!(name.exists());
    let w = ObjectStore::create(StoreConfig::new(MIB, KIB, 1).name(&*name)).unwrap();
    assert_ne!(w.handle().nonce, sh.nonce);
    assert!(matches!(
        StoreReader::attach(&sh),
        Err(Error::SegmentMismatch { .. })
    ));
    drop(w);
    assert!(!name.exists(), "/dev/shm is back to its baseline");
}

#[test]
fn fifty_writers_crashing_in_a_row_leave_nothing_behind() {
    let name = Name::new("crashloop");
    for _ in 0..50 {
        let mut child = spawn_child("child_role", "crash", &[("PINSHM_NAME", name.0.clone())]);
        let mut out = BufReader::new(child.stdout.take().unwrap());
        assert_eq!(
            read_result(&mut out),
            "created",
            "each new writer replaces the dead one's segment"
        );
        kill9(&mut child);
        assert!(name.exists());
    }
    // A live owner makes create fail, clearly.
    let w = ObjectStore::create(StoreConfig::new(MIB, KIB, 1).name(&*name)).unwrap();
    let e = ObjectStore::create(StoreConfig::new(MIB, KIB, 1).name(&*name)).unwrap_err();
    assert!(matches!(e, Error::InUse { .. }), "{e}");
    drop(w);
    assert!(!name.exists());
}

#[test]
fn a_create_larger_than_free_dev_shm_fails_at_create() {
    // In a private mount namespace, /dev/shm is an 8 MiB tmpfs.
    if std::env::var("PINSHM_CHILD").is_err() {
        let exe = std::env::current_exe().unwrap();
        if common::namespaces_allowed(&["-m"], "a mount namespace") {
            let out = Command::new("unshare")
        .args(["-m", "sh", "-c", "mount -t tmpfs -o size=8m pinshm-test /dev/shm && exec \"$0\" child_small_shm --exact --ignored --nocapture"])
        .arg(exe)
        .env("PINSHM_CHILD", "smallshm")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(text.contains("RESULT nospace"), "{text}");
        }
    }
}

#[test]
#[ignore = "child process entry point: its parent test runs it with --ignored"]
fn child_small_shm() {
    if std::env::var("PINSHM_CHILD").as_deref() == Ok("smallshm") {
        let e = ObjectStore::create(StoreConfig::new(16 * MIB, MIB, 1).name("pinshm-test-nospace"))
            .unwrap_err();
        assert!(matches!(e, Error::NoSpace { .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("16781312") || msg.contains("bytes"), "{msg}");
        assert!(
            !std::path::Path::new("/dev/shm/pinshm-test-nospace").exists(),
            "nothing left after the failure"
        );
        // What fits, works.
        let mut w = ObjectStore::create(StoreConfig::new(4 * MIB, MIB, 1).name("pinshm-test-fits"))
            .unwrap();
        w.put("a", &[1; 1000]).unwrap();
        println!("RESULT nospace ({msg})");
    }
}

#[test]
fn a_hostile_process_flipping_bytes_causes_errors_only() {
    let name = Name::new("hostile");
    let len = 32 * KIB;
    let cap = 32 * layout::slot_len(1, len);
    let mut w = ObjectStore::create(StoreConfig::new(cap, len, 1).name(&*name)).unwrap();
    let mut r = StoreReader::attach(&w.handle()).unwrap();
    let total = (layout::header_len(1) + cap) as u64;
    let mut reattached = 0u64;
    // The hostile process: this test binary re-executed, writing random
    // bytes into the segment through its own mapping of the file.
    let mut flipper = spawn_child(
        "child_role",
        "flip",
        &[
            ("PINSHM_PATH", name.path()),
            ("PINSHM_LEN", total.to_string()),
        ],
    );
    let mut flips_out = BufReader::new(flipper.stdout.take().unwrap());
    assert_eq!(read_result(&mut flips_out), "flipping");
    let mut rng = Rng(5);
    let mut handles = Vec::new();
    let t0 = Instant::now();
    let mut outcomes = [0u64; 2];
    while t0.elapsed() < Duration::from_secs(2) {
        let i = handles.len() as u64;
        if let Ok(h) = w.put(
            &format!("k{i}"),
            &pattern(i, rng.below(len as u64) as usize),
        ) {
            handles.push(h);
        }
        let h = handles
            .get(rng.below(handles.len().max(1) as u64) as usize)
            .copied()
            .unwrap_or(ObjectHandle {
                address: 0,
                monotonic_id: 1,
                epoch: 0,
            });
        for res in [r.get(h).map(|g| g.len()), r.get_copy(h).map(|v| v.len())] {
            match res {
                Ok(n) => {
                    assert!(n <= cap);
                    outcomes[0] += 1;
                }
                Err(_) => outcomes[1] += 1,
            }
        }
        let _ = r.get_item(h).map(|v| v.names().count());
        let _ = r.get_tensor(h).map(|v| v.numel());
        if let Err(Error::ReaderLeft { .. }) = r.acknowledge(h) {
            // The flipper hit our reader entry: we are told, and start over
            // (the header may be scribbled too: then attach fails cleanly).
            drop(r);
            match StoreReader::attach(&w.handle()) {
                Ok(again) => {
                    r = again;
                    reattached += 1;
                }
                Err(_) => break,
            }
        }
        let _ = w.free_unused();
        if w.stats().objects > 20 {
            w.clear();
        }
    }
    drop(flipper.stdin.take()); // tells it to stop
    let flips: u64 = read_result(&mut flips_out).parse().unwrap();
    let _ = flipper.wait();
    assert!(
        flips > 1000 && outcomes[0] > 0,
        "flips {flips}, outcomes {outcomes:?}, reattached {reattached}"
    );
}

#[test]
fn sizes_at_the_limits_work_or_fail_cleanly_and_errors_change_nothing() {
    let name = Name::new("limits");
    let max = 100_000;
    let mut w = ObjectStore::create(StoreConfig::new(4 * MIB, max, 1).name(&*name)).unwrap();
    let r = StoreReader::attach(&w.handle()).unwrap();
    let h0 = w.put("zero", &[]).unwrap();
    assert_eq!(r.get(h0).unwrap().len(), 0);
    for (k, n) in [("max-1", max - 1), ("max", max)] {
        let h = w.put(k, &pattern(n as u64, n)).unwrap();
        assert_eq!(r.get_copy(h).unwrap(), pattern(n as u64, n));
    }
    let before = w.stats();
    assert!(matches!(
        w.put("max+1", &vec![0; max + 1]),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(
        w.put("max", &[1]),
        Err(Error::DuplicateKey { .. })
    ));
    assert_eq!(
        w.stats(),
        before,
        "errors leave the writer's state unchanged"
    );
    // A panic inside put_with leaves the store consistent.
    let p = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = w.put_with("boom", 1000, |_| panic!("fill failed"));
    }));
    assert!(p.is_err());
    assert!(!w.is_cached("boom"));
    assert_eq!(w.stats(), before);
    let h = w.put("boom", &pattern(9, 1000)).unwrap();
    assert_eq!(r.get_copy(h).unwrap(), pattern(9, 1000));
}

#[test]
fn capacities_above_4_gib_and_objects_above_2_gib_work_sparse() {
    let name = Name::new("huge");
    let cap = 5 * 1024 * MIB;
    let big = 2 * 1024 * MIB + 12345;
    // Sparse: neither reserved nor pre-faulted; only touched pages cost memory.
    let mut w = ObjectStore::create(
        StoreConfig::new(cap, big, 1)
            .name(&*name)
            .prefault(false)
            .reserve(false),
    )
    .unwrap();
    let r = StoreReader::attach_with(
        &w.handle(),
        pinshm::store::ReaderOptions::default().prefault(false),
    )
    .unwrap();
    let h = w
        .put_with("big", big, |s| {
            s[0] = 1;
            s[big / 2] = 2;
            s[big - 1] = 3;
        })
        .unwrap();
    let g = r.get(h).unwrap();
    assert_eq!(g.len(), big);
    assert_eq!((g[0], g[big / 2], g[big - 1]), (1, 2, 3));
    drop(g);
    // A second one lands past 4 GiB into the ring.
    let h2 = w.put_with("big2", big, |s| s[big - 1] = 7).unwrap();
    assert!(h2.address > 2 * 1024 * MIB as u64);
    assert_eq!(r.get(h2).unwrap()[big - 1], 7);
    // Both were read: a third reclaims the first (two fit in 5 GiB, not three).
    w.put_with("big3", big, |_| {}).unwrap();
    assert!(!w.is_cached("big") && w.is_cached("big2"));
}

#[test]
fn a_stuck_reader_is_not_waited_for_once_the_timeout_passes_but_its_guard_is_honoured() {
    let name = Name::new("stuck");
    let len = 4 * KIB;
    let mut w = ObjectStore::create(
        StoreConfig::new(2 * layout::slot_len(2, len), len, 2)
            .name(&*name)
            .reader_timeout(Duration::from_millis(200)),
    )
    .unwrap();
    let r0 = StoreReader::attach_as(&w.handle(), 0).unwrap();
    let r1 = StoreReader::attach_as(&w.handle(), 1).unwrap(); // never reads
    let a = w.put("a", &pattern(1, len)).unwrap();
    w.put("b", &pattern(2, len)).unwrap();
    r0.acknowledge(a).unwrap();
    let held = r0.get(a).unwrap();
    match w.put("c", &pattern(3, len)).unwrap_err() {
        Error::Full {
            blocker: Some(b), ..
        } => assert_eq!((b.unread_by.clone(), b.held_by.clone()), (vec![1], vec![0])),
        e => panic!("{e:?}"),
    }
    let s = w.stats();
    assert_eq!(
        s.oldest_unread.as_ref().map(|b| b.monotonic_id),
        Some(a.monotonic_id),
        "stats name the blocker"
    );
    std::thread::sleep(Duration::from_millis(300));
    // Reader 1 is stuck now: `b` goes, but reader 0's guard still holds
    // `a`, which stays in place, its bytes unchanged.
    let c = w.put("c", &pattern(3, len)).unwrap();
    assert_ne!(c.address, a.address);
    let d = w.put("d", &pattern(4, len)).unwrap();
    assert_eq!(d.address, c.address, "only the held slot stays");
    assert_eq!(&held[..], &pattern(1, len)[..]);
    drop(held);
    let e = w.put("e", &pattern(5, len)).unwrap();
    assert_eq!(e.address, a.address, "released, it goes");
    drop(r1);
}

#[test]
fn the_inspector_shows_readers_and_slots_and_explains_stale_handles() {
    let name = Name::new("inspect");
    let len = 4 * KIB;
    let mut w =
        ObjectStore::create(StoreConfig::new(3 * layout::slot_len(1, len), len, 1).name(&*name))
            .unwrap();
    let r = StoreReader::attach(&w.handle()).unwrap();
    let a = w.put("a", &pattern(1, len)).unwrap();
    r.acknowledge(a).unwrap();
    let b = w.put("b", &pattern(2, len)).unwrap();
    let c = w.put("c", &pattern(3, len)).unwrap();
    let d = w.put("d", &pattern(4, len)).unwrap(); // reuses a's slot
    assert_eq!(d.address, a.address);
    let _ = r.get(a); // a stale read, counted
    let g = r.get(b).unwrap();
    let snap = pinshm::inspect::inspect(&name).unwrap();
    assert!(snap.writer_alive);
    assert_eq!(snap.layout_version, layout::LAYOUT_VERSION);
    assert_eq!(snap.readers[0].state, "attached");
    assert_eq!(snap.readers[0].pid, std::process::id());
    assert_eq!(snap.readers[0].stale_reads, 1);
    assert_eq!(snap.readers[0].guards, 1);
    let ids: Vec<u64> = snap.slots.iter().map(|s| s.monotonic_id).collect();
    assert_eq!(ids, [b.monotonic_id, c.monotonic_id, d.monotonic_id]);
    assert_eq!(snap.slots[1].reads_owed, vec![1]);
    assert_eq!(snap.slots[0].holds, vec![1]);
    assert_eq!(snap.slots[1].holds, vec![0]);
    // b is both held and owed: the oldest object the writer must go around.
    let (blocker, why) = snap.oldest_blocker().unwrap();
    assert_eq!(blocker.monotonic_id, b.monotonic_id);
    assert!(why.contains("reader 0 has 1 hold,"), "{why}");
    assert!(why.contains("reader 0 owes 1 read"), "{why}");
    assert_eq!(snap.reader_entries(), (1, 0), "the one entry is held");
    let text = snap.to_string();
    assert!(text.contains("blocker   oldest in use: id"), "{text}");
    assert!(
        text.contains("entries   1 of 1 reader entry held by live readers, 0 free"),
        "{text}"
    );
    assert!(
        text.contains("attached") && text.contains("reads owed"),
        "{text}"
    );
    // In words: the store's kind, plurals, object kinds by name, the
    // glossary's names (no "ring", no "kind 0").
    assert!(
        text.contains("kind      store, reads counted per reader"),
        "{text}"
    );
    assert!(
        text.contains("in 3 live objects") && text.contains("3 slots, oldest first"),
        "{text}"
    );
    assert!(snap.slots.iter().all(|s| s.kind_name() == "raw"));
    assert!(
        !text.contains("ring ") && !text.contains("(s)") && text.contains(" raw "),
        "{text}"
    );
    assert!(snap
        .explain(a.address, a.monotonic_id)
        .contains(&format!("now holds id {}", d.monotonic_id)));
    assert!(snap.explain(0, 999).contains("never existed"));
    assert!(snap.explain(b.address, b.monotonic_id).starts_with("live"));
    drop(g);
    w.clear_hard();
    drop(r);
    let snap = pinshm::inspect::inspect(&name).unwrap();
    assert!(snap.explain(c.address, c.monotonic_id).contains("clear"));
    assert_eq!(
        snap.reader_entries(),
        (0, 1),
        "a closed reader's entry is free"
    );
    // The binary prints the same.
    let out = Command::new(env!("CARGO_BIN_EXE_pinshm-inspect"))
        .args([&*name, &format!("{}:{}", a.address, a.monotonic_id)])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("readers") && text.contains("clear"),
        "{text}"
    );
    drop(w);
    let out = Command::new(env!("CARGO_BIN_EXE_pinshm-inspect"))
        .arg(&*name)
        .output()
        .unwrap();
    assert!(!out.status.success(), "no segment: a clear error");
}

#[test]
fn the_inspector_survives_a_corrupt_ring_extent() {
    let name = Name::new("inspect-corrupt");
    let mut w = ObjectStore::create(StoreConfig::new(MIB, KIB, 1).name(&*name)).unwrap();
    w.put("a", b"x").unwrap();
    // Head 0, tail u64::MAX, head past tail: bounded, no overflow, no panic.
    for (head, tail) in [
        (0u64, u64::MAX),
        (u64::MAX - 5, 3),
        (u64::MAX - 64, u64::MAX),
    ] {
        common::scribble(&name, 88, &head.to_le_bytes());
        common::scribble(&name, 96, &tail.to_le_bytes());
        let t0 = Instant::now();
        let snap = pinshm::inspect::inspect(&name).unwrap();
        let _ = snap.to_string();
        let _ = snap.explain(0, 1);
        assert!(t0.elapsed() < Duration::from_secs(5), "the walk is bounded");
    }
}
