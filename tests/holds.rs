//! Holds in real processes: a reader holding objects for as long as it
//! likes, dying with a thousand guards, and racing its holds against the
//! writer's reclaim. The readers are this test binary re-executed; they take
//! handle lines on stdin and answer on stdout.

mod common;

use std::io::{BufRead, Write};

use common::{checksum, pattern, Name, Peer, Rng};
use pinshm::{
    store::{ObjectHandle, StoreHandle},
    Error, ObjectStore, StoreConfig, StoreReader,
};

const KIB: usize = 1 << 10;

fn line(h: ObjectHandle, seed: u64, len: usize) -> String {
    format!("{} {} {} {seed} {len}", h.address, h.monotonic_id, h.epoch)
}

fn parse(l: &str) -> (ObjectHandle, u64, usize) {
    let f: Vec<u64> = l.split(' ').map(|x| x.parse().unwrap()).collect();
    let h = ObjectHandle {
        address: f[0],
        monotonic_id: f[1],
        epoch: f[2],
    };
    (h, f[3], f[4] as usize)
}

/// One object stays in use in another process (held by a guard, or never
/// read) while ten times the ring's capacity streams through: every put
/// succeeds, and the object's bytes never change.
fn stream_around(role: &str) {
    let name = Name::new(role);
    let len = 16 * KIB;
    let slots = 32;
    let mut w = ObjectStore::create(
        StoreConfig::new(slots * StoreConfig::slot_len(1, len), len, 1).name(&*name),
    )
    .unwrap();
    let mut peer = Peer::spawn(role, &w.handle());
    let a = w.put("a", &pattern(0, len)).unwrap();
    peer.send(&line(a, 0, len));
    assert_eq!(peer.answer(), "first");
    for i in 1..=10 * slots as u64 {
        let h = w
            .put(&format!("k{i}"), &pattern(i, len))
            .unwrap_or_else(|e| panic!("put {i} with one object in use: {e}"));
        peer.send(&line(h, i, len));
        assert_eq!(peer.answer(), "ok");
    }
    assert!(w.is_cached("a"), "the object in use was never reclaimed");
    assert_eq!(
        peer.finish(),
        format!("done {}", checksum(&pattern(0, len)))
    );
}

#[test]
fn one_object_held_forever_does_not_stop_ten_laps_of_puts() {
    stream_around("holdfirst");
}

#[test]
fn a_slow_readers_unread_object_does_not_stop_ten_laps_of_puts() {
    stream_around("skipfirst");
}

#[test]
fn live_readers_lists_attached_processes_and_drops_a_killed_one() {
    let name = Name::new("livereaders");
    let len = 256;
    let mut w = ObjectStore::create(StoreConfig::new(1 << 20, len, 3).name(&*name)).unwrap();
    let me = StoreReader::attach(&w.handle()).unwrap();
    assert_eq!(
        me.live_readers().unwrap(),
        [(me.index(), std::process::id())]
    );
    let mut peer = Peer::spawn("holdall", &w.handle());
    let h = w.put("a", &pattern(1, len)).unwrap();
    peer.send(&line(h, 1, len));
    peer.send("end");
    assert_eq!(peer.answer(), "holding 1");
    let pid = peer.pid();
    let live = me.live_readers().unwrap();
    assert_eq!(live.len(), 2, "{live:?}");
    assert!(live.contains(&(me.index(), std::process::id())), "{live:?}");
    assert!(
        live.iter().any(|&(i, p)| p == pid && i != me.index()),
        "{live:?}"
    );
    peer.kill();
    // The kernel released the killed reader's lock: it is not counted,
    // though its entry still says attached until the writer reaps it.
    assert_eq!(
        me.live_readers().unwrap(),
        [(me.index(), std::process::id())]
    );
}

#[test]
fn a_reader_killed_holding_a_thousand_guards_is_ignored_and_its_slots_reused() {
    let name = Name::new("kill1000");
    let len = 256;
    let n = 1000;
    let cap = (n + 8) * StoreConfig::slot_len(1, len);
    let mut w = ObjectStore::create(StoreConfig::new(cap, len, 1).name(&*name)).unwrap();
    let mut peer = Peer::spawn("holdall", &w.handle());
    for i in 0..n as u64 {
        let h = w.put(&format!("k{i}"), &pattern(i, len)).unwrap();
        peer.send(&line(h, i, len));
    }
    peer.send("end");
    assert_eq!(peer.answer(), format!("holding {n}"));
    assert_eq!(
        pinshm::inspect::inspect(&name).unwrap().readers[0].guards,
        n
    );
    peer.kill();
    // Ten rings' worth of puts: the dead reader's holds (and reads owed)
    // are ignored once the writer finds its lock gone.
    for i in 0..10 * n as u64 {
        w.put(&format!("after{i}"), &pattern(i, len))
            .unwrap_or_else(|e| panic!("put {i} after the holder died: {e}"));
    }
    assert!(w.stats().dead_readers_reaped >= 1);
    assert!(
        (0..n).all(|i| !w.is_cached(&format!("k{i}"))),
        "its slots were reused"
    );
    // A new reader of the same entry is not mistaken for the dead one.
    let r = StoreReader::attach(&w.handle()).unwrap();
    let h = w.put("fresh", &pattern(9, len)).unwrap();
    let g = r.get(h).unwrap();
    assert_eq!(&g[..], &pattern(9, len)[..]);
    drop(g);
    assert_eq!(
        pinshm::inspect::inspect(&name).unwrap().readers[0].guards,
        0
    );
}

#[test]
fn holds_racing_reclaim_never_see_a_byte_change() {
    let name = Name::new("holdrace");
    let len = 4 * KIB;
    // A small ring, so reclaim runs all the time, with two racing readers.
    let mut w = ObjectStore::create(
        StoreConfig::new(12 * StoreConfig::slot_len(2, len), len, 2).name(&*name),
    )
    .unwrap();
    let mut peers = [
        Peer::spawn("race", &w.handle()),
        Peer::spawn("race", &w.handle()),
    ];
    let mut rng = Rng(0x5eed);
    for i in 0..4000u64 {
        let size = 1 + rng.below(len as u64) as usize;
        let h = loop {
            match w.put(&format!("k{i}"), &pattern(i, size)) {
                Ok(h) => break h,
                // The readers acknowledge as they go: wait for them.
                Err(Error::Full { .. }) => {
                    for p in peers.iter_mut() {
                        p.send("sync");
                        assert_eq!(p.answer(), "synced");
                    }
                }
                Err(e) => panic!("{e}"),
            }
        };
        for p in peers.iter_mut() {
            p.send(&line(h, i, size));
        }
    }
    for p in peers {
        let a = p.finish();
        let f: Vec<u64> = a.split(' ').skip(1).map(|x| x.parse().unwrap()).collect();
        assert_eq!(a.split(' ').next(), Some("race"), "{a}");
        // Both outcomes of the race happened: guards taken and checked,
        // and handles found reclaimed.
        assert!(f[0] > 0 && f[1] > 0, "guards {} stale {}", f[0], f[1]);
    }
}

#[test]
#[ignore = "child process entry point: its parent test runs it with --ignored"]
fn child_reader() {
    let Ok(role) = std::env::var("PINSHM_CHILD") else {
        return;
    };
    let sh: StoreHandle = serde_json::from_str(&std::env::var("PINSHM_HANDLE").unwrap()).unwrap();
    let r = StoreReader::attach(&sh).unwrap();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines().map(|l| l.unwrap());
    let answer = |s: &str| {
        println!("ANSWER {s}");
        std::io::stdout().flush().unwrap();
    };
    match role.as_str() {
        "holdfirst" | "skipfirst" => {
            let (a, seed, len) = parse(&lines.next().unwrap());
            let held = (role == "holdfirst").then(|| r.get(a).unwrap());
            answer("first");
            for l in lines.by_ref() {
                let (h, seed, len) = parse(&l);
                assert_eq!(r.get_copy(h).unwrap(), pattern(seed, len));
                if let Some(g) = &held {
                    assert_eq!(checksum(g), checksum(&pattern(0, len)));
                }
                answer("ok");
            }
            let sum = match held {
                Some(g) => checksum(&g),
                None => checksum(&r.get_copy(a).unwrap()),
            };
            assert_eq!(sum, checksum(&pattern(seed, len)));
            answer(&format!("done {sum}"));
        }
        "holdall" => {
            let mut guards = Vec::new();
            for l in lines.by_ref() {
                if l == "end" {
                    break;
                }
                let (h, seed, len) = parse(&l);
                let g = r.get(h).unwrap();
                assert_eq!(&g[..], &pattern(seed, len)[..]);
                guards.push(g);
            }
            answer(&format!("holding {}", guards.len()));
            // Killed here, holding every guard.
            std::thread::sleep(std::time::Duration::from_secs(60));
        }
        "race" => {
            let mut rng = Rng(std::process::id() as u64);
            let mut recent: Vec<(ObjectHandle, u64, usize)> = Vec::new();
            let (mut guards, mut stale) = (0u64, 0u64);
            for l in lines.by_ref() {
                if l == "sync" {
                    answer("synced");
                    continue;
                }
                let (h, seed, len) = parse(&l);
                // Acknowledge it at once, so the writer may reclaim it...
                r.acknowledge(h).unwrap();
                recent.push((h, seed, len));
                if recent.len() > 32 {
                    recent.remove(0);
                }
                // ...and race a guard on a recent one against that reclaim.
                let (h, seed, len) = recent[rng.below(recent.len() as u64) as usize];
                match r.get(h) {
                    Ok(g) => {
                        let want = checksum(&pattern(seed, len));
                        assert_eq!(checksum(&g), want, "a guard saw other bytes");
                        for _ in 0..rng.below(2000) {
                            std::hint::spin_loop();
                        }
                        assert_eq!(checksum(&g), want, "bytes changed under a guard");
                        guards += 1;
                    }
                    Err(Error::Stale { .. }) => stale += 1,
                    Err(e) => panic!("{e}"),
                }
            }
            answer(&format!("race {guards} {stale}"));
        }
        other => panic!("unknown role {other}"),
    }
}
