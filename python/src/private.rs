//! `pinshm.PrivateView`: an object's bytes as this process's own writable
//! copy that copies nothing until written (the core's `PrivateView`, made
//! by `StoreReader.get_private`).

use std::os::raw::c_int;

use pyo3::ffi;
use pyo3::prelude::*;

use crate::handles::ObjectHandle;
use crate::Home;

/// An object's bytes, writable and private to this process: a
/// copy-on-write mapping of the object's pages, which reads the slot (no
/// copy) until a page is written and then copies that page only, into
/// memory no other process sees. A write never reaches the slot, another
/// reader, or another view. Exports its bytes through the buffer protocol
/// (`memoryview(v)`, `numpy.frombuffer(v, ...)`, `torch.frombuffer(v, ...)`),
/// every export the view itself (`view.obj`): the view, and the slot it
/// holds, live as long as anything keeps an export; the read is
/// acknowledged when the last goes. Not pinned (CUDA): a device copy from
/// it is a pageable copy. In a child forked after it was made, its bytes
/// fault and new exports raise PinshmError. Its bytes are only ever reached
/// through exports (raw memory, written by their holders): Rust makes no
/// reference to them, so a write through an export on another thread
/// races with nothing of Rust's.
#[pyclass(module = "pinshm", frozen)]
pub(crate) struct PrivateView {
    view: pinshm::PrivateView,
    home: Home,
}

impl PrivateView {
    pub(crate) fn new(view: pinshm::PrivateView, name: &str) -> PrivateView {
        PrivateView {
            view,
            home: Home::new(name),
        }
    }
}

#[pymethods]
impl PrivateView {
    /// The handle this view reads.
    #[getter]
    fn handle(&self) -> ObjectHandle {
        ObjectHandle(self.view.handle())
    }

    fn __len__(&self) -> usize {
        self.view.len()
    }

    fn __repr__(&self) -> String {
        let h = self.view.handle();
        format!(
            "PrivateView({}:{}, {} bytes)",
            h.address,
            h.monotonic_id,
            self.view.len()
        )
    }

    /// # Safety
    /// `view` is the Py_buffer Python asked to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        slf.get().home.not_forked()?;
        let (data, len) = (slf.get().view.as_mut_ptr(), slf.get().view.len());
        // SAFETY: `view` is ours to fill (the caller's promise); the bytes
        // are the view's private mapping, valid while it lives, which the
        // export's `view.obj` (the view itself) makes it do; only its
        // exports write them.
        unsafe {
            crate::buffer::export_writable(slf.into_any(), view, flags, data, len, "PrivateView")
        }
    }

    /// # Safety
    /// Nothing to do: the export's `view.obj` (this view) holds the bytes.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}
