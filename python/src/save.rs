//! `pinshm.PendingSave`: a reservation published when an event completes
//! (`ObjectStore.publish_after`), so that a device-to-host save never
//! waits inside the caller's step.
//!
//! The save waits in the release poller (`crate::release`), beside gated
//! reads: the poller (or a flush: any get, `flush_releases()`,
//! `ObjectStore.flush_pending()`, `PendingSave.wait()`) queries the event
//! and, once `query()` is true, publishes the reservation through the
//! core's pending put (`pinshm::ObjectStore::publish`); if `query()`
//! raises, the reservation is aborted (`pinshm::ObjectStore::abort`): its
//! key and slot are free at once. Nothing else publishes it:
//! - not a drop: a `PendingSave` dropped changes nothing; a `SaveGate`
//!   dropped without its event completing (never, but for a panic)
//!   leaks its reservation, so that the slot, which a copy may still be
//!   writing, is never reused and never published;
//! - not a forked child: the poller's state is per fork generation, so a
//!   child never queries (nor ends) its parent's saves, and a gate that
//!   finds itself in a child (forked from a `query()`) leaves everything
//!   as it is; the core refuses a child's publish besides.
//!
//! A store closed (or dropped) with saves pending publishes none of them:
//! each is discarded once its event completes (its reservation, which
//! keeps the mapping the copy writes into, lives until then).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::{PinshmError, WaitTimeoutError};
use crate::handles::ObjectHandle;
use crate::release::Gated;
use crate::{lock, Home};

/// The writer a save publishes into, shared with the `ObjectStore` object.
pub(crate) type Shared = Arc<Mutex<Option<pinshm::ObjectStore>>>;

/// How often `wait` and `flush_pending` poll the events they wait for.
const POLL: Duration = Duration::from_millis(1);

/// Where a save stands.
#[derive(Clone, Debug)]
enum Status {
    Pending,
    Published(pinshm::store::ObjectHandle),
    /// The copy failed (its event's query raised) or the publish did (the
    /// store cleared meanwhile): the key and slot are free.
    Failed(String),
    /// The store was closed before the copy completed: nothing published.
    Discarded,
}

/// A save's status, shared by its `PendingSave` and its gate; counted in
/// its store's pending saves until it leaves `Pending`.
struct SaveState {
    status: Mutex<Status>,
    store_pending: Arc<AtomicUsize>,
}

impl SaveState {
    fn status(&self) -> Status {
        lock(&self.status).clone()
    }

    /// Leaves `Pending` (once).
    fn finish(&self, to: Status) {
        let mut st = lock(&self.status);
        if matches!(*st, Status::Pending) {
            *st = to;
            drop(st);
            self.store_pending.fetch_sub(1, Ordering::Release);
        }
    }
}

/// A save waiting in the release poller for its event.
struct SaveGate {
    store: Weak<Mutex<Option<pinshm::ObjectStore>>>,
    home: Home,
    /// `None` once ended.
    res: Option<pinshm::store::Reservation>,
    /// A buffer the copy wrote instead of the slot (pinned staging, for a
    /// store whose mapping is not pinned): copied into the slot once the
    /// event has completed. `None` once copied.
    staged: Option<Py<PyAny>>,
    /// What the event's query raised, or why the staged bytes could not
    /// be copied.
    error: Option<String>,
    state: Arc<SaveState>,
}

impl SaveGate {
    /// Publishes (`ok`) or aborts the reservation in `store`.
    fn settle(
        res: pinshm::store::Reservation,
        store: &mut Option<pinshm::ObjectStore>,
        ok: bool,
        error: Option<String>,
    ) -> Status {
        match store {
            None => {
                drop(res);
                Status::Discarded
            }
            Some(s) if ok => match s.publish(res) {
                Ok(h) => Status::Published(h),
                Err(e) => Status::Failed(e.to_string()),
            },
            Some(s) => {
                s.abort(res);
                Status::Failed(error.unwrap_or_else(|| "the copy failed".into()))
            }
        }
    }
}

impl Gated for SaveGate {
    fn failed(&mut self, _py: Python<'_>, e: PyErr, _event: &Py<PyAny>) {
        self.error = Some(format!("the copy's event raised {e}"));
    }

    fn completed(&mut self, py: Python<'_>) {
        let Some(staged) = self.staged.take() else {
            return;
        };
        if self.home.forked() {
            std::mem::forget(staged);
            return;
        }
        let Some(res) = self.res.as_mut() else {
            return;
        };
        match crate::buffer::Buffer::readable(staged.bind(py)) {
            Ok(buf) if buf.len() == res.len() => {
                let (src, dst) = (buf.as_slice(), res.bytes_mut());
                // Off the GIL: a copy of megabytes, on the poller's time.
                crate::gil::released(py, || dst.copy_from_slice(src));
            }
            Ok(buf) => {
                self.error = Some(format!(
                    "the staged buffer is {} bytes, the reservation {}",
                    buf.len(),
                    res.len()
                ))
            }
            Err(e) => self.error = Some(format!("the staged buffer refused its bytes: {e}")),
        }
    }

    fn end(mut self: Box<Self>, py: Option<Python<'_>>, ok: bool) {
        if self.home.forked() {
            // A child forked inside a pass: the save is the parent's.
            std::mem::forget(self);
            return;
        }
        let res = self.res.take().expect("a save ends once");
        let error = self.error.take();
        // Staged bytes that could not be copied fail the save.
        let ok = ok && error.is_none();
        let status = match self.store.upgrade() {
            None => {
                drop(res);
                Status::Discarded
            }
            Some(store) => match py {
                // As every call of the store locks it (crate::locked).
                Some(py) => crate::locked(py, &self.home, &*store, false, move |s| {
                    SaveGate::settle(res, s, ok, error)
                })
                .unwrap_or(Status::Discarded),
                None => SaveGate::settle(res, &mut lock(&store), ok, error),
            },
        };
        self.state.finish(status);
    }
}

impl Drop for SaveGate {
    fn drop(&mut self) {
        if let Some(res) = self.res.take() {
            // Never ended: its copy may still write the slot. Leaked, the
            // reservation keeps the slot (and the mapping) for good.
            std::mem::forget(res);
            if !self.home.forked() {
                self.state.finish(Status::Discarded);
            }
        }
    }
}

/// A save whose copy may still be in flight (`ObjectStore.publish_after`,
/// `pinshm.device.put_tensor(..., wait=False)`): its key is pending
/// (`ObjectStore.is_pending`) until the copy's event completes, then
/// published; readers and `is_cached` miss it until then. Dropping this
/// object changes nothing: the save goes on.
#[pyclass(module = "pinshm", frozen)]
pub(crate) struct PendingSave {
    key: String,
    state: Arc<SaveState>,
    home: Home,
}

impl PendingSave {
    /// A save of `key` published already (the copy was done when asked).
    pub(crate) fn published(key: &str, h: pinshm::store::ObjectHandle, name: &str) -> PendingSave {
        PendingSave {
            key: key.to_owned(),
            state: Arc::new(SaveState {
                status: Mutex::new(Status::Published(h)),
                store_pending: Arc::new(AtomicUsize::new(0)),
            }),
            home: Home::new(name),
        }
    }

    /// Queues `res` (of `key`, in `store`, whose pending saves `pending`
    /// counts) until `event` completes.
    pub(crate) fn start(
        key: &str,
        res: pinshm::store::Reservation,
        event: Py<PyAny>,
        staged: Option<Py<PyAny>>,
        store: &Shared,
        pending: &Arc<AtomicUsize>,
        name: &str,
    ) -> PendingSave {
        pending.fetch_add(1, Ordering::AcqRel);
        let state = Arc::new(SaveState {
            status: Mutex::new(Status::Pending),
            store_pending: Arc::clone(pending),
        });
        crate::release::pend(
            event,
            Box::new(SaveGate {
                store: Arc::downgrade(store),
                home: Home::new(name),
                res: Some(res),
                staged,
                error: None,
                state: Arc::clone(&state),
            }),
        );
        PendingSave {
            key: key.to_owned(),
            state,
            home: Home::new(name),
        }
    }

    fn status(&self) -> PyResult<Status> {
        self.home.not_forked()?;
        Ok(self.state.status())
    }
}

/// Polls the release poller's events until `done()` or `timeout` seconds
/// (None: no limit); whether `done()` held at the end. The GIL is let go
/// between polls; a signal (Ctrl-C) raises.
pub(crate) fn wait_until(
    py: Python<'_>,
    timeout: Option<f64>,
    done: impl Fn() -> bool,
) -> PyResult<bool> {
    let deadline = match timeout {
        None => None,
        Some(t) if t.is_finite() && t >= 0.0 => Some(Instant::now() + Duration::from_secs_f64(t)),
        Some(t) => {
            return Err(PyValueError::new_err(format!(
                "timeout must be a finite number of seconds >= 0 or None, not {t}"
            )))
        }
    };
    loop {
        if done() {
            return Ok(true);
        }
        crate::release::flush_releases(py);
        if done() {
            return Ok(true);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(false);
        }
        py.check_signals()?;
        crate::gil::released(py, || std::thread::sleep(POLL));
    }
}

#[pymethods]
impl PendingSave {
    /// The key saved.
    #[getter]
    fn key(&self) -> &str {
        &self.key
    }

    /// "pending" (the copy may be in flight), "published", "failed" (the
    /// copy failed or the store was cleared: nothing published, key and
    /// slot free) or "discarded" (the store was closed first).
    #[getter]
    fn state(&self) -> PyResult<&'static str> {
        Ok(match self.status()? {
            Status::Pending => "pending",
            Status::Published(_) => "published",
            Status::Failed(_) => "failed",
            Status::Discarded => "discarded",
        })
    }

    /// Whether the save is over (published, failed or discarded).
    #[getter]
    fn done(&self) -> PyResult<bool> {
        Ok(!matches!(self.status()?, Status::Pending))
    }

    /// The handle, once published; None before or if it failed.
    #[getter]
    fn handle(&self) -> PyResult<Option<ObjectHandle>> {
        Ok(match self.status()? {
            Status::Published(h) => Some(ObjectHandle(h)),
            _ => None,
        })
    }

    /// Why it failed, if it did.
    #[getter]
    fn error(&self) -> PyResult<Option<String>> {
        Ok(match self.status()? {
            Status::Failed(e) => Some(e),
            _ => None,
        })
    }

    /// Waits until the save is over (polling its event, the GIL let go
    /// between polls), at most `timeout` seconds (None: no limit), and
    /// returns its handle. PinshmError if it failed or was discarded,
    /// WaitTimeoutError if still pending after `timeout`; in a forked
    /// child, PinshmError (the save is the parent's).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<ObjectHandle> {
        self.home.not_forked()?;
        let state = &self.state;
        wait_until(py, timeout, || !matches!(state.status(), Status::Pending))?;
        match state.status() {
            Status::Published(h) => Ok(ObjectHandle(h)),
            Status::Failed(e) => Err(PinshmError::new_err(format!(
                "the save of key '{}' failed: {e}",
                self.key
            ))),
            Status::Discarded => Err(PinshmError::new_err(format!(
                "the save of key '{}' was discarded: its store was closed before the copy completed",
                self.key
            ))),
            Status::Pending => Err(PyErr::new::<WaitTimeoutError, _>(format!(
                "the save of key '{}' is still pending after {} s",
                self.key,
                timeout.unwrap_or(0.0)
            ))),
        }
    }

    fn __repr__(&self) -> String {
        let state = if self.home.forked() {
            "state='forked'".to_owned()
        } else {
            match self.state.status() {
                Status::Pending => "state='pending'".to_owned(),
                Status::Published(h) => format!(
                    "state='published', address={}, monotonic_id={}",
                    h.address, h.monotonic_id
                ),
                Status::Failed(e) => format!("state='failed', error={e:?}"),
                Status::Discarded => "state='discarded'".to_owned(),
            }
        };
        format!("PendingSave(key={:?}, {state})", self.key)
    }
}
