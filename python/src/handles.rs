//! The handles that travel between processes: small, immutable, hashable
//! and picklable (`__reduce__` rebuilds them from their fields).

use pyo3::prelude::*;
use pyo3::types::PyType;

/// Where an object lives: what the writer sends to its readers.
#[pyclass(module = "pinshm", frozen, eq, hash)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ObjectHandle(pub(crate) pinshm::store::ObjectHandle);

#[pymethods]
impl ObjectHandle {
    #[new]
    fn new(address: u64, monotonic_id: u64, epoch: u64) -> Self {
        ObjectHandle(pinshm::store::ObjectHandle {
            address,
            monotonic_id,
            epoch,
        })
    }

    /// Offset of the object's slot in the data region.
    #[getter]
    fn address(&self) -> u64 {
        self.0.address
    }

    /// The object's id, never reused within a segment's life.
    #[getter]
    fn monotonic_id(&self) -> u64 {
        self.0.monotonic_id
    }

    /// The store's epoch when the object was put.
    #[getter]
    fn epoch(&self) -> u64 {
        self.0.epoch
    }

    fn __repr__(&self) -> String {
        let h = self.0;
        format!(
            "ObjectHandle(address={}, monotonic_id={}, epoch={})",
            h.address, h.monotonic_id, h.epoch
        )
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyType>, (u64, u64, u64))> {
        let h = slf.get().0;
        Ok((slf.get_type(), (h.address, h.monotonic_id, h.epoch)))
    }
}

/// Everything a reader process needs to attach to a store.
#[pyclass(module = "pinshm", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) struct StoreHandle(pub(crate) pinshm::store::StoreHandle);

type StoreHandleArgs = (String, u64, u64, u64, u32, u32);

#[pymethods]
impl StoreHandle {
    #[new]
    fn new(
        name: String,
        nonce: u64,
        capacity: u64,
        max_object_size: u64,
        n_readers: u32,
        layout_version: u32,
    ) -> Self {
        StoreHandle(pinshm::store::StoreHandle {
            name,
            nonce,
            capacity,
            max_object_size,
            n_readers,
            layout_version,
        })
    }

    /// The handle of the live store segment `name`, read from its header.
    #[staticmethod]
    fn of(py: Python<'_>, name: &str) -> PyResult<Self> {
        crate::gil::released(py, || pinshm::store::StoreHandle::of(name))
            .map(StoreHandle)
            .map_err(crate::to_py)
    }

    /// Segment name (in /dev/shm).
    #[getter]
    fn name(&self) -> &str {
        &self.0.name
    }
    #[getter]
    fn nonce(&self) -> u64 {
        self.0.nonce
    }
    #[getter]
    fn capacity(&self) -> u64 {
        self.0.capacity
    }
    #[getter]
    fn max_object_size(&self) -> u64 {
        self.0.max_object_size
    }
    #[getter]
    fn n_readers(&self) -> u32 {
        self.0.n_readers
    }
    #[getter]
    fn layout_version(&self) -> u32 {
        self.0.layout_version
    }

    fn __repr__(&self) -> String {
        let h = &self.0;
        format!(
            "StoreHandle(name={:?}, capacity={}, max_object_size={}, n_readers={})",
            h.name, h.capacity, h.max_object_size, h.n_readers
        )
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyType>, StoreHandleArgs)> {
        let h = &slf.get().0;
        Ok((
            slf.get_type(),
            (
                h.name.clone(),
                h.nonce,
                h.capacity,
                h.max_object_size,
                h.n_readers,
                h.layout_version,
            ),
        ))
    }
}

/// Everything a reader process needs to attach to a broadcast channel.
#[pyclass(module = "pinshm", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct BroadcastHandle(pub(crate) pinshm::channel::BroadcastHandle);

impl std::hash::Hash for BroadcastHandle {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let h = &self.0;
        (
            &h.name,
            h.nonce,
            h.layout_version,
            h.n_readers,
            h.slots,
            h.slot_size,
        )
            .hash(state);
    }
}

type BroadcastHandleArgs = (String, u64, u32, u32, u32, u32);

#[pymethods]
impl BroadcastHandle {
    #[new]
    fn new(
        name: String,
        nonce: u64,
        layout_version: u32,
        n_readers: u32,
        slots: u32,
        slot_size: u32,
    ) -> Self {
        BroadcastHandle(pinshm::channel::BroadcastHandle {
            name,
            nonce,
            layout_version,
            n_readers,
            slots,
            slot_size,
        })
    }

    /// Segment name (in /dev/shm).
    #[getter]
    fn name(&self) -> &str {
        &self.0.name
    }
    /// The channel's nonce: a channel recreated under the same name has
    /// another.
    #[getter]
    fn nonce(&self) -> u64 {
        self.0.nonce
    }
    /// The writer's channel layout version.
    #[getter]
    fn layout_version(&self) -> u32 {
        self.0.layout_version
    }
    #[getter]
    fn n_readers(&self) -> u32 {
        self.0.n_readers
    }
    #[getter]
    fn slots(&self) -> u32 {
        self.0.slots
    }
    #[getter]
    fn slot_size(&self) -> u32 {
        self.0.slot_size
    }

    fn __repr__(&self) -> String {
        let h = &self.0;
        format!(
            "BroadcastHandle(name={:?}, n_readers={}, slots={}, slot_size={})",
            h.name, h.n_readers, h.slots, h.slot_size
        )
    }

    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyType>, BroadcastHandleArgs)> {
        let h = &slf.get().0;
        Ok((
            slf.get_type(),
            (
                h.name.clone(),
                h.nonce,
                h.layout_version,
                h.n_readers,
                h.slots,
                h.slot_size,
            ),
        ))
    }
}

/// The 32 bytes of a handle signature as vLLM carries it (a list of 32
/// ints, each in 0..=255, `bool` and other int subclasses refused, as
/// vLLM's check does), or None for anything else. One pass in Rust: the
/// same check in Python costs more than the HMAC.
#[pyfunction]
pub(crate) fn signature_bytes<'py>(
    py: Python<'py>,
    signature: &Bound<'py, PyAny>,
) -> Option<Bound<'py, pyo3::types::PyBytes>> {
    use pyo3::types::{PyInt, PyList};
    let list = signature.downcast::<PyList>().ok()?;
    let mut out = [0u8; 32];
    if list.len() != out.len() {
        return None;
    }
    for (byte, item) in out.iter_mut().zip(list.iter()) {
        if !item.is_exact_instance_of::<PyInt>() {
            return None;
        }
        *byte = item.extract::<u8>().ok()?;
    }
    Some(pyo3::types::PyBytes::new(py, &out))
}
