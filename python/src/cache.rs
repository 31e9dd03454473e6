//! `pinshm.Lease` (an object kept for a reader that has not read it) and
//! `pinshm.TensorReservation` (a slot whose bytes Python writes, torch's
//! device-to-host copy say, before the writer publishes it).

use std::os::raw::c_int;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::handles::ObjectHandle;
use crate::{lock, Home};

/// A lease: the object stays in the store, unread, until `release()` (or
/// the end of a `with` block, or garbage collection). Leases of a process
/// that dies count for nothing.
#[pyclass(module = "pinshm", frozen)]
pub(crate) struct Lease {
    handle: pinshm::store::ObjectHandle,
    inner: Mutex<Option<pinshm::store::Lease>>,
}

impl Lease {
    pub(crate) fn new(l: pinshm::store::Lease) -> Lease {
        Lease {
            handle: l.handle(),
            inner: Mutex::new(Some(l)),
        }
    }
}

#[pymethods]
impl Lease {
    /// The handle of the leased object.
    #[getter]
    fn handle(&self) -> ObjectHandle {
        ObjectHandle(self.handle)
    }

    /// Whether the lease has ended.
    #[getter]
    fn released(&self) -> bool {
        lock(&self.inner).is_none()
    }

    /// Ends the lease; again does nothing. In a forked child the lease is
    /// the parent's: there this forgets it and releases nothing (the
    /// core's drop touches nothing shared in a child).
    fn release(&self) {
        drop(lock(&self.inner).take());
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, PyTuple>) -> bool {
        self.release();
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "Lease(address={}, monotonic_id={}, released={})",
            self.handle.address,
            self.handle.monotonic_id,
            self.released()
        )
    }
}

/// A reservation behind a mutex, shared with each export of its bytes.
pub(crate) struct Reserved {
    pub(crate) res: Mutex<pinshm::store::Reservation>,
    data: *mut u8,
    len: usize,
}

// SAFETY: `data` points into the mapping the reservation keeps alive, and
// `Reservation` is `Send`; the bytes are written only through exports,
// which Python code serialises as it likes (they are plain bytes nobody
// else reads until the reservation is published, which needs no export
// to be alive).
unsafe impl Send for Reserved {}
// SAFETY: as above; through `&Reserved` nothing but the pointer is read.
unsafe impl Sync for Reserved {}

/// The owner of one writable export of a reservation (`view.obj`).
#[pyclass(module = "pinshm", frozen, name = "_ReservationExport")]
pub(crate) struct ReservationExport {
    _res: Arc<Reserved>,
}

/// A slot reserved by `ObjectStore.reserve_tensor`: write the tensor's
/// bytes through the buffer protocol (writable: `memoryview(r)`,
/// `numpy.frombuffer(r, ...)`, `torch.frombuffer(r, ...)`), then
/// `ObjectStore.publish(r)` (or `publish_after(r, event)`). Readers see
/// nothing until then. Publishing raises BufferError while an export of
/// it is alive. Given back unpublished (`abort()`, `ObjectStore.abort(r)`,
/// or garbage collection), its key is free at once and the slot is
/// reclaimed (at once by `ObjectStore.abort`, else in turn).
#[pyclass(module = "pinshm", frozen)]
pub(crate) struct TensorReservation {
    /// `None` once published or aborted.
    pub(crate) held: Mutex<Option<Arc<Reserved>>>,
    /// The key it is reserved under.
    pub(crate) key: String,
    dtype: &'static str,
    shape: Vec<u64>,
    home: Home,
}

impl TensorReservation {
    /// Bytes to write (0 once published or aborted).
    pub(crate) fn byte_len(&self) -> usize {
        lock(&self.held).as_ref().map_or(0, |r| r.len)
    }

    pub(crate) fn new(
        mut res: pinshm::store::Reservation,
        key: String,
        dtype: &'static str,
        shape: Vec<u64>,
        name: &str,
    ) -> TensorReservation {
        let (data, len) = (res.as_mut_ptr(), res.len());
        TensorReservation {
            held: Mutex::new(Some(Arc::new(Reserved {
                res: Mutex::new(res),
                data,
                len,
            }))),
            key,
            dtype,
            shape,
            home: Home::new(name),
        }
    }
}

#[pymethods]
impl TensorReservation {
    /// The key it is reserved under.
    #[getter]
    fn key(&self) -> &str {
        &self.key
    }

    /// The tensor's dtype name (torch's: "float32", "bfloat16", ...).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype
    }

    /// The tensor's shape.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// Bytes to write.
    fn __len__(&self) -> usize {
        self.byte_len()
    }

    /// Gives the slot back unpublished; again does nothing. Its key is
    /// free for another put at once. Views of it still alive keep the
    /// slot (and their bytes writable, seen by nobody) until they go; then
    /// the slot is reclaimed in turn (`ObjectStore.abort(r)` frees it at
    /// once).
    fn abort(&self) {
        if let Some(held) = lock(&self.held).take() {
            lock(&held.res).abandon();
        }
    }

    /// # Safety
    /// Called by CPython with a `Py_buffer` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let this = slf.get();
        this.home.not_forked()?;
        let res = lock(&this.held).clone().ok_or_else(|| {
            PyBufferError::new_err("the TensorReservation was published or aborted")
        })?;
        let (data, len) = (res.data, res.len);
        let len = ffi::Py_ssize_t::try_from(len)
            .map_err(|_| PyValueError::new_err("reservation too large for a buffer"))?;
        let owner = Bound::new(slf.py(), ReservationExport { _res: res })?;
        // SAFETY: `view` is ours to fill; the `len` bytes at `data` are the
        // reserved, unpublished payload, valid while the reservation lives,
        // which `owner` (stored in `view.obj`) keeps alive; publishing needs
        // every export gone, so nobody reads them while Python may write.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                owner.as_ptr(),
                data.cast::<std::ffi::c_void>(),
                len,
                0,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// # Safety
    /// Never called: an export's `view.obj` is its `_ReservationExport`,
    /// whose type CPython asks on release. Defined only so that the type
    /// has a `bf_releasebuffer`, which makes numpy.frombuffer wrap the
    /// reservation in a memoryview (that keeps the export's owner, and so
    /// the reservation open) rather than keep the reservation itself as
    /// the array's base, which `publish` could not see: without it, an
    /// array could write into a published, later reused slot.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}

    fn __repr__(&self) -> String {
        format!(
            "TensorReservation(dtype={}, shape={:?}, open={})",
            self.dtype,
            self.shape,
            lock(&self.held).is_some()
        )
    }
}
