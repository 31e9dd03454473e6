//! Releases gated on a device: `set_release_gate`.
//!
//! A read's last view may go while an asynchronous copy from it (a
//! host-to-device DMA out of a pinned slot) is still in flight: torch
//! records events only for blocks of its own pinned allocator, so the slot
//! must not be reused until the copy is done. With a gate set, when a
//! read's last view goes the binding asks the gate for an event (an object
//! with `query() -> bool`, e.g. a `torch.cuda.Event` just recorded on the
//! current stream) and acknowledges the read only once the event has
//! completed: pending reads are polled on later gets (and by
//! `flush_releases`), never waited for. A gate that returns None releases
//! at once. Nothing changes while no gate is set.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use pyo3::prelude::*;

/// Whether a gate is set: a read's drop checks only this when none is.
static SET: AtomicBool = AtomicBool::new(false);
static GATE: Mutex<Option<Py<PyAny>>> = Mutex::new(None);

/// Sets (or, with None, clears) the release gate: a callable taking no
/// arguments, called when a read's last view goes, returning None (release
/// now) or an event with `query()` (release once it returns true).
#[pyfunction]
#[pyo3(signature = (gate))]
pub(crate) fn set_release_gate(gate: Option<Py<PyAny>>) {
    let mut g = crate::lock(&GATE);
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
        let gate = crate::lock(&GATE).as_ref().map(|g| g.clone_ref(py))?;
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
pub(crate) fn completed(py: Python<'_>, event: &Py<PyAny>) -> bool {
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
