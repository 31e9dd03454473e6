//! `pinshm.StoreReader` and its zero-copy `ReadGuard`.
//!
//! A Rust `ReadGuard<'r>` borrows its `StoreReader`; a Python object cannot
//! hold a borrow. So the reader lives in an `Arc` (`Shared`), and a held
//! read (`Held`) owns a clone of that `Arc` beside the guard, whose borrow
//! is erased to `'static`. See `Held::new` for why that is sound.

use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::os::raw::c_int;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use crate::buffer::Buffer;
use crate::handles::{ObjectHandle, StoreHandle};
use crate::store::RELEASE_GIL_AT;
use crate::{closed, lock, locked_shared, to_py};

/// A reader behind a mutex (`StoreReader` is `Send`, not `Sync`). It is
/// reached only through `locked_shared` (a `&StoreReader`) and `lock` (to
/// serialise a guard's drop): no `&mut` to it is ever formed, so a guard's
/// shared borrow of it is never invalidated.
struct Shared(Mutex<pinshm::StoreReader>);

/// One read held open: the core's guard, with its borrow of the reader
/// erased, and the reader it borrows.
struct Held {
    /// Dropped by `Drop for Held`, under the reader's mutex, before
    /// `reader` (fields drop after `drop` returns).
    guard: ManuallyDrop<pinshm::ReadGuard<'static>>,
    reader: Arc<Shared>,
    /// The object's bytes: `guard`'s slice, taken once at `new`.
    data: *const u8,
    len: usize,
}

// SAFETY: the guard's only thread-bound parts are its reference to the
// reader, used only by the guard's `Drop`, which `Drop for Held` runs with
// the reader's mutex held (so every use of the reader is serialised, by
// that mutex), and pointers into the mapping, which the reader keeps
// mapped and which are only read (`bytes`), never written.
unsafe impl Send for Held {}
// SAFETY: through `&Held` only the guard's own fields are read (its
// bytes, handle and kind: read-only slot memory, valid while the guard
// lives, and plain values), never the reader.
unsafe impl Sync for Held {}

impl Held {
    fn new(py: Python<'_>, shared: &Arc<Shared>, h: pinshm::ObjectHandle) -> PyResult<Held> {
        let reader = Arc::clone(shared);
        locked_shared(py, &shared.0, move |r| {
            let guard = r.get(h).map_err(to_py)?;
            let (data, len) = (guard.as_ptr(), guard.len());
            // SAFETY: erasing the guard's borrow of the reader to 'static is
            // sound because the `Held` built here:
            // 1. keeps the borrowed reader alive: it owns a clone of the Arc
            //    that holds it (`reader`), and drops the guard before that
            //    clone (`Drop for Held`); a leaked `Held` leaks its Arc too,
            //    so the reference can never dangle;
            // 2. keeps it in place: the reader lives inside the Arc's heap
            //    allocation and is never moved out nor borrowed mutably
            //    (see `Shared`), so the shared borrow stays valid;
            // 3. keeps it single-threaded: the guard touches the reader only
            //    in its `Drop` (acknowledge, release the hazard), which runs
            //    under the reader's mutex, like every other use of it.
            // The guard, for its part, keeps the slot from being reused, so
            // `data..data + len` holds the object until the guard drops.
            let guard = unsafe {
                std::mem::transmute::<pinshm::ReadGuard<'_>, pinshm::ReadGuard<'static>>(guard)
            };
            Ok(Held {
                guard: ManuallyDrop::new(guard),
                reader,
                data,
                len,
            })
        })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `data..data + len` is the slice the guard derefs to; the
        // guard lives as long as `self` (it is dropped only in `Drop`), and
        // with it the mapping and the hazard that keeps the slot unchanged.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }

    fn handle(&self) -> pinshm::ObjectHandle {
        self.guard.handle()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // The guard's drop uses the reader: under its mutex. Never held
        // long by anyone (no copy runs under it), so waiting for it here,
        // GIL held or not, cannot deadlock.
        let _reader = lock(&self.reader.0);
        // SAFETY: dropped once, here; `self.guard` is not used afterwards,
        // and the reader it borrows is alive (`self.reader` drops later).
        unsafe { ManuallyDrop::drop(&mut self.guard) };
    }
}

/// Copies `src` into `dst` (same length), with the GIL released for large
/// copies.
fn copy(py: Python<'_>, src: &[u8], dst: &mut [u8]) {
    if src.len() >= RELEASE_GIL_AT {
        py.allow_threads(|| dst.copy_from_slice(src));
    } else {
        dst.copy_from_slice(src);
    }
}

/// One reader of a store, attached into a reader slot until closed.
#[pyclass(module = "pinshm")]
pub(crate) struct StoreReader {
    shared: Option<Arc<Shared>>,
    index: u32,
    name: String,
}

impl StoreReader {
    fn shared(&self) -> PyResult<&Arc<Shared>> {
        self.shared.as_ref().ok_or_else(|| closed("StoreReader"))
    }

    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&pinshm::StoreReader) -> R + Send,
    ) -> PyResult<R> {
        Ok(locked_shared(py, &self.shared()?.0, f))
    }

    fn wrap(r: pinshm::StoreReader) -> Self {
        StoreReader {
            index: r.index(),
            name: r.name().to_owned(),
            shared: Some(Arc::new(Shared(Mutex::new(r)))),
        }
    }
}

#[pymethods]
impl StoreReader {
    /// Attaches to the store of `store_handle` as reader `index` (default:
    /// the first free one).
    #[staticmethod]
    #[pyo3(signature = (store_handle, index=None))]
    fn attach(py: Python<'_>, store_handle: StoreHandle, index: Option<u32>) -> PyResult<Self> {
        let sh = store_handle.0;
        let r = py.allow_threads(|| match index {
            Some(i) => pinshm::StoreReader::attach_as(&sh, i),
            None => pinshm::StoreReader::attach(&sh),
        });
        r.map(Self::wrap).map_err(to_py)
    }

    /// Attaches to the store segment `name`, reading its geometry from the
    /// segment's header.
    #[staticmethod]
    fn attach_by_name(py: Python<'_>, name: &str) -> PyResult<Self> {
        let r = py.allow_threads(|| pinshm::StoreReader::attach_by_name(name));
        r.map(Self::wrap).map_err(to_py)
    }

    /// A zero-copy view of the object: a `ReadGuard` exporting its bytes
    /// through the buffer protocol, holding the slot until released.
    fn get(&self, py: Python<'_>, handle: ObjectHandle) -> PyResult<ReadGuard> {
        let held = Held::new(py, self.shared()?, handle.0)?;
        Ok(ReadGuard {
            handle: handle.0,
            len: held.len,
            state: Mutex::new(GuardState {
                held: Some(held),
                exports: 0,
            }),
        })
    }

    /// A tensor (put by `put_tensor`, here or in Rust) as a read-only numpy
    /// array over the slot, with no copy. The array holds the read (its
    /// base is a view of a `ReadGuard`) until it is garbage collected.
    fn get_tensor<'py>(
        &self,
        py: Python<'py>,
        handle: ObjectHandle,
    ) -> PyResult<Bound<'py, PyAny>> {
        let guard = self.get(py, handle)?;
        let layout = guard.tensor_layout()?;
        let dtype = crate::tensor::numpy_dtype(layout.dtype)?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("dtype", dtype)?;
        kwargs.set_item("count", layout.numel)?;
        kwargs.set_item("offset", layout.offset)?;
        let array = py.import("numpy")?.call_method(
            "frombuffer",
            (Bound::new(py, guard)?,),
            Some(&kwargs),
        )?;
        array.call_method1("reshape", (PyTuple::new(py, layout.shape)?,))
    }

    /// A copy of the object's bytes; the read is acknowledged.
    fn get_copy<'py>(
        &self,
        py: Python<'py>,
        handle: ObjectHandle,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let held = Held::new(py, self.shared()?, handle.0)?;
        let out = PyBytes::new_with(py, held.len, |dst| {
            copy(py, held.bytes(), dst);
            Ok(())
        });
        drop(held);
        out
    }

    /// Copies the object's bytes into the start of `buffer` (any writable
    /// contiguous buffer) and returns how many were written. A buffer
    /// smaller than the object raises ValueError; the read still counts.
    fn get_copy_into(
        &self,
        py: Python<'_>,
        handle: ObjectHandle,
        buffer: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let mut out = Buffer::writable(buffer)?;
        let held = Held::new(py, self.shared()?, handle.0)?;
        let src = held.bytes();
        let dst = out.as_mut_slice();
        if dst.len() < src.len() {
            return Err(PyValueError::new_err(format!(
                "buffer of {} bytes is too small for an object of {} bytes",
                dst.len(),
                src.len()
            )));
        }
        copy(py, src, &mut dst[..src.len()]);
        Ok(src.len())
    }

    /// Acknowledges one read of `handle` without reading it.
    fn touch(&self, py: Python<'_>, handle: ObjectHandle) -> PyResult<()> {
        self.with(py, |r| r.touch(handle.0))?.map_err(to_py)
    }

    /// Checks that `handle` names a live object (StaleError if not),
    /// acknowledging nothing (vLLM 0.33's reader `touch`).
    fn validate(&self, py: Python<'_>, handle: ObjectHandle) -> PyResult<()> {
        self.with(py, |r| r.validate(handle.0))?.map_err(to_py)
    }

    /// Whether `signature` signs `key` at `handle` with this store's secret.
    fn verify(
        &self,
        py: Python<'_>,
        key: &str,
        handle: ObjectHandle,
        signature: &[u8],
    ) -> PyResult<bool> {
        self.with(py, |r| r.verify(key, handle.0, signature))
    }

    /// This reader's index.
    #[getter]
    fn index(&self) -> u32 {
        self.index
    }

    /// The store's segment name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Detaches. Guards still held keep the reader attached until the last
    /// is released. Closing twice does nothing.
    fn close(&mut self, py: Python<'_>) {
        let shared = self.shared.take();
        py.allow_threads(|| drop(shared));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&mut self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        format!("StoreReader(name={:?}, index={})", self.name, self.index)
    }
}

struct GuardState {
    held: Option<Held>,
    /// Buffer exports alive (memoryviews, numpy arrays over the slot).
    exports: usize,
}

/// A held read of one object: exports the slot's bytes, read-only, through
/// the buffer protocol (`memoryview(g)`, `numpy.frombuffer(g, ...)`), with
/// no copy. The read is acknowledged and the slot freed for reuse when the
/// guard is released: `release()`, the end of a `with` block, or garbage
/// collection. `release()` refuses with BufferError while views are alive.
#[pyclass(module = "pinshm", frozen)]
pub(crate) struct ReadGuard {
    handle: pinshm::ObjectHandle,
    len: usize,
    state: Mutex<GuardState>,
}

impl ReadGuard {
    /// Where the tensor's elements lie (TypeError if the object is not a
    /// tensor).
    fn tensor_layout(&self) -> PyResult<crate::tensor::Layout> {
        let st = lock(&self.state);
        let held = st
            .held
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("the ReadGuard has been released"))?;
        let found = held.guard.kind();
        if found != pinshm::ObjectKind::Tensor {
            return Err(to_py(pinshm::Error::WrongKind {
                expected: pinshm::ObjectKind::Tensor,
                found,
            }));
        }
        crate::tensor::layout(held.bytes()).map_err(to_py)
    }
}

#[pymethods]
impl ReadGuard {
    /// The handle this guard reads.
    #[getter]
    fn handle(&self) -> ObjectHandle {
        ObjectHandle(self.handle)
    }

    /// Whether the read has been released.
    #[getter]
    fn released(&self) -> bool {
        lock(&self.state).held.is_none()
    }

    /// Releases the read (acknowledging it). BufferError while exported
    /// views of the guard are alive; releasing twice does nothing.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let held = {
            let mut st = lock(&self.state);
            if st.exports > 0 {
                return Err(PyBufferError::new_err(format!(
                    "cannot release a ReadGuard while {} exported view(s) of it are alive \
                     (release the memoryviews, delete the arrays)",
                    st.exports
                )));
            }
            st.held.take()
        };
        debug_assert!(held.as_ref().is_none_or(|h| h.handle() == self.handle));
        let _ = py;
        drop(held);
        Ok(())
    }

    /// A copy of the bytes.
    fn __bytes__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        // The copy may run with the GIL released, so it must not hold the
        // state's mutex (see lib.rs): it counts as an export instead, which
        // keeps `release()` from ending the read meanwhile.
        let (data, len) = {
            let mut st = lock(&self.state);
            let held = st
                .held
                .as_ref()
                .ok_or_else(|| PyValueError::new_err("the ReadGuard has been released"))?;
            let span = (held.data, held.len);
            st.exports += 1;
            span
        };
        let src = if len == 0 {
            &[][..]
        } else {
            // SAFETY: the held read's bytes (see `Held::bytes`); the export
            // counted above keeps the read held until it is uncounted below,
            // after the last use of `src`.
            unsafe { std::slice::from_raw_parts(data, len) }
        };
        let out = PyBytes::new_with(py, len, |dst| {
            copy(py, src, dst);
            Ok(())
        });
        lock(&self.state).exports -= 1;
        out
    }

    fn __len__(&self) -> usize {
        self.len
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.release(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let h = self.handle;
        let state = if self.released() { ", released" } else { "" };
        format!(
            "ReadGuard(address={}, monotonic_id={}, len={}{state})",
            h.address, h.monotonic_id, self.len
        )
    }

    /// # Safety
    /// Called by Python with a `Py_buffer` to fill (`view`), per the buffer
    /// protocol.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let this = slf.get();
        let mut st = lock(&this.state);
        let held = st
            .held
            .as_ref()
            .ok_or_else(|| PyBufferError::new_err("the ReadGuard has been released"))?;
        if flags & ffi::PyBUF_WRITABLE != 0 {
            return Err(PyBufferError::new_err("a ReadGuard's buffer is read-only"));
        }
        let len = ffi::Py_ssize_t::try_from(held.len)
            .map_err(|_| PyBufferError::new_err("object too large for a buffer"))?;
        // SAFETY: `view` is the Py_buffer Python asked us to fill; the bytes
        // (read-only, `readonly = 1`) stay valid while the guard holds the
        // read, which `release()` refuses to end while `exports > 0`, and
        // the view holds a reference to `slf` (set by FillInfo), so the
        // guard is not collected first.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                held.data.cast_mut().cast::<c_void>(),
                len,
                1,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        st.exports += 1;
        Ok(())
    }

    /// # Safety
    /// Called by Python once per successful `__getbuffer__`.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        let mut st = lock(&self.state);
        st.exports = st.exports.saturating_sub(1);
    }
}
