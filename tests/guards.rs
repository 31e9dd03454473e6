//! Guards own what they read through: a store `ReadGuard` and a channel
//! `Message` may outlive the reader that made it and move to other threads.
//! The reader's entry stays attached (its holds and release marks count)
//! until the reader and its last guard are gone.

mod common;

use std::time::Duration;

use common::{pattern, Name};
use pinshm::{
    channel::BroadcastConfig, inspect::inspect, Broadcast, BroadcastReader, Error, ObjectStore,
    StoreConfig, StoreReader,
};

const KIB: usize = 1024;

fn reader_state(name: &Name) -> (&'static str, usize) {
    let snap = inspect(name).unwrap();
    (snap.readers[0].state, snap.readers[0].guards)
}

#[test]
fn a_guard_that_outlives_its_reader_reads_its_bytes_then_releases_its_hold() {
    let name = Name::new("guard-outlives");
    let capacity = 64 * KIB;
    let mut w =
        ObjectStore::create(StoreConfig::new(capacity, capacity / 2, 1).name(&*name)).unwrap();
    let data = pattern(7, 20 * KIB);
    let h = w.put("a", &data).unwrap();
    let guard = {
        let r = StoreReader::attach(&w.handle()).unwrap();
        r.get(h).unwrap()
    };
    // The reader is gone; its guard still reads the object, under an entry
    // that is still attached and still holds the slot.
    assert_eq!(&*guard, &data[..]);
    assert_eq!(reader_state(&name), ("attached", 1));
    assert!(matches!(
        StoreReader::attach(&w.handle()),
        Err(Error::NoReaderSlot { .. })
    ));
    // The writer cannot reuse the held slot: two puts that need all of the
    // ring but a's place fit around it, one more does not.
    let big = capacity / 2 - 4 * KIB;
    assert!(matches!(
        w.put("b", &vec![1; big])
            .and_then(|_| w.put("c", &vec![2; big])),
        Err(Error::Full { .. })
    ));
    assert_eq!(&*guard, &data[..], "the held bytes never changed");

    // Sent to another thread and dropped there: the read is acknowledged,
    // the hold given back and the entry left.
    std::thread::spawn(move || drop(guard)).join().unwrap();
    assert_eq!(reader_state(&name), ("left", 0));
    let snap = inspect(&name).unwrap();
    let a = snap.slots.iter().find(|s| s.monotonic_id == h.monotonic_id);
    assert!(
        a.is_none_or(|s| s.reads_owed == [0]),
        "a's read was acknowledged: {a:?}"
    );
    let r = StoreReader::attach(&w.handle()).unwrap();
    assert_eq!(r.index(), 0, "the entry is free again");
    w.clear();
    w.put("d", &vec![3; big]).unwrap();
    w.put("e", &vec![4; big]).unwrap();
}

#[test]
fn guards_of_one_reader_dropped_on_many_threads_lose_no_acknowledgement() {
    let name = Name::new("guard-threads");
    let mut w = ObjectStore::create(StoreConfig::new(4 << 20, 64 * KIB, 1).name(&*name)).unwrap();
    let r = StoreReader::attach(&w.handle()).unwrap();
    let handles: Vec<_> = (0..256)
        .map(|i| w.put(&format!("k{i}"), &pattern(i, 256)).unwrap())
        .collect();
    // Each object read four times (refs 4): 1024 guards over 8 threads.
    for i in 0..256 {
        for _ in 0..3 {
            w.get_cached(&format!("k{i}")).unwrap();
        }
    }
    let mut guards: Vec<_> = (0..4)
        .flat_map(|_| handles.iter().map(|&h| r.get(h).unwrap()))
        .collect();
    let mut threads = Vec::new();
    for _ in 0..8 {
        let mine: Vec<_> = guards.drain(..128).collect();
        threads.push(std::thread::spawn(move || drop(mine)));
    }
    for t in threads {
        t.join().unwrap();
    }
    let snap = inspect(&name).unwrap();
    assert_eq!(snap.readers[0].guards, 0);
    let owed: Vec<_> = snap.slots.iter().filter(|s| s.reads_owed != [0]).collect();
    assert!(owed.is_empty(), "reads lost: {owed:?}");
    drop(r);
}

#[test]
fn a_message_that_outlives_its_reader_reads_its_bytes_then_releases_its_slot() {
    let name = Name::new("message-outlives");
    let mut tx = Broadcast::create(BroadcastConfig::new(1, 2, 64).name(&*name)).unwrap();
    tx.send(b"first").unwrap();
    let m = {
        let rx = BroadcastReader::attach(&tx.handle()).unwrap();
        rx.recv().unwrap()
    };
    assert_eq!(&*m, b"first");
    // The reader's entry stays while its message does: its one unreleased
    // message and one free slot, so the second send fits and the third
    // must wait for the release.
    tx.send(b"second").unwrap();
    assert!(matches!(
        tx.send_timeout(b"third", Duration::from_millis(50)),
        Err(Error::Timeout { .. })
    ));
    assert_eq!(&*m, b"first", "the held bytes never changed");
    std::thread::spawn(move || drop(m)).join().unwrap();
    // Released, and the reader gone: nobody is expected any more.
    tx.send_timeout(b"third", Duration::from_secs(5)).unwrap();
}
