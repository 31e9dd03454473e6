//! Releases gated on a device: `set_release_gate`.
//!
//! A read's last view may go while an asynchronous copy from it (a
//! host-to-device DMA out of a pinned slot) is still in flight: torch
//! records events only for blocks of its own pinned allocator, so the slot
//! must not be reused until the copy is done. With a gate set, when a
//! read's last view goes the binding asks the gate for an event (an object
//! with `query() -> bool`, e.g. a `torch.cuda.Event` just recorded on the
//! current stream) and acknowledges the read only once the event has
//! completed. A gate that returns None releases at once. Nothing changes
//! while no gate is set. Copies out (`get_copy`, `get_copy_into`) are never
//! gated: the copy is done, by the CPU, before they return.
//!
//! Pending reads are polled, never waited for, by:
//! - the poller: one thread per process (started when a read goes
//!   pending and none runs, in a forked child too), which polls every
//!   pending event about every millisecond while any is pending, sleeps
//!   on a condvar otherwise, and ends after a second with none. It takes the GIL
//!   only to call `query()`, through the exit door of `crate::gil` (never
//!   once the interpreter is exiting: it then stops), and is not a Python
//!   thread, so it never keeps the interpreter from exiting;
//! - every get, `flush_releases()` and `StoreReader.close()`, which wait
//!   (GIL released) for a pass under way, then make their own: a get
//!   still sees every read whose event completed before it began;
//! - dropping a `StoreReader`, which makes a pass unless one is under way.
//!
//! One pass at a time (`State::busy`): a pass takes the pending list out,
//! queries with the GIL held and no lock of ours, and puts back what has
//! not completed. The reads that complete are ended (acknowledged) with
//! the GIL released by the poller, held by the others (each waits only for
//! its reader's mutex, never held across a wait for the GIL: see lib.rs).
//! A pending read keeps its reader attached (as a guard does), closed or
//! not, until its event completes: nothing forgets a copy in flight.
//!
//! In a forked child the pending reads of the parent are the parent's:
//! they are forgotten (never queried, never ended, their events never
//! touched), and a pass the parent had under way at the fork does not
//! block the child.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::ThreadId;
use std::time::Duration;

use pyo3::prelude::*;

use crate::lock;

/// Whether a gate is set: a read's drop checks only this when none is.
static SET: AtomicBool = AtomicBool::new(false);
static GATE: Mutex<Option<Py<PyAny>>> = Mutex::new(None);

/// How often the poller polls while reads are pending.
const POLL_EVERY: Duration = Duration::from_millis(1);
/// How long the poller waits for a read to pend before its thread ends
/// (a process that gates no more reads has no thread of ours left: a
/// later `os.fork()` sees one thread fewer).
const IDLE_EXIT: Duration = Duration::from_secs(1);

/// Sets (or, with None, clears) the release gate: a callable taking no
/// arguments, called when a read's last view goes, returning None (release
/// now) or an event with `query()` (release once it returns true).
#[pyfunction]
#[pyo3(signature = (gate))]
pub(crate) fn set_release_gate(gate: Option<Py<PyAny>>) {
    let mut g = lock(&GATE);
    SET.store(gate.is_some(), Ordering::Release);
    *g = gate;
}

/// The event to wait for before releasing a read whose last view just
/// went, if a gate is set and returns one. A gate that raises is reported
/// (as an unraisable exception) and the read released at once: the gate
/// is the caller's promise about its copies, and without an answer there
/// is nothing to wait for.
pub(crate) fn event_for_release() -> Option<Py<PyAny>> {
    if !SET.load(Ordering::Acquire) || crate::gil::exiting() {
        return None;
    }
    Python::with_gil(|py| {
        let gate = lock(&GATE).as_ref().map(|g| g.clone_ref(py))?;
        match gate.call0(py) {
            Ok(ev) if ev.is_none(py) => None,
            Ok(ev) => Some(ev),
            Err(e) => {
                e.write_unraisable(py, Some(gate.bind(py)));
                None
            }
        }
    })
}

/// Whether `event` has completed (`query()` true). An event whose query
/// raises counts as completed (reported as unraisable): a broken event
/// must not hold a slot for the life of the process.
fn completed(py: Python<'_>, event: &Py<PyAny>) -> bool {
    match event
        .call_method0(py, "query")
        .and_then(|r| r.is_truthy(py))
    {
        Ok(done) => done,
        Err(e) => {
            e.write_unraisable(py, Some(event.bind(py)));
            true
        }
    }
}

/// A read waiting for its event: dropping it ends the read.
pub(crate) trait Gated: Send {
    /// Whether the read is a forked parent's (then it is forgotten).
    fn forked(&self) -> bool;
}

type Entry = (Py<PyAny>, Box<dyn Gated>);

struct State {
    /// Reads waiting for their events, but those a pass has taken out.
    pending: Vec<Entry>,
    /// The pass under way, by (fork generation, thread): one at a time.
    busy: Option<(u64, ThreadId)>,
    /// How many reads the pass under way has taken out of `pending`.
    in_flight: usize,
}

static STATE: Mutex<State> = Mutex::new(State {
    pending: Vec::new(),
    busy: None,
    in_flight: 0,
});
/// `pending.len() + in_flight`: a get, which flushes first, pays one load
/// (not a lock) while no read is pending, the usual case.
static COUNT: AtomicUsize = AtomicUsize::new(0);
/// Wakes the poller: a read went pending.
static WAKE: Condvar = Condvar::new();
/// A pass ended.
static IDLE: Condvar = Condvar::new();
/// 1 + the fork generation the poller was started in (0: never).
static POLLER: AtomicU64 = AtomicU64::new(0);

impl State {
    /// The pass under way, unless it is a forked parent's (whose thread
    /// is not in this process: it never ends here).
    fn busy_here(&self) -> Option<ThreadId> {
        self.busy
            .filter(|&(g, _)| g == pinshm::fork_generation())
            .map(|(_, t)| t)
    }

    fn count(&mut self) {
        if self.busy_here().is_none() {
            self.in_flight = 0;
        }
        COUNT.store(self.pending.len() + self.in_flight, Ordering::Release);
    }

    /// Starts a pass: takes the pending reads out, forgetting a forked
    /// parent's.
    fn begin(&mut self) -> Vec<Entry> {
        let (parents, batch): (Vec<Entry>, Vec<Entry>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|(_, read)| read.forked());
        // The parent's are forgotten: never ended, their events never
        // dropped (a CUDA event of the parent must not be touched here).
        std::mem::forget(parents);
        self.busy = Some((pinshm::fork_generation(), std::thread::current().id()));
        self.in_flight = batch.len();
        batch
    }

    /// Ends a pass: puts back what is still pending; returns the count.
    fn end(&mut self, still: Vec<Entry>) -> usize {
        self.pending.extend(still);
        self.busy = None;
        self.in_flight = 0;
        self.count();
        IDLE.notify_all();
        self.pending.len()
    }
}

/// Splits `batch` by `query()`: what is still pending, and the reads to
/// end (their events dropped here, with the GIL).
fn query_all(py: Python<'_>, batch: Vec<Entry>) -> (Vec<Entry>, Vec<Box<dyn Gated>>) {
    let mut still = Vec::new();
    let mut done = Vec::new();
    for (event, read) in batch {
        if completed(py, &event) {
            drop(event);
            done.push(read);
        } else {
            still.push((event, read));
        }
    }
    (still, done)
}

/// Queues `read` until `event` completes, and wakes the poller (starting
/// it if this process has none).
pub(crate) fn pend(event: Py<PyAny>, read: Box<dyn Gated>) {
    let mut s = lock(&STATE);
    s.pending.push((event, read));
    s.count();
    drop(s);
    start_poller();
    WAKE.notify_one();
}

fn start_poller() {
    let want = pinshm::fork_generation().wrapping_add(1);
    let now = POLLER.load(Ordering::Acquire);
    if now == want
        || POLLER
            .compare_exchange(now, want, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
    {
        return;
    }
    // Without a poller (no thread to be had), gets and flush_releases
    // still poll: nothing panics, reads end later.
    if std::thread::Builder::new()
        .name("pinshm-release".into())
        .spawn(poll)
        .is_err()
    {
        POLLER.store(now, Ordering::Release);
    }
}

/// The poller's body (see the module doc). It ends when the interpreter
/// exits or after `IDLE_EXIT` with nothing pending; it is never running
/// in a forked child (threads do not survive a fork), where a new one
/// starts if the child gates reads of its own.
fn poll() {
    let generation = pinshm::fork_generation();
    loop {
        let mut batch = {
            let mut s = lock(&STATE);
            loop {
                if crate::gil::exiting() || pinshm::fork_generation() != generation {
                    return;
                }
                if s.pending.is_empty() {
                    let (g, wait) = WAKE
                        .wait_timeout(s, IDLE_EXIT)
                        .unwrap_or_else(|p| p.into_inner());
                    s = g;
                    if wait.timed_out() && s.pending.is_empty() {
                        // Under the lock: a read pended after this starts
                        // a new poller (`pend` looks after pushing).
                        POLLER.store(0, Ordering::Release);
                        return;
                    }
                } else if s.busy_here().is_some() {
                    s = wait_idle(s);
                } else {
                    break;
                }
            }
            s.begin()
        };
        let polled =
            crate::gil::with_gil_unless_exiting(|py| query_all(py, std::mem::take(&mut batch)));
        let Some((still, done)) = polled else {
            // Exiting: the batch goes back unpolled (nothing is ended
            // unasked, and the pass ends, so nobody waits for it).
            lock(&STATE).end(batch);
            return;
        };
        // Ended with no GIL: each end waits for its reader's mutex only.
        drop(done);
        let left = lock(&STATE).end(still);
        if left > 0 {
            std::thread::sleep(POLL_EVERY);
        }
    }
}

fn wait_idle(s: MutexGuard<'_, State>) -> MutexGuard<'_, State> {
    IDLE.wait_timeout(s, POLL_EVERY)
        .unwrap_or_else(|p| p.into_inner())
        .0
}

/// Ends every pending read whose event has completed; returns how many
/// are still pending. Waits (GIL released) for a pass under way, then
/// makes its own, unless called from within a pass (a `query()` or a
/// gate that calls it): then it only counts. Never waits for an event.
#[pyfunction]
pub(crate) fn flush_releases(py: Python<'_>) -> usize {
    flush(py, true)
}

/// As `flush_releases`, but where a pass is under way (the poller's, most
/// often) it makes none and waits for nothing (a reader's drop).
pub(crate) fn flush_if_idle(py: Python<'_>) {
    flush(py, false);
}

fn flush(py: Python<'_>, wait: bool) -> usize {
    if COUNT.load(Ordering::Acquire) == 0 {
        return 0;
    }
    let me = std::thread::current().id();
    let batch = {
        let mut s = lock(&STATE);
        match s.busy_here() {
            None => Some(s.begin()),
            Some(t) if t == me || !wait => None,
            Some(_) => {
                drop(s);
                Some(crate::gil::released(py, || {
                    let mut s = lock(&STATE);
                    while s.busy_here().is_some() {
                        s = wait_idle(s);
                    }
                    s.begin()
                }))
            }
        }
    };
    let Some(batch) = batch else {
        return COUNT.load(Ordering::Acquire);
    };
    let (still, done) = query_all(py, batch);
    // Ends the reads with the GIL held: each waits only for its reader's
    // mutex, which nobody holds while waiting for the GIL.
    drop(done);
    lock(&STATE).end(still);
    COUNT.load(Ordering::Acquire)
}

/// Wakes the poller (a reader was closed or dropped: the reads it has
/// pending are polled at once).
pub(crate) fn nudge() {
    if COUNT.load(Ordering::Acquire) > 0 {
        WAKE.notify_one();
    }
}
