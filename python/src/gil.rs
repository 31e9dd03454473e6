//! Releasing the GIL, safely when the interpreter exits.
//!
//! A thread that retakes the GIL once the interpreter is finalizing is
//! ended by CPython with a forced unwind (`pthread_exit`); through Rust
//! frames that aborts the process ("FATAL: exception not rethrown", exit
//! 134). Daemon threads blocked in a wait or a long copy are exactly such
//! threads. So every release goes through [`released`], and the module's
//! `atexit` callback, [`at_exit`], closes the door:
//!
//! - a thread whose work ends after the door closed never retakes the GIL:
//!   it sleeps until the process ends (what it got is dropped: nobody is
//!   left to use it; it holds no lock of ours meanwhile);
//! - a thread that passed the door before it closed is waiting to retake
//!   the GIL, or about to: `at_exit` lets go of the GIL until each such
//!   thread has it back, while the interpreter still runs them.
//!
//! The door is a Dekker pair, both sides sequentially consistent: a thread
//! counts itself in `PASSING`, then looks at `CLOSED`; `at_exit` sets
//! `CLOSED`, then looks at `PASSING`. At least one of the two sees the
//! other, so no thread slips through unseen.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::OnceLock;
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use crate::per_fork::PerFork;

/// Set (once) by `at_exit`: the interpreter is shutting down.
static CLOSED: AtomicBool = AtomicBool::new(false);
/// The thread that ran `at_exit` (it finalizes: it is never held back).
static EXITING: OnceLock<ThreadId> = OnceLock::new();
/// Threads between the door and the GIL, per fork generation: a thread
/// counted when another forked is not in the child (whose exit must not
/// wait `DRAIN` for it). A thread counts itself out where it counted in.
static PASSING: PerFork<AtomicUsize> = PerFork::new(|| AtomicUsize::new(0));

/// Longest `at_exit` waits for passing threads to retake the GIL (a thread
/// stopped in a debugger must not hang the exit).
const DRAIN: Duration = Duration::from_secs(2);

/// Runs `f` with the GIL released (as `Python::allow_threads`); once the
/// interpreter is exiting, a thread other than the exiting one does not
/// come back (see the module doc).
pub(crate) fn released<R: Send>(py: Python<'_>, f: impl FnOnce() -> R + Send) -> R {
    let (r, passing) = py.allow_threads(|| {
        let r = f();
        let passing = PASSING.get();
        passing.fetch_add(1, SeqCst);
        if CLOSED.load(SeqCst) && EXITING.get() != Some(&std::thread::current().id()) {
            passing.fetch_sub(1, SeqCst);
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        (r, passing)
    });
    // The GIL is held again.
    passing.fetch_sub(1, SeqCst);
    r
}

/// Runs `f` with the GIL, then `then` on its result with the GIL let go
/// again, on a thread that is not Python's (the release poller), unless
/// the interpreter is exiting: then None, and the GIL is never taken. A
/// thread that passes the door counts itself in `PASSING` until `then` is
/// done (not just until it has the GIL, as in `released`: its thread state
/// ends with `f`, Python code in `f` may let go of the GIL meanwhile, and
/// `then` ends reads of segments the exit may be about to unmap), so
/// `at_exit` waits for both.
pub(crate) fn with_gil_unless_exiting_then<R, S>(
    f: impl FnOnce(Python<'_>) -> R,
    then: impl FnOnce(R) -> S,
) -> Option<S> {
    let passing = PASSING.get();
    passing.fetch_add(1, SeqCst);
    if CLOSED.load(SeqCst) {
        passing.fetch_sub(1, SeqCst);
        return None;
    }
    // Counted out even if `f` or `then` unwinds.
    struct Out(&'static AtomicUsize);
    impl Drop for Out {
        fn drop(&mut self) {
            self.0.fetch_sub(1, SeqCst);
        }
    }
    let _out = Out(passing);
    let r = Python::with_gil(f);
    Some(then(r))
}

/// Whether the interpreter is shutting down (`at_exit` has run).
pub(crate) fn exiting() -> bool {
    CLOSED.load(SeqCst)
}

/// Threads of this process's fork generation between the door and the
/// GIL now (`pinshm._pinshm._exit_door_passing()`): a test's view of what
/// `at_exit` waits for. A thread counted in a parent at its fork is not in
/// the child's count, so in a child it drops to 0 once the child's own
/// threads are through.
#[pyfunction]
#[pyo3(name = "_exit_door_passing")]
pub(crate) fn exit_door_passing() -> usize {
    PASSING.get().load(SeqCst)
}

/// Registered with `atexit` at module init (see the module doc).
#[pyfunction]
pub(crate) fn at_exit(py: Python<'_>) {
    let _ = EXITING.set(std::thread::current().id());
    CLOSED.store(true, SeqCst);
    let passing = PASSING.get();
    if passing.load(SeqCst) == 0 {
        return;
    }
    py.allow_threads(|| {
        let end = Instant::now() + DRAIN;
        while passing.load(SeqCst) > 0 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}
