//! `pinshm._pinshm`: the Python binding of pinshm, a thin layer over the
//! crate's public API (re-exported by the pure-Python package `pinshm`).
//!
//! Threads and the GIL. Every Rust object is kept behind a `Mutex` (the
//! readers and writers are `Send`, not `Sync`), so a Python object used from
//! two threads works, serialised, and is never a data race. One rule keeps
//! this free of deadlocks: a thread never waits for the GIL while it holds
//! one of these mutexes. Short operations lock with the GIL held, and only
//! when the mutex is free (`try_lock`); otherwise, and for every copy and
//! every wait, they release the GIL first and lock inside `gil::released`
//! (`allow_threads`, made safe at interpreter exit).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(unreachable_pub)]

use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

mod buffer;
mod cache;
mod channel;
mod digest;
mod errors;
mod gil;
mod handles;
mod message;
mod per_fork;
mod private;
mod reader;
mod release;
mod sandbox;
mod save;
mod store;
mod tensor;
mod tools;

pub(crate) use errors::to_py;

/// The pin mode named `s` ("auto", "off", "require").
pub(crate) fn pin_mode(s: &str) -> PyResult<pinshm::device::PinMode> {
    match s {
        "auto" => Ok(pinshm::device::PinMode::Auto),
        "off" => Ok(pinshm::device::PinMode::Off),
        "require" => Ok(pinshm::device::PinMode::Require),
        other => Err(PyValueError::new_err(format!(
            "pin must be 'auto', 'off' or 'require', not {other:?}"
        ))),
    }
}

/// `ValueError` for an operation on a closed object (as on a closed file).
pub(crate) fn closed(what: &str) -> PyErr {
    PyValueError::new_err(format!("operation on a closed {what}"))
}

/// Where an object was made: its process's fork generation (the crate's
/// `pthread_atfork` counter, which changes in every forked child: one
/// relaxed load to check, where a pid would be a system call) and its
/// segment's name.
pub(crate) struct Home {
    generation: u64,
    pub(crate) name: String,
}

impl Home {
    /// An object of segment `name`, made in this process.
    pub(crate) fn new(name: &str) -> Home {
        Home {
            generation: pinshm::testing::fork_generation(),
            name: name.to_owned(),
        }
    }

    /// Whether this is a forked child of the process that made the object.
    pub(crate) fn forked(&self) -> bool {
        pinshm::testing::fork_generation() != self.generation
    }

    /// Fails with the Forked error (`PinshmError`, as the core's
    /// `Error::Forked` maps) in a forked child: an object made before a
    /// `fork()` reads and locks nothing in the child. The core refuses too,
    /// but only once locked: this check comes first, because a mutex that
    /// a thread of the parent held at the fork stays locked in the child
    /// forever (that thread does not exist there).
    pub(crate) fn not_forked(&self) -> PyResult<()> {
        if self.forked() {
            Err(to_py(pinshm::Error::Forked {
                name: self.name.clone(),
            }))
        } else {
            Ok(())
        }
    }
}

/// Locks `m`. A poisoned mutex (a panic while it was held, which the core
/// does not do) is taken as it is: every object here stays consistent
/// when one of its calls unwinds.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `f` on the contents of `m`: with the GIL held if the mutex is free
/// and `release_gil` is false, else with the GIL released (a copy or a wait,
/// or another thread holds the mutex: see the module docs). In a forked
/// child of `home`'s process, the Forked error, before locking.
pub(crate) fn locked<T: Send, R: Send>(
    py: Python<'_>,
    home: &Home,
    m: &Mutex<T>,
    release_gil: bool,
    f: impl FnOnce(&mut T) -> R + Send,
) -> PyResult<R> {
    home.not_forked()?;
    if !release_gil {
        match m.try_lock() {
            Ok(mut g) => return Ok(f(&mut g)),
            Err(TryLockError::Poisoned(p)) => return Ok(f(&mut p.into_inner())),
            Err(TryLockError::WouldBlock) => {}
        }
    }
    Ok(crate::gil::released(py, || f(&mut lock(m))))
}

/// `close()` of an object kept as `Mutex<Option<T>>`: takes it out and
/// drops it with the GIL released (unmapping a large segment takes a
/// while). Closing twice does nothing, and so does closing in a forked
/// child (the object is the parent's).
pub(crate) fn close_in<T: Send>(py: Python<'_>, home: &Home, m: &Mutex<Option<T>>) {
    if let Ok(Some(t)) = locked(py, home, m, false, Option::take) {
        gil::released(py, || drop(t));
    }
}

/// Tells this process's reaper (`pinshm._node.tracker`, the one every
/// engine adapter uses) segment `name` (`add`), or takes it back: a Python
/// writer's segment is then removed after the process dies, SIGKILL
/// included. Best effort: where the reaper cannot start, `pinshm gc`
/// removes what is left; only an interrupt (KeyboardInterrupt,
/// SystemExit: not an `Exception`) comes back, to be raised.
pub(crate) fn reap(py: Python<'_>, name: &str, add: bool) -> PyResult<()> {
    let call = py
        .import("pinshm._node.tracker")
        .and_then(|m| m.call_method1(if add { "track" } else { "untrack" }, (name,)));
    match call {
        // A failure costs only the cleanup after a kill; the store works.
        Err(e) if !e.is_instance_of::<pyo3::exceptions::PyException>(py) => Err(e),
        _ => Ok(()),
    }
}

/// The native module, re-exported by `pinshm/__init__.py`.
#[pymodule]
fn _pinshm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::add_to(m)?;
    m.add_class::<handles::ObjectHandle>()?;
    m.add_class::<handles::StoreHandle>()?;
    m.add_class::<handles::BroadcastHandle>()?;
    m.add_class::<store::ObjectStore>()?;
    m.add_class::<reader::StoreReader>()?;
    m.add_class::<reader::ReadGuard>()?;
    m.add_class::<private::PrivateView>()?;
    m.add_class::<cache::Lease>()?;
    m.add_class::<cache::TensorReservation>()?;
    m.add_class::<save::PendingSave>()?;
    m.add_class::<channel::Broadcast>()?;
    m.add_class::<channel::BroadcastReader>()?;
    m.add_class::<message::MessageView>()?;
    m.add_function(wrap_pyfunction!(handles::signature_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(release::set_release_gate, m)?)?;
    m.add_function(wrap_pyfunction!(release::flush_releases, m)?)?;
    m.add_function(wrap_pyfunction!(release::has_release_gate, m)?)?;
    m.add_function(wrap_pyfunction!(digest::digest, m)?)?;
    m.add_function(wrap_pyfunction!(sandbox::sandbox, m)?)?;
    m.add_function(wrap_pyfunction!(sandbox::drop_uid, m)?)?;
    m.add_class::<digest::Digest>()?;
    m.add_function(wrap_pyfunction!(tools::inspect_segment, m)?)?;
    m.add_function(wrap_pyfunction!(tools::cuda_status, m)?)?;
    m.add_function(wrap_pyfunction!(tools::gc_segments, m)?)?;
    m.add_function(wrap_pyfunction!(tools::remove_if_abandoned_file, m)?)?;
    m.add_function(wrap_pyfunction!(gil::exit_door_passing, m)?)?;
    py.import("atexit")?
        .call_method1("register", (wrap_pyfunction!(gil::at_exit, m)?,))?;
    Ok(())
}
