//! `pinshm::inspect::gc`: what dead writers left in /dev/shm is listed and removed;
//! a live writer's segment, one being created and other programs' files
//! are never touched. Writers are child processes SIGKILLed mid-life.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::time::Duration;

use common::{spawn_child, Name};
use pinshm::{channel::BroadcastConfig, Broadcast, ObjectStore, StoreConfig};

const MIB: usize = 1 << 20;

/// A child that creates a store (or a channel) under PINSHM_NAME, puts an
/// object, says so, and waits to be killed.
#[test]
#[ignore = "run as a child process by the tests below"]
fn child_writer() {
    let Ok(kind) = std::env::var("PINSHM_CHILD") else {
        return;
    };
    let name = std::env::var("PINSHM_NAME").unwrap();
    let mut out = std::io::stdout();
    let _keep: Box<dyn std::any::Any> = if kind == "store" {
        let mut w = ObjectStore::create(StoreConfig::new(MIB, 4096, 1).name(&name)).unwrap();
        w.put("a", &[7u8; 4000]).unwrap();
        Box::new(w)
    } else {
        Box::new(Broadcast::create(BroadcastConfig::new(1, 4, 256).name(&name)).unwrap())
    };
    writeln!(out, "RESULT created").unwrap();
    out.flush().unwrap();
    // Bounded: a parent that dies must not leave this running.
    std::thread::sleep(Duration::from_secs(60));
}

fn killed_writer(kind: &str, name: &Name) {
    let mut child = spawn_child("child_writer", kind, &[("PINSHM_NAME", name.0.clone())]);
    // The test harness prints its own lines first; the pipe stays open
    // until the child is dead.
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let said = (&mut out)
        .lines()
        .map(|l| l.unwrap())
        .find_map(|l| l.split_once("RESULT ").map(|(_, r)| r.to_owned()));
    assert_eq!(said.as_deref(), Some("created"));
    child.kill().unwrap();
    child.wait().unwrap();
    drop(out);
    assert!(name.exists(), "a SIGKILLed writer leaves its segment");
}

#[test]
fn gc_lists_then_removes_the_segments_of_killed_writers_and_nothing_else() {
    let prefix = Name::new("gc");
    let dead_store = Name(format!("{}-dead-store", prefix.0));
    let dead_channel = Name(format!("{}-dead-channel", prefix.0));
    let live = Name(format!("{}-live", prefix.0));
    let other = Name(format!("{}-other", prefix.0));
    let empty = Name(format!("{}-empty", prefix.0));
    killed_writer("store", &dead_store);
    killed_writer("channel", &dead_channel);
    let w = ObjectStore::create(StoreConfig::new(MIB, 4096, 1).name(&*live)).unwrap();
    std::fs::write(other.path(), b"not a pinshm segment, whatever its name").unwrap();
    std::fs::write(empty.path(), b"").unwrap(); // a segment being created

    let listed = pinshm::inspect::gc(&prefix, true).unwrap();
    let names: Vec<(&str, &str, bool)> = listed
        .iter()
        .map(|a| (a.name.as_str(), a.kind, a.removed))
        .collect();
    assert_eq!(
        names,
        [
            (&*dead_channel, "channel", false),
            (&*dead_store, "store", false)
        ]
    );
    let store = listed.iter().find(|a| a.kind == "store").unwrap();
    assert!(
        store.writer_pid.is_some_and(|p| p != 0) && store.bytes > 0,
        "{store:?}"
    );
    assert!(
        dead_store.exists() && dead_channel.exists(),
        "a dry run removes nothing"
    );

    let removed = pinshm::inspect::gc(&prefix, false).unwrap();
    assert!(
        removed.iter().all(|a| a.removed) && removed.len() == 2,
        "{removed:?}"
    );
    assert!(!dead_store.exists() && !dead_channel.exists());
    assert!(
        live.exists() && other.exists() && empty.exists(),
        "left alone"
    );
    assert_eq!(
        pinshm::inspect::gc(&prefix, false).unwrap(),
        [],
        "nothing left to remove"
    );
    drop(w);
    assert!(!live.exists(), "its writer removed it");
}

#[test]
fn a_segment_replaced_by_a_new_writer_is_not_removed() {
    let name = Name::new("gc-replaced");
    killed_writer("store", &name);
    // The next writer of the name replaces the dead one's segment.
    let w = ObjectStore::create(StoreConfig::new(MIB, 4096, 1).name(&*name)).unwrap();
    assert_eq!(pinshm::inspect::gc(&name, false).unwrap(), []);
    assert!(name.exists());
    drop(w);
}
