//! Regression tests for the store's safety promises, each
//! with real processes: a slot under a live guard is never reused, and safe
//! code cannot make anything read freed memory.
//!
//! 1. A reader in another PID namespace holds a guard while the writer fills
//!    the ring (its pid means nothing to the writer).
//! 2. A writer whose descriptor table is full fills the ring while a reader
//!    holds a guard (no liveness check may need a new descriptor).
//! 3. A `PendingGet` is leaked and its reader dropped while a delayed copy
//!    still reads the slot.
//! 4. A device put is finished twice.
//!
//! In each case the guarded bytes stay intact, the writer gets `Full`
//! rather than reusing the slot, and nothing crashes.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{checksum, pattern, spawn_child, Name};
use pinshm::{
    device::{CopyEngine, CpuEngine},
    store::{ObjectHandle, StoreHandle},
    Error, ObjectStore, StoreConfig, StoreReader,
};

const KIB: usize = 1024;
const LEN: usize = 64 * KIB;

/// A writer whose ring holds a few objects of `LEN` bytes, read by one reader.
fn small_store(name: &Name) -> ObjectStore {
    ObjectStore::create(StoreConfig::new(4 * StoreConfig::slot_len(1, LEN), LEN, 1).name(&**name))
        .unwrap()
}

/// Puts until the ring is full: the writer must fail with `Full` (and reap
/// nobody), never reuse the guarded slot. Returns the number of puts.
fn fill_until_full(w: &mut ObjectStore, tag: &str) -> usize {
    for i in 0..64 {
        match w.put(&format!("{tag}{i}"), &pattern(1000 + i as u64, LEN)) {
            Ok(_) => {}
            Err(Error::Full { .. }) => return i,
            Err(e) => panic!("put {i}: {e}"),
        }
    }
    panic!("64 puts into a ring of 4 slots never failed: the guarded slot was reused");
}

fn send(child: &mut Child, line: &str) {
    let stdin = child.stdin.as_mut().unwrap();
    writeln!(stdin, "{line}").unwrap();
    stdin.flush().unwrap();
}

fn expect_line(lines: &mut impl Iterator<Item = std::io::Result<String>>, prefix: &str) -> String {
    for line in lines.by_ref() {
        // libtest prints "test NAME ... " before a child's first line.
        let line = line.unwrap();
        if let Some((_, rest)) = line.split_once(prefix) {
            return rest.trim().to_owned();
        }
    }
    panic!("child ended before printing '{prefix}'");
}

/// The reader half of tests 1 and 2: attaches, holds a guard on the handle
/// it is sent, prints the bytes' checksum, and prints it again when asked.
fn hold_a_guard() {
    let mut lines = std::io::stdin().lock().lines();
    let sh: StoreHandle = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    let h: ObjectHandle = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    let r = StoreReader::attach(&sh).unwrap();
    let g = r.get(h).unwrap();
    println!("HOLDING {}", checksum(&g));
    let _ = lines.next(); // "check"
    println!("STILL {}", checksum(&g));
    let _ = lines.next(); // "done"
}

#[test]
#[ignore = "child process entry point: its parent test runs it with --ignored"]
fn child_hardening() {
    if let Ok(role) = std::env::var("PINSHM_CHILD") {
        match role.as_str() {
            "hold" => hold_a_guard(),
            "emfile_writer" => emfile_writer(),
            "leak_pending_get" => leak_pending_get(),
            "die_as_writer" => {
                let name = std::env::var("PINSHM_NAME").unwrap();
                let w = ObjectStore::create(
                    StoreConfig::new(4 * StoreConfig::slot_len(1, LEN), LEN, 1).name(name),
                )
                .unwrap();
                // Gone without closing the store: as a crash leaves it.
                std::mem::forget(w);
                std::process::exit(0);
            }
            other => panic!("unknown role {other}"),
        }
    }
}

#[test]
fn a_reader_in_another_pid_namespace_keeps_its_guard_while_the_ring_fills() {
    let exe = std::env::current_exe().unwrap();
    if common::namespaces_allowed(&["--pid", "--fork", "--mount-proc"], "a PID namespace") {
        let name = Name::new("pidns");
        let mut w = small_store(&name);
        let data = pattern(7, LEN);
        let h = w.put("guarded", &data).unwrap();
        // The reader runs as pid 1 of a new PID namespace: the pid it records
        // names another process (or none) in ours.
        let mut child = Command::new("unshare")
            .args(["--pid", "--fork", "--mount-proc"])
            .arg(exe)
            .args(["child_hardening", "--exact", "--ignored", "--nocapture"])
            .env("PINSHM_CHILD", "hold")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        send(&mut child, &serde_json::to_string(&w.handle()).unwrap());
        send(&mut child, &serde_json::to_string(&h).unwrap());
        let before = expect_line(&mut lines, "HOLDING");
        assert_eq!(before, checksum(&data).to_string());

        let puts = fill_until_full(&mut w, "fill");
        assert!(puts < 4, "the guarded object kept its slot");
        assert_eq!(w.stats().dead_readers_reaped, 0, "a live reader was reaped");
        send(&mut child, "check");
        assert_eq!(
            expect_line(&mut lines, "STILL"),
            before,
            "the bytes under the guard changed"
        );
        send(&mut child, "done");
        assert!(child.wait().unwrap().success());
    }
}

/// The writer half of test 2, in a child so that its descriptor limit
/// touches no other test: fills its descriptor table, then the ring.
fn emfile_writer() {
    let name = std::env::var("PINSHM_NAME").unwrap();
    let mut w =
        ObjectStore::create(StoreConfig::new(4 * StoreConfig::slot_len(1, LEN), LEN, 1).name(name))
            .unwrap();
    let h = w.put("guarded", &pattern(7, LEN)).unwrap();
    println!("HANDLE {}", serde_json::to_string(&w.handle()).unwrap());
    println!("OBJECT {}", serde_json::to_string(&h).unwrap());
    let mut lines = std::io::stdin().lock().lines();
    let _ = lines.next(); // "fill": the reader holds its guard now
                          // Exhaust the descriptor table: every open from here on fails.
    let mut held = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => held.push(f),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(nix::libc::EMFILE), "{e}");
                break;
            }
        }
        assert!(held.len() < 1 << 20, "no descriptor limit");
    }
    let puts = fill_until_full(&mut w, "fill");
    println!("FULL {puts} {}", w.stats().dead_readers_reaped);
    drop(held);
    let _ = lines.next(); // "done"
}

#[test]
fn a_writer_out_of_descriptors_never_takes_a_live_readers_slot() {
    let name = Name::new("emfile");
    let mut writer = spawn_child(
        "child_hardening",
        "emfile_writer",
        &[("PINSHM_NAME", name.0.clone())],
    );
    let mut wlines = BufReader::new(writer.stdout.take().unwrap()).lines();
    let sh = expect_line(&mut wlines, "HANDLE");
    let h = expect_line(&mut wlines, "OBJECT");
    let sh: StoreHandle = serde_json::from_str(&sh).unwrap();
    let h: ObjectHandle = serde_json::from_str(&h).unwrap();
    let r = StoreReader::attach(&sh).unwrap();
    let g = r.get(h).unwrap();
    let before = checksum(&g);
    assert_eq!(before, checksum(&pattern(7, LEN)));
    send(&mut writer, "fill");
    let full = expect_line(&mut wlines, "FULL");
    let (puts, reaped) = full.split_once(' ').unwrap();
    assert!(puts.parse::<usize>().unwrap() < 4, "{full}");
    assert_eq!(reaped, "0", "a live reader was reaped: {full}");
    assert_eq!(checksum(&g), before, "the bytes under the guard changed");
    drop(g);
    drop(r);
    send(&mut writer, "done");
    assert!(writer.wait().unwrap().success());
}

/// Test 3's reader: starts a slow copy out of a slot, leaks the
/// `PendingGet`, drops the reader, then checks what the copy delivered.
fn leak_pending_get() {
    let mut lines = std::io::stdin().lock().lines();
    let sh: StoreHandle = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    let h: ObjectHandle = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    let engine = CpuEngine::with_delay(Duration::from_millis(300));
    let dst = engine.alloc(LEN).unwrap();
    let r = StoreReader::attach(&sh).unwrap();
    let pending = r.get_to_device(h, &dst, &engine).unwrap();
    std::mem::forget(pending);
    // Without the copy holding the mapping, this unmapped the slot under
    // the copy (SIGSEGV).
    drop(r);
    println!("LEAKED");
    // A download is ordered after the copy (as on a stream).
    let mut out = vec![0u8; LEN];
    engine.download(&dst, &mut out).unwrap();
    println!("COPIED {}", checksum(&out));
    let _ = lines.next(); // "done"
}

#[test]
fn a_leaked_pending_get_keeps_its_slot_and_mapping_until_the_copy_is_done() {
    let name = Name::new("leakget");
    let mut w = small_store(&name);
    let data = pattern(11, LEN);
    let h = w.put("guarded", &data).unwrap();
    let mut child = spawn_child("child_hardening", "leak_pending_get", &[]);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    send(&mut child, &serde_json::to_string(&w.handle()).unwrap());
    send(&mut child, &serde_json::to_string(&h).unwrap());
    expect_line(&mut lines, "LEAKED");
    // The copy is still in flight (300 ms delay): the slot is not reused.
    let puts = fill_until_full(&mut w, "fill");
    assert!(puts < 4, "the slot under the copy kept its object");
    assert_eq!(
        expect_line(&mut lines, "COPIED"),
        checksum(&data).to_string(),
        "the copy read other bytes than the object's"
    );
    send(&mut child, "done");
    assert!(
        child.wait().unwrap().success(),
        "the reader process crashed"
    );
    // Once the copy is done and the process gone, its entry is reaped and
    // the slot comes back.
    assert_eq!(w.reap_dead_readers(), vec![0]);
    w.put("after", &pattern(12, LEN)).unwrap();
}

#[test]
fn a_device_put_finished_twice_is_refused_and_changes_nothing() {
    let name = Name::new("twice");
    let mut w = small_store(&name);
    let engine = CpuEngine::new();
    let src = engine.alloc(LEN).unwrap();
    engine.upload(&pattern(5, LEN), &src).unwrap();
    let p = w.put_from_device("dev", &src, &engine).unwrap();
    let h = loop {
        if let Some(h) = w.try_finish_put(&p).unwrap() {
            break h;
        }
        std::thread::yield_now();
    };
    // The object is read once by a reader process.
    let mut child = spawn_child("child_hardening", "hold", &[]);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    send(&mut child, &serde_json::to_string(&w.handle()).unwrap());
    send(&mut child, &serde_json::to_string(&h).unwrap());
    expect_line(&mut lines, "HOLDING");
    send(&mut child, "check");
    expect_line(&mut lines, "STILL");
    send(&mut child, "done");
    assert!(child.wait().unwrap().success());
    let before = w.stats();
    assert_eq!(before.puts, 1);
    // Finishing again is an error and changes nothing.
    assert!(matches!(
        w.try_finish_put(&p),
        Err(Error::PutNotPending { .. })
    ));
    assert!(matches!(w.finish_put(p), Err(Error::PutNotPending { .. })));
    assert_eq!(w.stats(), before, "a second finish changed the store");
    // Its read still counts: the object is reclaimable, not unread again.
    assert_eq!(w.free_unused(), 1);
}

/// 5. A forked child holds copies of its parent's reader and store (Python's
///    `os.fork` and multiprocessing's fork start method make them without
///    any `unsafe`). Using or dropping them in the child must change nothing
///    of the parent's: not its holds or hazard, not its lock, not its segment.
#[test]
fn a_forked_child_using_and_dropping_inherited_handles_changes_nothing_of_the_parents() {
    let name = Name::new("fork");
    let mut w = small_store(&name);
    let data = pattern(21, LEN);
    let h = w.put("guarded", &data).unwrap();
    let r = StoreReader::attach(&w.handle()).unwrap();
    let g = r.get(h).unwrap();
    // SAFETY: the child touches only the copies it inherited, allocates
    // little (glibc's fork keeps malloc usable) and leaves with _exit.
    match unsafe { nix::unistd::fork() }.unwrap() {
        nix::unistd::ForkResult::Child => {
            let forked = |e: &Error| matches!(e, Error::Forked { .. });
            let ok = r.get(h).is_err_and(|e| forked(&e))
                && r.get_copy(h).is_err_and(|e| forked(&e))
                && w.put("child", &[1]).is_err_and(|e| forked(&e))
                && w.free_unused() == 0;
            // Dropping the guard, the reader and the store in the child.
            drop(g);
            drop(r);
            drop(w);
            // SAFETY: ends the child at once.
            unsafe { nix::libc::_exit(if ok { 0 } else { 3 }) };
        }
        nix::unistd::ForkResult::Parent { child } => {
            let status = nix::sys::wait::waitpid(child, None).unwrap();
            assert_eq!(
                status,
                nix::sys::wait::WaitStatus::Exited(child, 0),
                "the child's handles did not refuse"
            );
        }
    }
    // The parent's reader is alive, its guard holds, its store is whole.
    assert!(name.exists(), "the child unlinked the parent's segment");
    let puts = fill_until_full(&mut w, "fill");
    assert!(puts < 4, "the guarded object kept its slot");
    assert_eq!(w.stats().dead_readers_reaped, 0);
    assert_eq!(
        checksum(&g),
        checksum(&data),
        "the bytes under the guard changed"
    );
    assert!(r.writer_alive(), "the child closed the parent's store");
    drop(g);
    assert_eq!(&*r.get(h).unwrap(), &data[..]);
}

/// 6. Two writers replace one dead writer's segment at the same time:
///    exactly one gets the name, the other is told it is in use.
#[test]
fn two_writers_replacing_a_dead_ones_segment_do_not_both_win() {
    for round in 0..100 {
        let name = Name::new("replace");
        let child = spawn_child(
            "child_hardening",
            "die_as_writer",
            &[("PINSHM_NAME", name.0.clone())],
        );
        assert!(child.wait_with_output().unwrap().status.success());
        assert!(name.exists(), "the dead writer left its segment");
        let barrier = std::sync::Barrier::new(2);
        let results: Vec<_> = std::thread::scope(|s| {
            let racers: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        ObjectStore::create(
                            StoreConfig::new(4 * StoreConfig::slot_len(1, LEN), LEN, 1)
                                .name(&*name)
                                .prefault(false),
                        )
                    })
                })
                .collect();
            racers.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let won = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(won, 1, "round {round}: {results:?}");
        for r in &results {
            if let Err(e) = r {
                assert!(matches!(e, Error::InUse { .. }), "round {round}: {e}");
            }
        }
        let winner = results.into_iter().find_map(|r| r.ok()).unwrap();
        assert_eq!(StoreHandle::of(&name).unwrap(), winner.handle());
    }
}

/// 7. The same for the broadcast channel: a forked child's copies of the
///    writer and a reader refuse, and dropping them changes nothing.
#[test]
fn a_forked_child_dropping_inherited_channel_handles_changes_nothing() {
    use pinshm::{channel::BroadcastConfig, Broadcast, BroadcastReader};
    let name = Name::new("forkchan");
    let mut tx = Broadcast::create(BroadcastConfig::new(1, 4, 64).name(&*name)).unwrap();
    let rx = BroadcastReader::attach(&tx.handle()).unwrap();
    tx.send(b"before").unwrap();
    let m = rx.recv().unwrap();
    // SAFETY: the child touches only the copies it inherited and leaves
    // with _exit.
    match unsafe { nix::unistd::fork() }.unwrap() {
        nix::unistd::ForkResult::Child => {
            let forked = |e: &Error| matches!(e, Error::Forked { .. });
            let ok = tx.send(b"child").is_err_and(|e| forked(&e))
                && rx.try_recv().is_err_and(|e| forked(&e));
            drop(m);
            drop(rx);
            drop(tx);
            // SAFETY: ends the child at once.
            unsafe { nix::libc::_exit(if ok { 0 } else { 3 }) };
        }
        nix::unistd::ForkResult::Parent { child } => {
            let status = nix::sys::wait::waitpid(child, None).unwrap();
            assert_eq!(status, nix::sys::wait::WaitStatus::Exited(child, 0));
        }
    }
    assert_eq!(&*m, b"before", "the message the parent holds is intact");
    assert!(rx.writer_alive(), "the child closed the parent's channel");
    drop(m);
    // The parent's reader still counts: four unread messages fill the ring.
    for i in 0..4u8 {
        tx.send(&[i]).unwrap();
    }
    assert!(
        !tx.try_send(b"x").unwrap(),
        "the writer no longer waits for the reader"
    );
    for i in 0..4u8 {
        assert_eq!(&*rx.recv().unwrap(), &[i]);
    }
    assert!(tx.try_send(b"y").unwrap());
    assert_eq!(
        &*rx.recv().unwrap(),
        b"y",
        "the child closed the parent's channel"
    );
    assert!(name.exists());
}
