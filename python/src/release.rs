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
//! The same poller serves saves waiting for their copy's event
//! (`ObjectStore.publish_after`, `crate::save`): every entry is a `Gated`,
//! which a read ends by being dropped, and a save by publishing its
//! reservation (or, if the event's query raised, aborting it). Below,
//! "read" stands for either.
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
//! - dropping a `StoreReader` only wakes the poller (starting it if none
//!   runs): a drop may run with an exception pending (a dealloc during an
//!   unwind), where no Python call of ours belongs.
//!
//! Python code called from a drop (the gate, when a read's last view
//! goes; `query()`) runs with the exception pending, if any, set aside
//! and restored after: it neither fails for it nor swallows it.
//!
//! One pass at a time (`State::busy`): a pass takes the pending list out,
//! queries with the GIL held and no lock of ours, and puts back what has
//! not completed (`Pass`'s drop, so a panic in a pass puts back what it
//! has not seen complete, and ends the pass). The reads that complete are
//! ended (acknowledged) with the GIL released by the poller, held by the
//! others; ending one takes no lock (the core's guard owns its share of
//! its reader). A pending read keeps its reader attached (as a guard
//! does), closed or not, until its event completes: nothing forgets a
//! copy in flight.
//!
//! The state is per fork generation (`Gen`, a `PerFork`): a forked
//! child's first use swaps in a fresh one and leaks the parent's without
//! locking it (the poller, not holding the GIL, may have held its mutex at
//! the `os.fork()`, which needs only the GIL: locked forever in the
//! child). So the parent's pending reads are forgotten in the child
//! (never queried, never ended, their events never touched), and a pass
//! the parent had under way at the fork does not block the child. Nothing
//! holds a mutex of ours while it waits for the GIL or runs Python code
//! (`GATE` is held only to clone or swap the gate), so no `pthread_atfork`
//! handler is needed either.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::ThreadId;
use std::time::Duration;

use pyo3::prelude::*;

use crate::lock;
use crate::per_fork::PerFork;

/// Whether a gate is set: a read's drop checks only this when none is.
static SET: AtomicBool = AtomicBool::new(false);
/// Held only to clone or swap the gate (no Python code runs under it: the
/// gate replaced is dropped after).
static GATE: Mutex<Option<Py<PyAny>>> = Mutex::new(None);

/// How often the poller polls while reads are pending and some completed
/// in its last pass.
const POLL_EVERY: Duration = Duration::from_millis(1);
/// How often it polls while none completed in its last pass (a read that
/// pends meanwhile wakes it at once).
const POLL_IDLE: Duration = Duration::from_millis(10);
/// How long the poller waits for a read to pend before its thread ends
/// (a process that gates no more reads has no thread of ours left: a
/// later `os.fork()` sees one thread fewer).
const IDLE_EXIT: Duration = Duration::from_secs(1);

/// Runs `f` with the exception pending, if any, set aside (restored
/// after): Python code called from a drop (a dealloc during an unwind)
/// must neither fail for it nor clear it.
fn keeping_exception<R>(_py: Python<'_>, f: impl FnOnce() -> R) -> R {
    let (mut t, mut v, mut tb) = (
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    );
    // SAFETY: the GIL is held (`_py`); PyErr_Fetch moves the pending
    // exception's three (possibly null) references into ours, leaving none
    // pending. Fetch/Restore are in every version we support (deprecated,
    // not removed, in 3.12).
    #[allow(deprecated)]
    unsafe {
        pyo3::ffi::PyErr_Fetch(&mut t, &mut v, &mut tb)
    };
    let r = f();
    if !t.is_null() {
        // SAFETY: the GIL is held; `f` left no exception pending (every
        // error of ours is reported or dropped before it returns), and
        // Restore takes back the three references Fetch gave us.
        #[allow(deprecated)]
        unsafe {
            pyo3::ffi::PyErr_Restore(t, v, tb)
        };
    }
    r
}

/// Sets (or, with None, clears) the release gate: a callable taking no
/// arguments, called when a read's last view goes, returning None (release
/// now) or an event with `query()` (release once it returns true).
#[pyfunction]
#[pyo3(signature = (gate))]
pub(crate) fn set_release_gate(gate: Option<Py<PyAny>>) {
    let old = {
        let mut g = lock(&GATE);
        SET.store(gate.is_some(), Ordering::Release);
        std::mem::replace(&mut *g, gate)
    };
    // Its decref may run Python code: not under our mutex.
    drop(old);
}

/// Whether a release gate is set (`set_release_gate`): reads whose last
/// view goes are then released only once the gate's event completes.
#[pyfunction]
pub(crate) fn has_release_gate() -> bool {
    SET.load(Ordering::Acquire)
}

/// The event to wait for before releasing a read whose last view just
/// went, if a gate is set and returns one. A gate that raises is reported
/// (as an unraisable exception) and the read released at once: the gate
/// is the caller's promise about its copies, and without an answer there
/// is nothing to wait for. An exception pending (this runs in a drop) is
/// set aside meanwhile.
pub(crate) fn event_for_release() -> Option<Py<PyAny>> {
    if !SET.load(Ordering::Acquire) || crate::gil::exiting() {
        return None;
    }
    Python::with_gil(|py| {
        let gate = lock(&GATE).as_ref().map(|g| g.clone_ref(py))?;
        keeping_exception(py, || match gate.call0(py) {
            Ok(ev) if ev.is_none(py) => None,
            Ok(ev) => Some(ev),
            Err(e) => {
                e.write_unraisable(py, Some(gate.bind(py)));
                None
            }
        })
    })
}

/// Whether `event` has completed (`query()` true), or the error its query
/// raised. An exception already pending is set aside meanwhile (so it is
/// never taken for the query's).
fn completed(py: Python<'_>, event: &Py<PyAny>) -> PyResult<bool> {
    keeping_exception(py, || {
        event
            .call_method0(py, "query")
            .and_then(|r| r.is_truthy(py))
    })
}

/// Something waiting for an event: a read to acknowledge (dropping it
/// ends the read), a save to publish (`crate::save`).
pub(crate) trait Gated: Send {
    /// The event's query raised `e` (the GIL held, an exception pending
    /// set aside). A read reports it as unraisable and then ends all the
    /// same: a broken event must not hold a slot for the life of the
    /// process. A save keeps it as its error.
    fn failed(&mut self, py: Python<'_>, e: PyErr, event: &Py<PyAny>) {
        e.write_unraisable(py, Some(event.bind(py)));
    }
    /// The event's query returned true (the GIL held, an exception
    /// pending set aside): a save copies what was staged, if anything.
    fn completed(&mut self, _py: Python<'_>) {}
    /// Called once, when the event has completed (`ok`) or its query
    /// raised (`!ok`), holding no lock of ours: with the GIL (`py`) in a
    /// flush, without it in the poller. A read ends when dropped.
    fn end(self: Box<Self>, _py: Option<Python<'_>>, _ok: bool) {}
}

/// Ends what a pass found complete; whether there was any.
fn end_all(py: Option<Python<'_>>, done: Vec<(Box<dyn Gated>, bool)>) -> bool {
    let any = !done.is_empty();
    for (gated, ok) in done {
        gated.end(py, ok);
    }
    any
}

type Entry = (Py<PyAny>, Box<dyn Gated>);

struct State {
    /// Reads waiting for their events, but those a pass has taken out.
    pending: Vec<Entry>,
    /// The thread whose pass is under way: one at a time.
    busy: Option<ThreadId>,
    /// How many reads the pass under way has taken out of `pending`.
    in_flight: usize,
}

/// The state of one fork generation of the process (see the module doc).
struct Gen {
    state: Mutex<State>,
    /// `pending.len() + in_flight`: a get, which flushes first, pays a
    /// load or two (not a lock) while no read is pending, the usual case.
    count: AtomicUsize,
    /// Wakes the poller: a read went pending, or a pass left reads.
    wake: Condvar,
    /// A pass ended.
    idle: Condvar,
    /// Whether a poller runs (or is starting) in this generation.
    poller: AtomicBool,
    /// The generation it belongs to.
    generation: u64,
}

static HERE: PerFork<Gen> = PerFork::new(|| Gen {
    state: Mutex::new(State {
        pending: Vec::new(),
        busy: None,
        in_flight: 0,
    }),
    count: AtomicUsize::new(0),
    wake: Condvar::new(),
    idle: Condvar::new(),
    poller: AtomicBool::new(false),
    generation: pinshm::testing::fork_generation(),
});

/// The state of this process's fork generation: in a forked child, on
/// first use, a fresh one, the parent's left as it is (leaked, never
/// locked: its mutex may be held by a thread that is not here).
fn here() -> &'static Gen {
    HERE.get()
}

impl Gen {
    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    fn publish(&self, s: &State) {
        self.count
            .store(s.pending.len() + s.in_flight, Ordering::Release);
    }

    /// Starts a pass: takes the pending reads out.
    fn begin(&'static self, s: &mut State) -> Pass {
        let batch = std::mem::take(&mut s.pending);
        s.busy = Some(std::thread::current().id());
        s.in_flight = batch.len();
        Pass { gen: self, batch }
    }

    fn wait_idle<'a>(&self, s: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.idle
            .wait_timeout(s, POLL_EVERY)
            .unwrap_or_else(|p| p.into_inner())
            .0
    }
}

/// A pass under way: its drop (at its end, or in a panic) puts back the
/// reads still in `batch` (not seen complete), ends the pass, and wakes
/// (starting it if none runs) the poller if reads remain.
struct Pass {
    gen: &'static Gen,
    batch: Vec<Entry>,
}

impl Drop for Pass {
    fn drop(&mut self) {
        let g = self.gen;
        if g.generation != pinshm::testing::fork_generation() {
            // Forked during the pass (from a `query()`): the reads and the
            // state are the parent's, left untouched.
            std::mem::forget(std::mem::take(&mut self.batch));
            return;
        }
        let mut s = g.lock();
        s.pending.append(&mut self.batch);
        s.busy = None;
        s.in_flight = 0;
        g.publish(&s);
        let left = !s.pending.is_empty();
        drop(s);
        g.idle.notify_all();
        if left {
            start_poller(g);
            g.wake.notify_one();
        }
    }
}

/// Queries the reads of `pass`: those completed (or whose query raised:
/// `false`) come out, to be ended (their events dropped here, with the
/// GIL); the rest stay in the pass.
fn query_all(py: Python<'_>, pass: &mut Pass) -> Vec<(Box<dyn Gated>, bool)> {
    let mut done = Vec::new();
    let mut i = 0;
    while i < pass.batch.len() {
        // Taken out only once seen complete: a panic here leaves every
        // other read in the pass, to be put back.
        match completed(py, &pass.batch[i].0) {
            Ok(false) => i += 1,
            outcome => {
                let (event, mut gated) = pass.batch.swap_remove(i);
                let ok = match outcome {
                    Ok(_) => {
                        keeping_exception(py, || gated.completed(py));
                        true
                    }
                    Err(e) => {
                        keeping_exception(py, || gated.failed(py, e, &event));
                        false
                    }
                };
                drop(event);
                done.push((gated, ok));
            }
        }
    }
    done
}

/// Queues `read` until `event` completes, and wakes the poller (starting
/// it if this process has none).
pub(crate) fn pend(event: Py<PyAny>, read: Box<dyn Gated>) {
    let g = here();
    let mut s = g.lock();
    s.pending.push((event, read));
    g.publish(&s);
    drop(s);
    start_poller(g);
    g.wake.notify_one();
}

fn start_poller(g: &'static Gen) {
    if g.poller.swap(true, Ordering::AcqRel) {
        return;
    }
    // Without a poller (no thread to be had), gets and flush_releases
    // still poll: nothing panics, reads end later.
    if std::thread::Builder::new()
        .name("pinshm-release".into())
        .spawn(move || poll(g))
        .is_err()
    {
        g.poller.store(false, Ordering::Release);
    }
}

/// Marks the poller gone if its thread unwinds (a later read starts one).
struct Running(&'static Gen);

impl Drop for Running {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.poller.store(false, Ordering::Release);
        }
    }
}

/// The poller's body (see the module doc). It ends when the interpreter
/// exits or after `IDLE_EXIT` with nothing pending and no pass under way;
/// it is never running in a forked child (threads do not survive a fork),
/// where a new one starts, on the child's own state, if the child gates
/// reads of its own.
fn poll(g: &'static Gen) {
    let _running = Running(g);
    loop {
        let mut pass = {
            let mut s = g.lock();
            loop {
                if crate::gil::exiting() {
                    return;
                }
                if s.busy.is_some() {
                    // A get's pass has the list out: it wakes us (`idle`).
                    s = g.wait_idle(s);
                } else if !s.pending.is_empty() {
                    break;
                } else {
                    let (guard, wait) = g
                        .wake
                        .wait_timeout(s, IDLE_EXIT)
                        .unwrap_or_else(|p| p.into_inner());
                    s = guard;
                    if wait.timed_out() && s.pending.is_empty() && s.busy.is_none() {
                        // Under the lock: a read pended, or left by a
                        // pass, after this starts a new poller (`pend` and
                        // `Pass` look after putting it in).
                        g.poller.store(false, Ordering::Release);
                        return;
                    }
                }
            }
            g.begin(&mut s)
        };
        // Counted in the exit door until the reads are ended (with no
        // GIL; ending one takes no lock).
        let polled = crate::gil::with_gil_unless_exiting_then(
            |py| query_all(py, &mut pass),
            |done| end_all(None, done),
        );
        // The pass ends here, exiting or not: the batch goes back (nothing
        // is ended unasked), and nobody waits for the pass.
        drop(pass);
        let Some(progressed) = polled else {
            return;
        };
        let s = g.lock();
        if !s.pending.is_empty() {
            let every = if progressed { POLL_EVERY } else { POLL_IDLE };
            // A read pended meanwhile wakes us at once.
            drop(g.wake.wait_timeout(s, every));
        }
    }
}

/// Ends every pending read whose event has completed (publishes every
/// save whose event has); returns how many are still pending. Waits (GIL released) for a pass under way, then
/// makes its own, unless called from within a pass (a `query()` or a
/// gate that calls it): then it only counts. Never waits for an event.
/// Once the interpreter is exiting it only counts.
#[pyfunction]
pub(crate) fn flush_releases(py: Python<'_>) -> usize {
    let g = here();
    if g.count() == 0 {
        return 0;
    }
    let me = std::thread::current().id();
    let mut pass = loop {
        if crate::gil::exiting() {
            return g.count();
        }
        let mut s = g.lock();
        match s.busy {
            None => break g.begin(&mut s),
            Some(t) if t == me => return g.count(),
            Some(_) => {
                drop(s);
                // Only waits: the pass begins once the GIL is back (a
                // thread held at the exit door never holds the pass).
                crate::gil::released(py, || {
                    let mut s = g.lock();
                    while s.busy.is_some() && !crate::gil::exiting() {
                        s = g.wait_idle(s);
                    }
                });
            }
        }
    };
    let done = query_all(py, &mut pass);
    // Ends them with the GIL held (ending a read takes no lock; a save
    // takes its store's the way every call of the store does).
    end_all(Some(py), done);
    drop(pass);
    g.count()
}

/// Wakes the poller, starting it if none runs (a reader was closed or
/// dropped: the reads it has pending are polled at once). Calls no Python.
pub(crate) fn nudge() {
    let g = here();
    if g.count() > 0 {
        start_poller(g);
        g.wake.notify_one();
    }
}
