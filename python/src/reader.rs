//! `pinshm.StoreReader` and its zero-copy `ReadGuard`.
//!
//! The reader lives in an `Arc` (`Shared`), behind a mutex. A held read
//! (`Held`) owns the core's guard, which owns its share of the reader's
//! attachment (mapping, entry, lock): it needs no borrow of the reader and
//! no lock to end. A `Held` is itself shared, in an `Arc`, by the Python
//! `ReadGuard` and by each buffer export of it (`SlotExport`, the export's
//! `view.obj`): the read ends when the last of them goes.

use std::os::raw::c_int;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use crate::buffer::Buffer;
use crate::handles::{ObjectHandle, StoreHandle};
use crate::store::RELEASE_GIL_AT;
use crate::{closed, lock, locked, to_py, Home};

/// A reader behind a mutex (`StoreReader` is `Send`, not `Sync`: its gets
/// share one hazard word).
struct Shared {
    reader: Mutex<pinshm::StoreReader>,
    /// The process that attached it (see `Home::not_forked`).
    home: Home,
}

/// One read held open: the core's guard and the object's bytes.
struct Held {
    /// Taken by `Drop for Held`, and ended at once or once its release
    /// gate's event completes.
    read: Option<Release>,
    /// The reader it came from, for its `Home` (the guard itself needs
    /// nothing of it).
    reader: Arc<Shared>,
    /// Whether its end waits for the release gate: not for a copy out
    /// (`get_copy`), which the CPU has finished before the read ends.
    gated: bool,
}

/// The owner of one buffer export of a `ReadGuard`: what the exported
/// `Py_buffer`'s `obj` points to. Consumers that release the buffer at once
/// but keep `view.obj` (torch.frombuffer, numpy.frombuffer of a type
/// without `bf_releasebuffer`) keep this object, and with it the read: the
/// read's lifetime is tied to `view.obj`, not to a count of
/// `__releasebuffer__` calls that such consumers make early. It has no
/// buffer slots of its own, so CPython only decrefs it on release.
#[pyclass(module = "pinshm", frozen, name = "_SlotExport")]
pub(crate) struct SlotExport {
    _held: Arc<Held>,
}

impl Held {
    fn new(
        py: Python<'_>,
        shared: &Arc<Shared>,
        h: pinshm::store::ObjectHandle,
        gated: bool,
    ) -> PyResult<Held> {
        crate::release::flush_releases(py);
        let guard =
            locked(py, &shared.home, &shared.reader, false, move |r| r.get(h))?.map_err(to_py)?;
        Ok(Held {
            read: Some(Release(guard)),
            reader: Arc::clone(shared),
            gated,
        })
    }

    /// The Forked error in a forked child: there the slot may be reused
    /// (the parent's read ends without the child), so nothing reads it.
    fn not_forked(&self) -> PyResult<()> {
        self.reader.home.not_forked()
    }

    fn guard(&self) -> &pinshm::ReadGuard {
        &self.read.as_ref().expect("taken only by drop").0
    }

    fn bytes(&self) -> &[u8] {
        self.guard()
    }

    fn handle(&self) -> pinshm::store::ObjectHandle {
        self.guard().handle()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let Some(read) = self.read.take() else {
            return;
        };
        // In a forked child the guard is the parent's: the core's drop
        // touches nothing shared there, and no release gate is asked.
        if self.reader.home.forked() {
            return drop(read);
        }
        // The last view is gone; a device copy from it may not be (a
        // copy out, by the CPU, is done).
        match self.gated.then(crate::release::event_for_release).flatten() {
            Some(event) => crate::release::pend(event, Box::new(read)),
            None => drop(read),
        }
    }
}

/// A read none of whose views is left: dropping it ends the read (the
/// core's guard drops, acknowledging it and giving the slot back). It
/// needs no lock: the guard owns its share of the reader.
struct Release(pinshm::ReadGuard);

impl crate::release::Gated for Release {}

/// Copies `src` into `dst` (same length), with the GIL released for large
/// copies.
fn copy(py: Python<'_>, src: &[u8], dst: &mut [u8]) {
    if src.len() >= RELEASE_GIL_AT {
        crate::gil::released(py, || dst.copy_from_slice(src));
    } else {
        dst.copy_from_slice(src);
    }
}

/// A new `bytes` holding a copy of `src` (the GIL released for large
/// copies). Not `PyBytes::new_with`, which zeroes the new object first: at
/// 4 MiB that memset made get_copy half again as slow as the copy alone.
fn bytes_copy<'py>(py: Python<'py>, src: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let len = ffi::Py_ssize_t::try_from(src.len())
        .map_err(|_| PyValueError::new_err("object too large for a bytes"))?;
    // SAFETY: a null `v` asks for a new, uninitialised bytes object of
    // `len` bytes (the documented idiom), which we fill before anyone else
    // can see it; we hold the GIL.
    let obj = unsafe { ffi::PyBytes_FromStringAndSize(std::ptr::null(), len) };
    if obj.is_null() {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `obj` is a new, owned reference to a bytes object.
    let out = unsafe { Bound::from_owned_ptr(py, obj).downcast_into_unchecked::<PyBytes>() };
    if !src.is_empty() {
        // SAFETY: the buffer of a bytes object of `len` bytes has `len`
        // (+1) bytes; nobody else holds a reference to the new object, so
        // writing it is ours alone, and it lives (owned by `out`) until
        // after the copy.
        let dst = unsafe {
            std::slice::from_raw_parts_mut(ffi::PyBytes_AsString(obj).cast::<u8>(), src.len())
        };
        copy(py, src, dst);
    }
    Ok(out)
}

/// One reader of a store, attached into a reader entry until closed.
/// Frozen: a call with the GIL released (a large copy) holds a clone of
/// the `Arc`, never a borrow of this object, so `close()` from another
/// thread meanwhile works (the call finishes on its clone).
#[pyclass(module = "pinshm", frozen)]
pub(crate) struct StoreReader {
    /// Locked only to clone or take the `Arc`, never across a call.
    shared: Mutex<Option<Arc<Shared>>>,
    index: u32,
    name: String,
}

impl Drop for StoreReader {
    /// As `close()`, but its completed reads are left to the release
    /// poller, woken (or started) here: a drop may run with an exception
    /// pending (a dealloc during an unwind), so it calls no Python (a
    /// `query()` would fail for that exception, and count as completed).
    fn drop(&mut self) {
        drop(lock(&self.shared).take());
        crate::release::nudge();
    }
}

impl StoreReader {
    fn shared(&self) -> PyResult<Arc<Shared>> {
        lock(&self.shared)
            .clone()
            .ok_or_else(|| closed("StoreReader"))
    }

    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&pinshm::StoreReader) -> R + Send,
    ) -> PyResult<R> {
        let shared = self.shared()?;
        locked(py, &shared.home, &shared.reader, false, |r| f(r))
    }

    fn wrap(r: pinshm::StoreReader) -> Self {
        StoreReader {
            index: r.index(),
            name: r.name().to_owned(),
            shared: Mutex::new(Some(Arc::new(Shared {
                home: Home::new(r.name()),
                reader: Mutex::new(r),
            }))),
        }
    }
}

#[pymethods]
impl StoreReader {
    /// Attaches to the store of `store_handle` as reader `index` (default:
    /// the first free one). `pin`: `"auto"` (default: a `cuda` build with
    /// a driver registers this process's mapping of a reserved segment, so
    /// tensors viewing slots are pinned memory), `"off"` or `"require"`.
    /// `read_only_views`: guards view a second, read-only mapping of the
    /// segment, so an in-place write into a view (by code that ignores
    /// the buffer's read-only flag, as `torch.frombuffer` does) faults
    /// instead of changing bytes other readers read.
    #[staticmethod]
    #[pyo3(signature = (store_handle, index=None, *, pin="auto", read_only_views=false))]
    fn attach(
        py: Python<'_>,
        store_handle: StoreHandle,
        index: Option<u32>,
        pin: &str,
        read_only_views: bool,
    ) -> PyResult<Self> {
        let sh = store_handle.0;
        let mut opts = pinshm::store::ReaderOptions::default()
            .pin(crate::pin_mode(pin)?)
            .read_only_views(read_only_views);
        if let Some(i) = index {
            opts = opts.index(i);
        }
        let r = crate::gil::released(py, || pinshm::StoreReader::attach_with(&sh, opts));
        r.map(Self::wrap).map_err(to_py)
    }

    /// Attaches to the store segment `name`, reading its geometry from the
    /// segment's header (`pin` and `read_only_views` as for `attach`).
    #[staticmethod]
    #[pyo3(signature = (name, *, pin="auto", read_only_views=false))]
    fn attach_by_name(
        py: Python<'_>,
        name: &str,
        pin: &str,
        read_only_views: bool,
    ) -> PyResult<Self> {
        let opts = pinshm::store::ReaderOptions::default()
            .pin(crate::pin_mode(pin)?)
            .read_only_views(read_only_views);
        let r = crate::gil::released(py, || {
            pinshm::store::StoreHandle::of(name)
                .and_then(|sh| pinshm::StoreReader::attach_with(&sh, opts))
        });
        r.map(Self::wrap).map_err(to_py)
    }

    /// A zero-copy view of the object: a `ReadGuard` exporting its bytes
    /// through the buffer protocol, holding the slot until released.
    fn get(&self, py: Python<'_>, handle: ObjectHandle) -> PyResult<ReadGuard> {
        let held = Held::new(py, &self.shared()?, handle.0, true)?;
        Ok(ReadGuard {
            handle: handle.0,
            len: held.bytes().len(),
            held: Mutex::new(Some(Arc::new(held))),
        })
    }

    /// The object as this process's own writable copy that copies nothing
    /// until written (a `PrivateView`): a private copy-on-write mapping of
    /// its pages, holding the slot for as long as the view (or anything
    /// keeping an export of it) lives. For a tensor a consumer may change
    /// in place without changing what other readers read. StaleError if
    /// the object is gone.
    fn get_private(
        &self,
        py: Python<'_>,
        handle: ObjectHandle,
    ) -> PyResult<crate::private::PrivateView> {
        let shared = self.shared()?;
        // Mapping and faulting a feature's pages in takes a while: no GIL.
        let view = locked(py, &shared.home, &shared.reader, true, move |r| {
            r.get_private(handle.0)
        })?
        .map_err(to_py)?;
        Ok(crate::private::PrivateView::new(view, &shared.home.name))
    }

    /// The handle of `key`'s object, found in the store's shared key index
    /// without the writer (`key_index=` at create), or None. Never another
    /// key's object. PinshmError if the store has no key index.
    fn lookup(&self, py: Python<'_>, key: &str) -> PyResult<Option<ObjectHandle>> {
        let key = key.to_owned();
        Ok(self
            .with(py, move |r| r.lookup(&key))?
            .map_err(to_py)?
            .map(ObjectHandle))
    }

    /// Keeps the object from being reclaimed, without reading it, until the
    /// returned `Lease` is released. StaleError if it is gone.
    fn lease(&self, py: Python<'_>, handle: ObjectHandle) -> PyResult<crate::cache::Lease> {
        let l = self.with(py, move |r| r.lease(handle.0))?.map_err(to_py)?;
        Ok(crate::cache::Lease::new(l))
    }

    /// A `Lease` on `key`'s object, looked up in the shared key index and
    /// held in one step, or None on a miss.
    fn lease_key(&self, py: Python<'_>, key: &str) -> PyResult<Option<crate::cache::Lease>> {
        let key = key.to_owned();
        let l = self.with(py, move |r| r.lease_key(&key))?.map_err(to_py)?;
        Ok(l.map(crate::cache::Lease::new))
    }

    /// A tensor (put by `put_tensor`, here or in Rust) as a read-only numpy
    /// array over the slot, with no copy. The array holds the read (its
    /// base is a memoryview of a `ReadGuard`'s export, whose `view.obj`
    /// holds the read) until it is garbage collected.
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
        // A memoryview, not the guard itself: numpy keeps what it is given
        // as the array's base, and a memoryview keeps its export (and so
        // the read) whatever numpy does with the buffer it gets.
        let view = py
            .import("builtins")?
            .getattr("memoryview")?
            .call1((Bound::new(py, guard)?,))?;
        let array = py
            .import("numpy")?
            .call_method("frombuffer", (view,), Some(&kwargs))?;
        array.call_method1("reshape", (PyTuple::new(py, layout.shape)?,))
    }

    /// An item (put by `put_item`, here or in Rust) as `(fields, meta)`:
    /// `fields` a dict of name → read-only numpy array over the slot (no
    /// copy), in the item's order; `meta` a dict of str → str (the first
    /// value where a Rust writer repeated a key, as Rust's `meta(key)`
    /// reads). Every array holds the read (each one's base is a memoryview
    /// of one `ReadGuard` export, whose `view.obj` holds the read) until
    /// the last of them is garbage collected. A bfloat16 field raises
    /// TypeError (numpy has no such dtype): read the object with `get()`.
    fn get_item<'py>(
        &self,
        py: Python<'py>,
        handle: ObjectHandle,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let guard = self.get(py, handle)?;
        let (fields, meta) = guard.item_fields()?;
        let numpy = py.import("numpy")?;
        let frombuffer = numpy.getattr("frombuffer")?;
        // One export for every field: its memoryview is each array's base.
        let view = py
            .import("builtins")?
            .getattr("memoryview")?
            .call1((Bound::new(py, guard)?,))?;
        let arrays = PyDict::new(py);
        for f in fields {
            let dtype = crate::tensor::numpy_dtype(f.layout.dtype).map_err(|e| {
                PyTypeError::new_err(format!("item field {:?}: {}", f.name, e.value(py)))
            })?;
            let kwargs = PyDict::new(py);
            kwargs.set_item("dtype", dtype)?;
            kwargs.set_item("count", f.layout.numel)?;
            kwargs.set_item("offset", f.layout.offset)?;
            let array = frombuffer
                .call((&view,), Some(&kwargs))?
                .call_method1("reshape", (PyTuple::new(py, f.layout.shape)?,))?;
            arrays.set_item(f.name, array)?;
        }
        let meta_dict = PyDict::new(py);
        for (k, v) in meta {
            if !meta_dict.contains(&k)? {
                meta_dict.set_item(k, v)?;
            }
        }
        PyTuple::new(py, [arrays.into_any(), meta_dict.into_any()])
    }

    /// A copy of the object's bytes; the read is acknowledged (never gated
    /// by `set_release_gate`: the copy is done).
    fn get_copy<'py>(
        &self,
        py: Python<'py>,
        handle: ObjectHandle,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let held = Held::new(py, &self.shared()?, handle.0, false)?;
        let out = bytes_copy(py, held.bytes());
        drop(held);
        out
    }

    /// Copies the object's bytes into the start of `buffer` (any writable
    /// contiguous buffer) and returns how many were written. A buffer
    /// smaller than the object raises ValueError; the read still counts.
    /// Never gated by `set_release_gate`, as `get_copy`.
    fn get_copy_into(
        &self,
        py: Python<'_>,
        handle: ObjectHandle,
        buffer: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let mut out = Buffer::writable(buffer)?;
        let held = Held::new(py, &self.shared()?, handle.0, false)?;
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
    fn acknowledge(&self, py: Python<'_>, handle: ObjectHandle) -> PyResult<()> {
        self.with(py, |r| r.acknowledge(handle.0))?.map_err(to_py)
    }

    /// Checks that `handle` names a live object (StaleError if not),
    /// acknowledging nothing (vLLM 0.33's reader `touch`).
    fn validate(&self, py: Python<'_>, handle: ObjectHandle) -> PyResult<()> {
        self.with(py, |r| r.validate(handle.0))?.map_err(to_py)
    }

    /// The segment's current epoch: every handle issued since the last hard
    /// clear carries it, so a handle known only by address and id (as vLLM
    /// sends them) is rebuilt with it.
    #[getter]
    fn epoch(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |r| r.epoch())
    }

    /// The reader table: `(entry index, pid)` of every entry attached by
    /// a process that still runs, this reader's own included.
    fn live_readers(&self, py: Python<'_>) -> PyResult<Vec<(u32, u32)>> {
        self.with(py, |r| r.live_readers())?.map_err(to_py)
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

    /// Whether this process's mapping of the store is page-locked (CUDA
    /// host-registered): a `cuda` build with a driver, and a reserved
    /// segment under the default pin mode. Then a tensor viewing a slot is
    /// pinned memory: `.to(device, non_blocking=True)` is a DMA from it.
    #[getter]
    fn is_pinned(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, |r| r.is_pinned())
    }

    /// How this process's mapping was pinned while attaching, or None (not
    /// pinned): a dict of "bytes", "chunks" (registration calls, at most
    /// 64 GiB each) and "seconds".
    #[getter]
    fn pinning<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(p) = self.with(py, |r| r.pinning())? else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("bytes", p.bytes)?;
        d.set_item("chunks", p.chunks)?;
        d.set_item("seconds", p.elapsed.as_secs_f64())?;
        Ok(Some(d))
    }

    /// This process's mapping of the data region: (address of its first
    /// byte, length in bytes), to register once with a transfer library.
    /// A payload's offset in it is its guard's address minus this one.
    fn data_region(&self, py: Python<'_>) -> PyResult<(usize, u64)> {
        self.with(py, |r| r.data_region())?.map_err(to_py)
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
    /// is released, and so do reads waiting for their release gate's
    /// events: those already completed are released here, the others when
    /// theirs completes (by the release poller, with no further call).
    /// Closing twice does nothing.
    fn close(&self, py: Python<'_>) {
        let shared = lock(&self.shared).take();
        crate::gil::released(py, || drop(shared));
        crate::release::flush_releases(py);
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
        format!("StoreReader(name={:?}, index={})", self.name, self.index)
    }
}

/// A held read of one object: exports the slot's bytes, read-only, through
/// the buffer protocol (`memoryview(g)`, `numpy.frombuffer(g, ...)`), with
/// no copy. The read is acknowledged and the slot freed for reuse when the
/// guard and every export of it are gone: `release()` (or the end of a
/// `with` block) drops the guard's own hold, and refuses with BufferError
/// while an export (a memoryview, an array, any object that kept the
/// export's `view.obj`) is alive; garbage collection drops it too.
#[pyclass(module = "pinshm", frozen)]
pub(crate) struct ReadGuard {
    handle: pinshm::store::ObjectHandle,
    len: usize,
    /// The guard's own hold on the read; each export holds another clone
    /// (in its `SlotExport`), so the read ends when the last one goes.
    held: Mutex<Option<Arc<Held>>>,
}

impl ReadGuard {
    /// The guard's hold on the read (a clone: the read stays held while it
    /// lives, whatever `release()` does meanwhile), or `err` if released.
    /// In a forked child, the Forked error (`PinshmError`).
    fn hold(&self, err: fn(&'static str) -> PyErr) -> PyResult<Arc<Held>> {
        let held = lock(&self.held)
            .clone()
            .ok_or_else(|| err("the ReadGuard has been released"))?;
        held.not_forked()?;
        Ok(held)
    }

    /// Where the tensor's elements lie (TypeError if the object is not a
    /// tensor).
    fn tensor_layout(&self) -> PyResult<crate::tensor::Layout> {
        let held = self.hold(PyValueError::new_err)?;
        let found = held.guard().kind();
        if found != pinshm::store::ObjectKind::Tensor {
            return Err(to_py(pinshm::Error::WrongKind {
                expected: pinshm::store::ObjectKind::Tensor,
                found,
            }));
        }
        crate::tensor::layout(held.bytes()).map_err(to_py)
    }
}

impl ReadGuard {
    /// The fields and metadata of the item read (TypeError if the object
    /// is not an item).
    fn item_fields(&self) -> PyResult<(Vec<crate::tensor::ItemField>, crate::tensor::Meta)> {
        let held = self.hold(PyValueError::new_err)?;
        let found = held.guard().kind();
        if found != pinshm::store::ObjectKind::Item {
            return Err(to_py(pinshm::Error::WrongKind {
                expected: pinshm::store::ObjectKind::Item,
                found,
            }));
        }
        crate::tensor::item_fields(held.bytes()).map_err(to_py)
    }

    /// Drops the guard's own hold, whatever exports remain (they keep the
    /// read until they go).
    fn drop_hold(&self) {
        // Taken out first: the read's drop may call the gate (Python).
        let held = lock(&self.held).take();
        drop(held);
    }
}

#[pymethods]
impl ReadGuard {
    /// The handle this guard reads.
    #[getter]
    fn handle(&self) -> ObjectHandle {
        ObjectHandle(self.handle)
    }

    /// Whether the guard's hold on the read has been released (exports of
    /// it may still hold the read).
    #[getter]
    fn released(&self) -> bool {
        lock(&self.held).is_none()
    }

    /// Releases the read (acknowledging it). BufferError while exports of
    /// the guard are alive (memoryviews, arrays, or any object keeping an
    /// export's `view.obj`); releasing twice does nothing.
    fn release(&self) -> PyResult<()> {
        // Dropped outside the mutex: the read's drop may call the release
        // gate (Python), which may look at this guard.
        let held = crate::buffer::take_unshared(&self.held, "ReadGuard")?;
        debug_assert!(held.as_ref().is_none_or(|h| h.handle() == self.handle));
        drop(held);
        Ok(())
    }

    /// `(dtype, shape, offset)` of the tensor read: its dtype's name
    /// (torch's, "bfloat16" included), its shape, and where its elements
    /// start in the guard's bytes. WrongKindError if it is not a tensor.
    fn tensor_meta<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let layout = self.tensor_layout()?;
        (
            crate::tensor::dtype_name(layout.dtype),
            PyTuple::new(py, layout.shape)?,
            layout.offset,
        )
            .into_pyobject(py)
    }

    /// A copy of the bytes.
    fn __bytes__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        // The copy may run with the GIL released, so it must not hold the
        // guard's mutex (see lib.rs): it holds a clone of the read instead,
        // which keeps `release()` from ending the read meanwhile.
        let held = self.hold(PyValueError::new_err)?;
        let out = bytes_copy(py, held.bytes());
        drop(held);
        out
    }

    fn __len__(&self) -> usize {
        self.len
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Releases the read. Leaving the block by an exception never raises
    /// here (that exception goes on, not replaced by a BufferError): the
    /// guard's hold is dropped, and exports still alive keep the read until
    /// they go.
    #[pyo3(signature = (exc_type=None, _exc=None, _tb=None))]
    fn __exit__(
        &self,
        exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        if exc_type.is_some_and(|t| !t.is_none()) {
            self.drop_hold();
        } else {
            self.release()?;
        }
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
        let held = slf.get().hold(PyBufferError::new_err)?;
        let (data, len) = (held.bytes().as_ptr(), held.bytes().len());
        // The export's owner: `view.obj`, holding the read for as long as
        // anyone keeps it, whether or not the buffer was released.
        let owner = Bound::new(slf.py(), SlotExport { _held: held })?;
        // SAFETY: `view` is the Py_buffer Python asked us to fill; the bytes
        // stay valid, and unwritten, while the read is held, which `owner`
        // does (a clone of the `Arc<Held>`) for as long as it lives.
        unsafe {
            crate::buffer::export_read_only(owner.into_any(), view, flags, data, len, "ReadGuard")
        }
    }

    /// # Safety
    /// Never called: an export's `view.obj` is its `_SlotExport`, whose type
    /// CPython asks on release. Defined only so that the guard's type has a
    /// `bf_releasebuffer`, which makes numpy.frombuffer wrap the guard in a
    /// memoryview (that keeps the export's owner) rather than keep the guard
    /// itself as the array's base, which `release()` could not see.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}
