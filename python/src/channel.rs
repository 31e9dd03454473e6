//! `pinshm.Broadcast` and `pinshm.BroadcastReader`: the broadcast channel.
//! Messages are received in place, as in Rust (`recv`, a `MessageView`
//! over the slot: see `message.rs`), or as `bytes` (`recv_bytes`, a copy).
//! `cancel()` is the core's `Canceller`: a futex wake that ends a blocked
//! call at once, from any thread.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use crate::buffer::Buffer;
use crate::handles::BroadcastHandle;
use crate::message::{HeldMessage, MessageView, SharedReader};
use crate::{closed, lock, locked, to_py, Home};

/// A blocking call waits in steps this long, GIL released, and checks for
/// signals (Ctrl-C) between steps. Cancelling does not wait for a step: it
/// wakes the wait.
pub(crate) const STEP: Duration = Duration::from_millis(100);

fn duration(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    timeout
        .map(|t| {
            Duration::try_from_secs_f64(t).map_err(|_| {
                PyValueError::new_err(format!("timeout must be a number of seconds >= 0, not {t}"))
            })
        })
        .transpose()
}

/// Runs `step(d)` (a wait of at most `d` that fails with `Error::Timeout`
/// when nothing came) until it succeeds, `timeout` has passed (then the
/// timeout error names `op` and the whole wait), a signal handler raises,
/// or it fails otherwise (`Error::Cancelled` at once after `cancel()`:
/// CancelledError).
fn wait_loop<R: Send>(
    py: Python<'_>,
    op: &'static str,
    timeout: Option<Duration>,
    mut step: impl FnMut(Duration) -> PyResult<pinshm::Result<R>> + Send,
) -> PyResult<R> {
    // A deadline past what an Instant can hold is no deadline.
    let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
    loop {
        let d = match deadline {
            Some(end) => end.saturating_duration_since(Instant::now()).min(STEP),
            None => STEP,
        };
        let r = crate::gil::released(py, || step(d));
        match r? {
            Ok(r) => return Ok(r),
            Err(pinshm::Error::Timeout { detail, .. }) => {
                if let (Some(end), Some(t)) = (deadline, timeout) {
                    if Instant::now() >= end {
                        return Err(to_py(pinshm::Error::Timeout {
                            op,
                            after: t,
                            detail,
                        }));
                    }
                }
                py.check_signals()?;
            }
            Err(e) => return Err(to_py(e)),
        }
    }
}

/// The writer of a broadcast channel: every message reaches every reader.
#[pyclass(module = "pinshm")]
pub(crate) struct Broadcast {
    inner: Mutex<Option<pinshm::Broadcast>>,
    /// Ends a wait in `send` (another thread) and every later one.
    canceller: pinshm::channel::Canceller,
    home: Home,
    /// Whether this process's reaper was told the segment (`reap=True`).
    reaped: bool,
}

#[pymethods]
impl Broadcast {
    /// Creates a channel for `n_readers` readers, with `slots` slots of
    /// messages up to `slot_size` bytes. Sparse unless `reserve`: it costs
    /// the pages its messages touch, and a full /dev/shm raises
    /// `NoSpaceError` (a `MemoryError`) from that send, never SIGBUS.
    #[new]
    ///
    /// `reap` (default true): this process's reaper removes the segment
    /// after the process dies, SIGKILL included; false leaves it.
    #[pyo3(signature = (n_readers, slots, slot_size, name=None, *, reserve=false, reap=true))]
    fn new(
        py: Python<'_>,
        n_readers: u64,
        slots: u64,
        slot_size: usize,
        name: Option<String>,
        reserve: bool,
        reap: bool,
    ) -> PyResult<Self> {
        // Named here, not a bare OverflowError from the conversion.
        let narrow = |v: u64, what: &str| {
            u32::try_from(v).map_err(|_| {
                to_py(pinshm::Error::InvalidConfig(format!(
                    "{what} is {v}: far more than a channel has (it is a 32-bit count)"
                )))
            })
        };
        let (n_readers, slots) = (narrow(n_readers, "n_readers")?, narrow(slots, "slots")?);
        let mut cfg =
            pinshm::channel::BroadcastConfig::new(n_readers, slots, slot_size).reserve(reserve);
        if let Some(name) = name {
            cfg = cfg.name(name);
        }
        let b = crate::gil::released(py, || pinshm::Broadcast::create(cfg)).map_err(to_py)?;
        if reap {
            crate::reap(py, b.name(), true)?;
        }
        Ok(Broadcast {
            home: Home::new(b.name()),
            canceller: b.canceller(),
            inner: Mutex::new(Some(b)),
            reaped: reap,
        })
    }

    /// Removes the channel's name from /dev/shm now; readers already
    /// attached keep receiving (see the Rust `Broadcast::unlink`).
    fn unlink(&self, py: Python<'_>) -> PyResult<()> {
        locked(py, &self.home, &self.inner, false, |b| match b.as_ref() {
            Some(b) => {
                b.unlink();
                Ok(())
            }
            None => Err(closed("Broadcast")),
        })?
    }

    /// Sends the bytes of `data` to every reader, waiting (GIL released)
    /// while the slot it needs is unreleased; with `timeout` (seconds),
    /// raises pinshm.WaitTimeoutError after that long.
    #[pyo3(signature = (data, timeout=None))]
    fn send(&self, py: Python<'_>, data: &Bound<'_, PyAny>, timeout: Option<f64>) -> PyResult<()> {
        let timeout = duration(timeout)?;
        let buf = Buffer::readable(data)?;
        let bytes = buf.as_slice();
        self.home.not_forked()?;
        wait_loop(py, "send_timeout", timeout, |d| {
            Ok(match crate::lock(&self.inner).as_mut() {
                Some(b) => b.send_timeout(bytes, d),
                None => return Err(closed("Broadcast")),
            })
        })
    }

    /// Sends one message made of the bytes of every object in `parts`
    /// (each exporting a contiguous buffer), in order, copied straight into
    /// the slot: no joined copy first. Waits as `send` does.
    #[pyo3(signature = (parts, timeout=None))]
    fn send_parts(
        &self,
        py: Python<'_>,
        parts: Vec<Bound<'_, PyAny>>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let timeout = duration(timeout)?;
        let bufs = parts
            .iter()
            .map(Buffer::readable)
            .collect::<PyResult<Vec<_>>>()?;
        let slices: Vec<&[u8]> = bufs.iter().map(Buffer::as_slice).collect();
        let len = slices.iter().map(|s| s.len()).sum::<usize>();
        self.home.not_forked()?;
        wait_loop(py, "send_timeout", timeout, |d| {
            Ok(match crate::lock(&self.inner).as_mut() {
                Some(b) => b.send_with_timeout(len, d, |slot| {
                    let mut off = 0;
                    for s in &slices {
                        slot[off..off + s.len()].copy_from_slice(s);
                        off += s.len();
                    }
                }),
                None => return Err(closed("Broadcast")),
            })
        })
    }

    /// Makes a `send` blocked in another thread, and every later one
    /// (`try_send` too), raise pinshm.CancelledError, at once (a futex
    /// wake). For a shutdown; it cannot be undone.
    fn cancel(&self) {
        self.canceller.cancel();
    }

    /// Sends `data` if its slot is free now; False if it would block.
    fn try_send(&self, py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<bool> {
        let buf = Buffer::readable(data)?;
        let bytes = buf.as_slice();
        locked(py, &self.home, &self.inner, false, |b| match b.as_mut() {
            Some(b) => b.try_send(bytes).map_err(to_py),
            None => Err(closed("Broadcast")),
        })?
    }

    /// The readers holding up the next send, as (index, pid) pairs (pid
    /// None: that index never attached); empty when a send would not wait.
    fn blocking_readers(&self, py: Python<'_>) -> PyResult<Vec<(u32, Option<u32>)>> {
        locked(py, &self.home, &self.inner, false, |b| match b.as_mut() {
            Some(b) => Ok(b.blocking_readers()),
            None => Err(closed("Broadcast")),
        })?
    }

    /// How many reader indices have attached since the channel was made,
    /// each counted once (still attached, left or dead).
    #[getter]
    fn attached_readers(&self, py: Python<'_>) -> PyResult<u32> {
        locked(py, &self.home, &self.inner, false, |b| match b.as_ref() {
            Some(b) => b.attached_readers().map_err(to_py),
            None => Err(closed("Broadcast")),
        })?
    }

    /// What a reader process needs to attach (picklable).
    fn handle(&self, py: Python<'_>) -> PyResult<BroadcastHandle> {
        locked(py, &self.home, &self.inner, false, |b| match b.as_ref() {
            Some(b) => Ok(BroadcastHandle(b.handle())),
            None => Err(closed("Broadcast")),
        })?
    }

    /// Messages sent so far.
    #[getter]
    fn sent(&self, py: Python<'_>) -> PyResult<u64> {
        locked(py, &self.home, &self.inner, false, |b| match b.as_ref() {
            Some(b) => Ok(b.sent()),
            None => Err(closed("Broadcast")),
        })?
    }

    /// The channel's segment name.
    #[getter]
    fn name(&self) -> &str {
        &self.home.name
    }

    /// Closes the channel: readers receive what was sent, then
    /// WriterGoneError. Closing twice does nothing, and so does closing in a
    /// forked child (the channel is the parent's).
    fn close(&self, py: Python<'_>) {
        crate::close_in(py, &self.home, &self.inner);
        if self.reaped && !self.home.forked() {
            let _ = crate::reap(py, &self.home.name, false);
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        format!("Broadcast(name={:?})", self.home.name)
    }
}

/// One reader of a broadcast channel.
#[pyclass(module = "pinshm")]
pub(crate) struct BroadcastReader {
    /// Locked only to clone or take the `Arc`, never across a call: a view
    /// held keeps the reader attached after `close()`.
    shared: Mutex<Option<Arc<SharedReader>>>,
    /// Ends a wait in `recv` (another thread) and every later one.
    canceller: pinshm::channel::Canceller,
    index: u32,
    home: Home,
}

impl BroadcastReader {
    fn shared(&self) -> PyResult<Arc<SharedReader>> {
        self.home.not_forked()?;
        lock(&self.shared)
            .clone()
            .ok_or_else(|| closed("BroadcastReader"))
    }
}

#[pymethods]
impl BroadcastReader {
    /// Attaches to the channel of `handle` as reader `index` (default: the
    /// first free one).
    #[staticmethod]
    #[pyo3(signature = (handle, index=None))]
    fn attach(py: Python<'_>, handle: BroadcastHandle, index: Option<u32>) -> PyResult<Self> {
        let h = handle.0;
        let r = crate::gil::released(py, || match index {
            Some(i) => pinshm::BroadcastReader::attach_as(&h, i),
            None => pinshm::BroadcastReader::attach(&h),
        })
        .map_err(to_py)?;
        Ok(BroadcastReader {
            index: r.index(),
            home: Home::new(r.name()),
            canceller: r.canceller(),
            shared: Mutex::new(Some(Arc::new(SharedReader::new(r)))),
        })
    }

    /// The next message in place, with no copy: a `MessageView` exporting
    /// the slot's bytes (read-only) through the buffer protocol, holding
    /// the message (the writer cannot reuse its slot) until it is released
    /// and every export of it is gone. Waits with the GIL released; with
    /// `timeout` (seconds), raises pinshm.WaitTimeoutError after that long.
    /// After the writer has gone and every message was received:
    /// WriterGoneError.
    #[pyo3(signature = (timeout=None))]
    fn recv(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<MessageView> {
        let timeout = duration(timeout)?;
        let shared = self.shared()?;
        let held = wait_loop(py, "recv_timeout", timeout, |d| {
            let r = shared.lock();
            Ok(r.recv_timeout(d).map(|m| HeldMessage::new(&shared, m)))
        })?;
        Ok(MessageView::new(held))
    }

    /// The next message as `bytes` (a copy; the slot is released before
    /// return). Waits as `recv` does.
    #[pyo3(signature = (timeout=None))]
    fn recv_bytes<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let timeout = duration(timeout)?;
        let shared = self.shared()?;
        let msg = wait_loop(py, "recv_timeout", timeout, |d| {
            Ok(shared.lock().recv_timeout(d).map(|m| m.to_vec()))
        })?;
        Ok(PyBytes::new(py, &msg))
    }

    /// Makes a `recv` blocked in another thread, and every later one
    /// (`try_recv` and the `_bytes` forms too), raise pinshm.CancelledError, at
    /// once (a futex wake). For a shutdown; it cannot be undone.
    fn cancel(&self) {
        self.canceller.cancel();
    }

    /// The next message in place (as `recv`) if one is there, else None.
    fn try_recv(&self, py: Python<'_>) -> PyResult<Option<MessageView>> {
        let shared = self.shared()?;
        let take = |r: &pinshm::BroadcastReader| {
            r.try_recv()
                .map(|m| m.map(|m| HeldMessage::new(&shared, m)))
        };
        // The GIL is released only if another call holds the reader.
        let held = match shared.try_lock() {
            Some(r) => take(&r),
            None => crate::gil::released(py, || take(&shared.lock())),
        }
        .map_err(to_py)?;
        Ok(held.map(MessageView::new))
    }

    /// Whether `recv` would return at once: a message is there that this
    /// reader has not received, or the writer closed the channel. A peek
    /// at the writer's sequence number: it takes nothing (no slot held, no
    /// release owed). pinshm.CancelledError after `cancel()`.
    fn ready(&self, py: Python<'_>) -> PyResult<bool> {
        let shared = self.shared()?;
        // The GIL is released only if another call holds the reader.
        let ready = match shared.try_lock() {
            Some(r) => r.is_ready(),
            None => crate::gil::released(py, || shared.lock().is_ready()),
        };
        ready.map_err(to_py)
    }

    /// Waits, with the GIL released, until `ready()` would say True, for
    /// at most `timeout` seconds, taking nothing: True once a message is
    /// there or the writer is gone (closed or dead), False when the time
    /// is up. Sleeps on the channel's futex (a message sent meanwhile
    /// always wakes it); never spins. pinshm.CancelledError after, or
    /// during, `cancel()`.
    fn wait_ready(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let timeout = duration(Some(timeout))?.unwrap_or_default();
        let shared = self.shared()?;
        let deadline = Instant::now().checked_add(timeout);
        loop {
            let d = deadline.map_or(STEP, |end| {
                end.saturating_duration_since(Instant::now()).min(STEP)
            });
            let ready = crate::gil::released(py, || shared.lock().wait_ready(d)).map_err(to_py)?;
            if ready || deadline.is_some_and(|end| Instant::now() >= end) {
                return Ok(ready);
            }
            py.check_signals()?;
        }
    }

    /// The next message as `bytes` (a copy) if one is there, else None.
    fn try_recv_bytes<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let shared = self.shared()?;
        let copy = |r: &pinshm::BroadcastReader| r.try_recv().map(|m| m.map(|m| m.to_vec()));
        // The GIL is released only if another call holds the reader.
        let msg = match shared.try_lock() {
            Some(r) => copy(&r),
            None => crate::gil::released(py, || copy(&shared.lock())),
        }
        .map_err(to_py)?;
        Ok(msg.map(|m| PyBytes::new(py, &m)))
    }

    /// How this reader's receives found their messages so far, as a dict
    /// of counts: "ready" (there already), "spin" (the short spin),
    /// "early" and "window" (around a predicted arrival), "sleep" (a futex
    /// wake-up), "gave_up" (timed out or cancelled; a wait in steps counts
    /// each step). A receive blocked in another thread is waited for.
    fn wait_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let shared = self.shared()?;
        let s = crate::gil::released(py, || shared.lock().wait_stats());
        let d = PyDict::new(py);
        for (k, v) in [
            ("ready", s.ready),
            ("spin", s.spin),
            ("early", s.early),
            ("window", s.window),
            ("sleep", s.sleep),
            ("gave_up", s.gave_up),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// This reader's index.
    #[getter]
    fn index(&self) -> u32 {
        self.index
    }

    /// The channel's segment name.
    #[getter]
    fn name(&self) -> &str {
        &self.home.name
    }

    /// Detaches (once every `MessageView` of it is released too). Closing
    /// twice does nothing, and so does closing in a forked child (the
    /// reader is the parent's).
    fn close(&self, py: Python<'_>) {
        if self.home.forked() {
            return;
        }
        let shared = lock(&self.shared).take();
        crate::gil::released(py, || drop(shared));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "BroadcastReader(name={:?}, index={})",
            self.home.name, self.index
        )
    }
}
