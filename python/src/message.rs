//! `pinshm.MessageView`: a channel message received in place, exported
//! through the buffer protocol with no copy (`BroadcastReader.recv`).
//!
//! The reader lives in an `Arc` (`SharedReader`), behind a mutex. A held
//! message (`HeldMessage`) owns the core's message, which owns its share of
//! the reader's attachment: it needs no borrow of the reader, and its
//! release takes no lock a receive holds, so a view dropped by one thread
//! while another waits in `recv` releases its slot at once. A
//! `HeldMessage` is shared, in an `Arc`, by the Python `MessageView` and by
//! each buffer export of it (`_MessageExport`, the export's `view.obj`):
//! the message is released when the last of them goes.

use std::os::raw::c_int;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::{lock, Home};

/// A reader shared by the Python `BroadcastReader` and the messages held
/// from it (for its `Home`).
pub(crate) struct SharedReader {
    reader: Mutex<pinshm::BroadcastReader>,
    /// The process that attached it.
    pub(crate) home: Home,
}

impl SharedReader {
    pub(crate) fn new(reader: pinshm::BroadcastReader) -> SharedReader {
        SharedReader {
            home: Home::new(reader.name()),
            reader: Mutex::new(reader),
        }
    }

    /// Locks the reader.
    pub(crate) fn lock(&self) -> MutexGuard<'_, pinshm::BroadcastReader> {
        lock(&self.reader)
    }

    /// As `lock`, or `None` if another call holds the reader now.
    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, pinshm::BroadcastReader>> {
        match self.reader.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }
}

/// One message held open: the core's message and its bytes.
pub(crate) struct HeldMessage {
    /// Released when this drops (the core's drop, from any thread).
    msg: pinshm::channel::Message,
    reader: Arc<SharedReader>,
}

impl HeldMessage {
    /// Wraps a message received from `shared`'s reader.
    pub(crate) fn new(shared: &Arc<SharedReader>, msg: pinshm::channel::Message) -> HeldMessage {
        HeldMessage {
            msg,
            reader: Arc::clone(shared),
        }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.msg
    }
}

/// The owner of one buffer export of a `MessageView`: what the exported
/// `Py_buffer`'s `obj` points to, holding the message for as long as a
/// consumer keeps it (as `reader.rs`'s `_SlotExport` does).
#[pyclass(module = "pinshm", frozen, name = "_MessageExport")]
pub(crate) struct MessageExport {
    _held: Arc<HeldMessage>,
}

/// A channel message received in place (`BroadcastReader.recv`): its
/// bytes, read-only, through the buffer protocol (`memoryview(v)`,
/// `pickle.loads(v)`, `numpy.frombuffer(v, ...)`), with no copy. While it
/// is held the writer cannot reuse its slot (a channel has a few slots: a
/// view held long stalls the writer). `release()` (or the end of a `with`
/// block) releases it, and refuses with BufferError while an export is
/// alive; garbage collection releases it too.
#[pyclass(module = "pinshm", frozen)]
pub(crate) struct MessageView {
    seq: u64,
    len: usize,
    held: Mutex<Option<Arc<HeldMessage>>>,
}

impl MessageView {
    pub(crate) fn new(held: HeldMessage) -> MessageView {
        MessageView {
            seq: held.msg.seq(),
            len: held.msg.len(),
            held: Mutex::new(Some(Arc::new(held))),
        }
    }

    fn hold(&self, err: fn(&'static str) -> PyErr) -> PyResult<Arc<HeldMessage>> {
        let held = lock(&self.held)
            .clone()
            .ok_or_else(|| err("the MessageView has been released"))?;
        held.reader.home.not_forked()?;
        Ok(held)
    }
}

#[pymethods]
impl MessageView {
    /// The message's sequence number (0 for the channel's first).
    #[getter]
    fn seq(&self) -> u64 {
        self.seq
    }

    /// Whether the view's own hold has been released.
    #[getter]
    fn released(&self) -> bool {
        lock(&self.held).is_none()
    }

    /// Releases the message. BufferError while exports of the view are
    /// alive; releasing twice does nothing.
    fn release(&self) -> PyResult<()> {
        // Dropped outside the mutex (the message's drop may lock the reader).
        drop(crate::buffer::take_unshared(&self.held, "MessageView")?);
        Ok(())
    }

    /// A copy of the bytes.
    fn __bytes__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let held = self.hold(PyValueError::new_err)?;
        Ok(PyBytes::new(py, held.bytes()))
    }

    fn __len__(&self) -> usize {
        self.len
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Releases the message; leaving by an exception never raises here
    /// (exports still alive keep the message until they go).
    #[pyo3(signature = (exc_type=None, _exc=None, _tb=None))]
    fn __exit__(
        &self,
        exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        if exc_type.is_some_and(|t| !t.is_none()) {
            drop(lock(&self.held).take());
        } else {
            self.release()?;
        }
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let state = if self.released() { ", released" } else { "" };
        format!("MessageView(seq={}, len={}{state})", self.seq, self.len)
    }

    /// # Safety
    /// Called by Python with a `Py_buffer` to fill (`view`), per the buffer
    /// protocol.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let held = slf.get().hold(PyBufferError::new_err)?;
        let (data, len) = (held.msg.as_ptr(), held.msg.len());
        let owner = Bound::new(slf.py(), MessageExport { _held: held })?;
        // SAFETY: `view` is the Py_buffer Python asked us to fill; the bytes
        // stay valid, and unwritten, while the message is held, which
        // `owner` does (a clone of the `Arc<HeldMessage>`) for as long as it
        // lives.
        unsafe {
            crate::buffer::export_read_only(owner.into_any(), view, flags, data, len, "MessageView")
        }
    }

    /// # Safety
    /// Never called (an export's `view.obj` is its `_MessageExport`); it
    /// gives the type a `bf_releasebuffer`, so numpy.frombuffer keeps a
    /// memoryview (holding the export's owner) as the array's base, as for
    /// `ReadGuard`.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}
