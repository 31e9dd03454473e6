//! A file at a segment's name whose size keeps switching (its owner
//! truncating it to 0 and growing it back, with a valid store header each
//! time): creating a store there and collecting garbage read it with
//! `pread`, never through a mapping of it, so nothing here can raise
//! SIGBUS. (As another user, with the real second
//! user of the host: tests/python/test_squatters.py.)

mod common;

use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::Name;
use pinshm::{Error, ObjectStore, StoreConfig};

/// A file at `name` (mode `mode`), a copy of a real store's first 64 KiB
/// written into it, resized between 1 MiB + 64 KiB and 0 by a thread until
/// the returned flag is set.
fn toggling(name: &Name, mode: u32) -> (Arc<AtomicBool>, std::thread::JoinHandle<()>) {
    let model = Name::new("squat-model");
    let header = {
        let s = ObjectStore::create(StoreConfig::new(1 << 20, 1 << 18, 8).name(&*model)).unwrap();
        let bytes = std::fs::read(model.path()).unwrap();
        drop(s);
        bytes[..64 << 10].to_vec()
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(name.path())
        .unwrap();
    file.set_permissions(std::fs::Permissions::from_mode(mode))
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let t = std::thread::spawn(move || {
        while !flag.load(Ordering::Relaxed) {
            file.set_len((1 << 20) + (64 << 10)).unwrap();
            file.write_all_at(&header, 0).unwrap();
            file.set_len(0).unwrap();
        }
    });
    (stop, t)
}

#[test]
fn a_store_made_at_a_name_whose_file_keeps_changing_size_is_an_error_never_sigbus() {
    // A round ends when a look finds the valid header and replaces the
    // file (its writer lock is free: no writer); until then each attempt
    // is refused (empty, or not a store). A mapping of it would have died
    // in about one attempt of five.
    let mut attempts = 0;
    for _ in 0..40 {
        let name = Name::new("squat-own");
        let (stop, t) = toggling(&name, 0o600);
        for _ in 0..50 {
            attempts += 1;
            // (Not inspect: it maps a file of this user's own, as a
            // reader does; another user's it copies first, see
            // tests/python/test_squatters.py.)
            let _ = pinshm::inspect::gc(&name, true);
            match ObjectStore::create(StoreConfig::new(1 << 20, 1 << 18, 8).name(&*name)) {
                Ok(_) => break,
                Err(Error::InUse { .. } | Error::AlreadyExists { .. }) => {}
                Err(e) => panic!("{e}"),
            }
        }
        stop.store(true, Ordering::Relaxed);
        t.join().unwrap();
    }
    assert!(attempts >= 40);
}

#[test]
fn a_world_writable_file_at_a_name_is_refused_naming_its_mode_and_never_read() {
    let name = Name::new("squat-0666");
    let (stop, t) = toggling(&name, 0o666);
    for _ in 0..100 {
        match ObjectStore::create(StoreConfig::new(1 << 20, 1 << 18, 8).name(&*name)) {
            Err(Error::Untrusted { detail, .. }) => {
                assert!(
                    detail.contains("0666") && detail.contains("another name"),
                    "{detail}"
                )
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("a store was made over a world-writable file"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    t.join().unwrap();
}
