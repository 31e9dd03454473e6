//! Readers in real processes (this test binary re-executed) and in threads,
//! reading thousands of objects of mixed sizes while the writer keeps putting
//! and reclaiming; every byte is checked.

mod common;

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use common::{checksum, child_result, pattern, spawn_child, Name, Rng};
use pinshm::{
    store::{ObjectHandle, StoreHandle},
    Error, ObjectStore, StoreConfig, StoreReader,
};

const MIB: usize = 1024 * 1024;

/// Sizes from 1 B to 4 MiB, mostly small, as multimodal traffic is.
fn mixed_size(rng: &mut Rng) -> usize {
    match rng.below(100) {
        0..=59 => 1 + rng.below(4096) as usize,
        60..=94 => 4096 + rng.below(256 * 1024) as usize,
        _ => 256 * 1024 + rng.below(4 * MIB as u64 - 256 * 1024) as usize,
    }
}

/// Puts `n` objects, retrying on `Full` until readers catch up; calls `send`
/// with each handle and the line readers need to verify it.
fn produce(w: &mut ObjectStore, n: u64, mut send: impl FnMut(String)) {
    let mut rng = Rng(0xfeed);
    let deadline = Instant::now() + Duration::from_secs(120);
    for i in 0..n {
        let len = mixed_size(&mut rng);
        let data = pattern(i, len);
        let h = loop {
            match w.put(&format!("obj{i}"), &data) {
                Ok(h) => break h,
                Err(Error::Full { .. }) => {
                    assert!(Instant::now() < deadline, "readers stopped reading");
                    std::thread::sleep(Duration::from_micros(50));
                }
                Err(e) => panic!("put {i}: {e}"),
            }
        };
        send(format!(
            "{} {} {} {} {}",
            h.address,
            h.monotonic_id,
            h.epoch,
            len,
            checksum(&data)
        ));
    }
}

/// Reads every handle line, verifies it, returns (objects, bytes).
fn consume(r: &StoreReader, lines: impl Iterator<Item = String>) -> (u64, u64) {
    let (mut objects, mut bytes) = (0u64, 0u64);
    for line in lines {
        let f: Vec<u64> = line.split(' ').map(|x| x.parse().unwrap()).collect();
        let h = ObjectHandle {
            address: f[0],
            monotonic_id: f[1],
            epoch: f[2],
        };
        // Alternate the zero-copy and the copying path.
        let sum = if objects % 2 == 0 {
            let g = r
                .get(h)
                .unwrap_or_else(|e| panic!("reader {}: {e}", r.index()));
            assert_eq!(g.len() as u64, f[3]);
            checksum(&g)
        } else {
            let v = r
                .get_copy(h)
                .unwrap_or_else(|e| panic!("reader {}: {e}", r.index()));
            assert_eq!(v.len() as u64, f[3]);
            checksum(&v)
        };
        assert_eq!(sum, f[4], "object {} differs from what was put", f[1]);
        objects += 1;
        bytes += f[3];
    }
    (objects, bytes)
}

/// Child side: attach as the given rank and consume handle lines from stdin.
#[test]
#[ignore = "child process entry point: its parent test runs it with --ignored"]
fn child_reader() {
    // Run as a normal test (no role): nothing to do.
    if let Ok(role) = std::env::var("PINSHM_CHILD") {
        let sh: StoreHandle =
            serde_json::from_str(&std::env::var("PINSHM_HANDLE").unwrap()).unwrap();
        let rank: u32 = std::env::var("PINSHM_RANK").unwrap().parse().unwrap();
        let r = StoreReader::attach_as(&sh, rank).unwrap();
        match role.as_str() {
            "read" => {
                let stdin = std::io::stdin();
                let (objects, bytes) = consume(&r, stdin.lock().lines().map(Result::unwrap));
                println!("RESULT {objects} {bytes}");
            }
            "die" => {
                // Hold a guard, say so, and die without detaching.
                let mut line = String::new();
                std::io::stdin().read_line(&mut line).unwrap();
                let f: Vec<u64> = line.trim().split(' ').map(|x| x.parse().unwrap()).collect();
                let g = r
                    .get(ObjectHandle {
                        address: f[0],
                        monotonic_id: f[1],
                        epoch: f[2],
                    })
                    .unwrap();
                println!("RESULT holding {}", g.len());
                std::io::stdout().flush().unwrap();
                std::process::exit(0);
            }
            other => panic!("unknown role {other}"),
        }
    }
}

#[test]
fn reader_processes_see_every_byte_while_the_writer_reclaims() {
    let name = Name::new("xproc");
    let n_readers = 3;
    let mut w =
        ObjectStore::create(StoreConfig::new(24 * MIB, 4 * MIB, n_readers).name(&*name)).unwrap();
    let sh = serde_json::to_string(&w.handle()).unwrap();
    let mut children: Vec<_> = (0..n_readers)
        .map(|rank| {
            spawn_child(
                "child_reader",
                "read",
                &[
                    ("PINSHM_HANDLE", sh.clone()),
                    ("PINSHM_RANK", rank.to_string()),
                ],
            )
        })
        .collect();
    let mut pipes: Vec<_> = children
        .iter_mut()
        .map(|c| c.stdin.take().unwrap())
        .collect();
    let n = 3000;
    let mut expect_bytes = 0u64;
    produce(&mut w, n, |line| {
        expect_bytes += line.split(' ').nth(3).unwrap().parse::<u64>().unwrap();
        for p in &mut pipes {
            writeln!(p, "{line}").unwrap();
        }
    });
    drop(pipes);
    for c in children {
        assert_eq!(child_result(c), format!("{n} {expect_bytes}"));
    }
    let s = w.stats();
    assert_eq!(s.puts, n);
    assert!(s.evictions > 0, "the ring wrapped and reclaimed");
}

#[test]
fn reader_threads_see_every_byte_while_the_writer_reclaims() {
    let name = Name::new("xthread");
    let n_readers = 2;
    let mut w =
        ObjectStore::create(StoreConfig::new(16 * MIB, 4 * MIB, n_readers).name(&*name)).unwrap();
    let sh = w.handle();
    let (txs, handles): (Vec<_>, Vec<_>) = (0..n_readers)
        .map(|rank| {
            let (tx, rx) = std::sync::mpsc::channel::<String>();
            let sh = sh.clone();
            let t = std::thread::spawn(move || {
                let r = StoreReader::attach_as(&sh, rank).unwrap();
                consume(&r, rx.into_iter())
            });
            (tx, t)
        })
        .unzip();
    let n = 2000;
    produce(&mut w, n, |line| {
        for tx in &txs {
            tx.send(line.clone()).unwrap();
        }
    });
    drop(txs);
    for t in handles {
        assert_eq!(t.join().unwrap().0, n);
    }
}

#[test]
fn a_reader_process_that_dies_holding_a_guard_stops_blocking_reclaim() {
    let name = Name::new("deadreader");
    let len = 64 * 1024;
    let mut w = ObjectStore::create(StoreConfig::new(4 * len, len, 1).name(&*name)).unwrap();
    let sh = serde_json::to_string(&w.handle()).unwrap();
    let a = w.put("a", &pattern(1, len)).unwrap();
    let mut child = spawn_child(
        "child_reader",
        "die",
        &[("PINSHM_HANDLE", sh), ("PINSHM_RANK", "0".into())],
    );
    writeln!(
        child.stdin.take().unwrap(),
        "{} {} {}",
        a.address,
        a.monotonic_id,
        a.epoch
    )
    .unwrap();
    assert_eq!(child_result(child), format!("holding {len}"));
    // The dead reader neither acknowledged `a` nor released its guard; the
    // writer finds it dead when the ring fills and stops waiting for it.
    for i in 0..10 {
        w.put(&format!("k{i}"), &pattern(i, len)).unwrap();
    }
    assert!(!w.is_cached("a"));
    assert_eq!(w.stats().dead_readers_reaped, 1);
    // Its reader slot can be taken again.
    let r = StoreReader::attach_as(&w.handle(), 0).unwrap();
    assert_eq!(r.index(), 0);
}
