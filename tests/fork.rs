//! What a forked child inherits: nothing that keeps its parent alive in
//! anyone's eyes, and nothing that reads bytes changing under it.
//!
//! The parties here are real processes: this test binary re-run as a child
//! (`child_party`), which forks a grandchild that does nothing with pinshm
//! and outlives it (the vLLM pattern: a process builds a store or queue,
//! then forks workers).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use common::{pattern, spawn_child, Name};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult, Pid};
use pinshm::{
    channel::{BroadcastConfig, BroadcastHandle},
    store::StoreHandle,
    Broadcast, BroadcastReader, Error, ObjectStore, StoreConfig, StoreReader,
};

/// How long a dead party may look alive: the channel's documented bound
/// is about two liveness periods (half a second); this is that with room
/// for a loaded machine, a guard against a hang, not a timing assertion.
const GONE_WITHIN: Duration = Duration::from_secs(5);

/// Forks a grandchild that does nothing with pinshm and lives `secs`
/// seconds (it is killed sooner by the test): its pid, once it runs (its
/// fork handlers are done: until then it still holds everything its parent
/// had, as any child does between `fork` and its first instruction).
fn fork_idle_child(secs: u64) -> Pid {
    let (rx, tx) = nix::unistd::pipe().unwrap();
    // SAFETY: the child only writes a byte, sleeps in a system call and
    // exits with _exit; it runs no allocator, lock or destructor.
    match unsafe { fork() }.unwrap() {
        ForkResult::Child => {
            // SAFETY: plain system calls on descriptors we own.
            unsafe {
                nix::libc::write(tx.as_raw_fd(), b"r".as_ptr().cast(), 1);
                nix::libc::sleep(secs as u32);
                nix::libc::_exit(0)
            }
        }
        ForkResult::Parent { child } => {
            drop(tx);
            let mut b = [0u8; 1];
            std::fs::File::from(rx).read_exact(&mut b).unwrap();
            child
        }
    }
}

/// A process of this binary in `role`: it builds or attaches, forks an
/// idle grandchild, prints `READY <handle> <grandchild pid>` and waits to
/// be killed.
#[test]
#[ignore = "child process entry point: its parent test runs it with --ignored"]
fn child_party() {
    // Run as a normal test (no role): nothing to do.
    if let Ok(role) = std::env::var("PINSHM_CHILD") {
        let name = std::env::var("PINSHM_NAME").unwrap();
        let handle = std::env::var("PINSHM_HANDLE").unwrap_or_default();
        let keep: Box<dyn std::any::Any> = match role.as_str() {
            "channel-writer" => {
                let mut b = Broadcast::create(BroadcastConfig::new(1, 8, 256).name(&name)).unwrap();
                b.send(b"before").unwrap();
                Box::new(b)
            }
            "channel-reader" => {
                let h: BroadcastHandle = serde_json::from_str(&handle).unwrap();
                Box::new(BroadcastReader::attach_as(&h, 0).unwrap())
            }
            "store-reader" => {
                let h: StoreHandle = serde_json::from_str(&handle).unwrap();
                Box::new(StoreReader::attach_as(&h, 0).unwrap())
            }
            other => panic!("unknown role {other}"),
        };
        let out = match keep.downcast_ref::<Broadcast>() {
            Some(b) => serde_json::to_string(&b.handle()).unwrap(),
            None => "-".into(),
        };
        let grandchild = fork_idle_child(60);
        println!("READY {out} {grandchild}");
        std::io::stdout().flush().unwrap();
        // Wait for the parent to kill us (reading stdin until it closes).
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        drop(keep);
    }
}

/// A running `child_party`: its process, what it printed, and its idle
/// grandchild (killed with it at the end, whatever the test's outcome).
struct Party {
    child: std::process::Child,
    /// Kept open: the child prints to it until it is killed.
    _out: BufReader<std::process::ChildStdout>,
    handle: String,
    grandchild: Pid,
}

impl Party {
    fn start(role: &str, name: &Name, handle: String) -> Party {
        let mut child = spawn_child(
            "child_party",
            role,
            &[("PINSHM_NAME", name.0.clone()), ("PINSHM_HANDLE", handle)],
        );
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut said = String::new();
        let ready = loop {
            let mut line = String::new();
            if out.read_line(&mut line).unwrap() == 0 {
                panic!("the child ended before it was ready:\n{said}");
            }
            // The harness prints "test child_party ... " first, unended.
            match line.split_once("READY ") {
                Some((_, rest)) => break rest.trim().to_owned(),
                None => said.push_str(&line),
            }
        };
        let mut it = ready.rsplitn(2, ' ');
        let grandchild = Pid::from_raw(it.next().unwrap().parse().unwrap());
        let handle = it.next().unwrap().to_owned();
        Party {
            child,
            _out: out,
            handle,
            grandchild,
        }
    }

    /// SIGKILLs the party (not its grandchild) and reaps it.
    fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Party {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = kill(self.grandchild, Signal::SIGKILL);
        let _ = waitpid(self.grandchild, None);
    }
}

/// The grandchild is still running: the test is about a live child.
fn assert_alive(pid: Pid) {
    assert!(
        kill(pid, None).is_ok(),
        "the forked grandchild should still be alive"
    );
}

#[test]
fn a_killed_writer_is_gone_to_its_reader_though_its_forked_child_lives() {
    let name = Name::new("fork-writer");
    let mut w = Party::start("channel-writer", &name, String::new());
    let h: BroadcastHandle = serde_json::from_str(&w.handle).unwrap();
    let r = BroadcastReader::attach_as(&h, 0).unwrap();
    assert_eq!(&*r.recv_timeout(GONE_WITHIN).unwrap(), b"before");
    w.kill();
    assert_alive(w.grandchild);
    let t = Instant::now();
    match r.recv_timeout(GONE_WITHIN) {
        Err(Error::WriterGone { .. }) => {}
        other => panic!("expected WriterGone, got {other:?} after {:?}", t.elapsed()),
    };
}

#[test]
fn a_killed_channel_reader_stops_blocking_the_writer_though_its_forked_child_lives() {
    let name = Name::new("fork-creader");
    let slots = 8;
    let mut b = Broadcast::create(BroadcastConfig::new(1, slots, 64).name(&*name)).unwrap();
    let mut r = Party::start(
        "channel-reader",
        &name,
        serde_json::to_string(&b.handle()).unwrap(),
    );
    r.kill();
    assert_alive(r.grandchild);
    // Three laps of a ring nobody reads: each send must find the dead
    // reader gone instead of waiting for it.
    for i in 0..3 * slots {
        if let Err(e) = b.send_timeout(&[i as u8; 8], GONE_WITHIN) {
            panic!("send {i} of {}: {e}", 3 * slots);
        }
    }
}

#[test]
fn a_killed_store_reader_is_reaped_within_a_lap_though_its_forked_child_lives() {
    let name = Name::new("fork-sreader");
    let len = 16 << 10;
    let mut w = ObjectStore::create(StoreConfig::new(8 * len, len, 1).name(&*name)).unwrap();
    let mut r = Party::start(
        "store-reader",
        &name,
        serde_json::to_string(&w.handle()).unwrap(),
    );
    r.kill();
    assert_alive(r.grandchild);
    for i in 0..24 {
        if let Err(e) = w.put(&format!("k{i}"), &pattern(i, len)) {
            panic!("put {i} of 24: {e}");
        }
    }
    assert_eq!(w.stats().dead_readers_reaped, 1);
}

/// A guard a forked child inherited, read after its parent released it
/// and the writer reused the slot: the child must not see the new bytes.
/// What it gets is a fault (SIGSEGV) on first touch: the child's copy of
/// every segment mapping is made inaccessible at the fork.
#[test]
fn a_forked_child_faults_on_an_inherited_guard_instead_of_reading_a_reused_slot() {
    let name = Name::new("fork-guard");
    let len = 16 << 10;
    let mut w = ObjectStore::create(StoreConfig::new(4 * len, len, 1).name(&*name)).unwrap();
    let r = StoreReader::attach_as(&w.handle(), 0).unwrap();
    let old = pattern(1, len);
    let h = w.put("a", &old).unwrap();
    let g = r.get(h).unwrap();
    let (mut go_r, mut go_w) = std::os::unix::net::UnixStream::pair().unwrap();
    // SAFETY: the child reads a socket, compares bytes and _exits; it takes
    // no lock a parent thread could hold (no allocation, no stdio).
    let child = match unsafe { fork() }.unwrap() {
        ForkResult::Child => {
            let mut b = [0u8; 1];
            let _ = go_r.read_exact(&mut b);
            // The slot now holds another object's bytes (in the parent's
            // view); this must not read them.
            let same = g[..] == old[..];
            // SAFETY: _exit ends the child at once.
            unsafe { nix::libc::_exit(if same { 0 } else { 1 }) }
        }
        ForkResult::Parent { child } => child,
    };
    drop(g);
    drop(r);
    // Reuse every slot of the ring, so `a`'s bytes are overwritten.
    let reused = [(1, "the child read the reused slot's new bytes")];
    common::reuse_then_expect_fault(&mut w, "a", len, &mut go_w, child, &reused);
}

/// An inherited handle's accessors in a forked child answer without
/// touching the parent's (now inaccessible) mapping: neutral values, or
/// `Forked`, never a fault.
#[test]
fn a_forked_childs_inherited_handles_answer_without_touching_shared_memory() {
    let store = Name::new("fork-acc-store");
    let chan = Name::new("fork-acc-chan");
    let len = 16 << 10;
    let mut w = ObjectStore::create(StoreConfig::new(4 * len, len, 1).name(&*store)).unwrap();
    let r = StoreReader::attach_as(&w.handle(), 0).unwrap();
    let h = w.put("a", &pattern(1, 100)).unwrap();
    let mut b = Broadcast::create(BroadcastConfig::new(1, 2, 64).name(&*chan)).unwrap();
    let br = BroadcastReader::attach_as(&b.handle(), 0).unwrap();
    b.send(b"x").unwrap();
    // SAFETY: the child calls pinshm accessors and _exits; a parent thread
    // holds none of their locks (nothing else runs in this test).
    let child = match unsafe { fork() }.unwrap() {
        ForkResult::Child => {
            let forked = |e: Error| matches!(e, Error::Forked { .. });
            let ok = r.epoch() == 0
                && !r.writer_alive()
                && r.check_writer().is_err_and(forked)
                && r.get(h).is_err_and(forked)
                && w.peek(h).is_err_and(forked)
                && w.stats().objects == 1
                && !br.writer_alive()
                && b.blocking_readers().is_empty()
                && b.attached_readers().is_err_and(forked);
            // SAFETY: _exit ends the child at once.
            unsafe { nix::libc::_exit(if ok { 0 } else { 1 }) }
        }
        ForkResult::Parent { child } => child,
    };
    assert_eq!(
        waitpid(child, None).unwrap(),
        WaitStatus::Exited(child, 0),
        "0: every accessor answered as documented; a signal: one touched the mapping"
    );
    assert_eq!(r.epoch(), h.epoch);
    assert!(r.writer_alive());
}

/// A sparse store's backer thread is the parent's: a forked child has
/// none. Forked while the backer is backing pages, the child's inherited
/// store refuses puts and drops without waiting for a thread it does not
/// have (a hang here) or telling it anything, and without unlinking the
/// parent's segment; the parent's store goes on, its backer with it.
#[test]
fn a_forked_child_drops_a_sparse_store_without_waiting_for_the_parents_backer() {
    let name = Name::new("fork-backer");
    let mib = 1 << 20;
    let mut w = ObjectStore::create(
        StoreConfig::new(512 * mib, 4 * mib, 1)
            .name(&*name)
            .cache(true)
            .reserve(false)
            .prefault(false)
            .back_ahead(256 * mib as u64),
    )
    .unwrap();
    w.put("a", &pattern(1, 4 * mib)).unwrap();
    // SAFETY: the child uses the inherited store and _exits. The backer
    // thread takes no lock and allocates nothing.
    let child = match unsafe { fork() }.unwrap() {
        ForkResult::Child => {
            let refused = matches!(w.put("b", b"x"), Err(Error::Forked { .. }));
            drop(w);
            // SAFETY: _exit ends the child at once.
            unsafe { nix::libc::_exit(if refused { 0 } else { 1 }) }
        }
        ForkResult::Parent { child } => child,
    };
    let t0 = Instant::now();
    let status = loop {
        match waitpid(child, Some(nix::sys::wait::WaitPidFlag::WNOHANG)).unwrap() {
            WaitStatus::StillAlive if t0.elapsed() < GONE_WITHIN => {
                std::thread::sleep(Duration::from_millis(10))
            }
            WaitStatus::StillAlive => {
                let _ = kill(child, Signal::SIGKILL);
                panic!("the child hung dropping its inherited store");
            }
            s => break s,
        }
    };
    assert_eq!(
        status,
        WaitStatus::Exited(child, 0),
        "1: a put was not refused; a signal: the drop touched the parent's thread"
    );
    assert!(name.exists(), "the child unlinked the parent's segment");
    let r = StoreReader::attach(&w.handle()).unwrap();
    for i in 0..8u64 {
        let h = w.put(&format!("k{i}"), &pattern(i, 4 * mib)).unwrap();
        assert_eq!(r.get_copy(h).unwrap(), pattern(i, 4 * mib));
    }
}
