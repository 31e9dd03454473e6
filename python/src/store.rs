//! `pinshm.ObjectStore`: the writer.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use crate::buffer::Buffer;
use crate::handles::{ObjectHandle, StoreHandle};
use crate::{closed, lock, locked, to_py, Home};

/// From this size on, a copy runs with the GIL released: below it, the
/// release and re-acquire would cost more than the copy.
pub(crate) const RELEASE_GIL_AT: usize = 64 << 10;

/// The writer of a store: one per segment, in one process.
#[pyclass(module = "pinshm")]
pub(crate) struct ObjectStore {
    /// Shared (weakly) with the saves waiting to publish into it.
    inner: crate::save::Shared,
    /// How many of its saves are pending (`publish_after`).
    saves: Arc<AtomicUsize>,
    home: Home,
    /// Whether this process's reaper was told the segment (`reap=True`).
    reaped: bool,
}

impl ObjectStore {
    /// A reservation made by `reserve` (under `key`), handed to Python as
    /// `dtype` and `shape`: `reserve_tensor`'s and `reserve_bytes`' one path.
    fn reservation(
        &self,
        py: Python<'_>,
        key: &str,
        dtype: &'static str,
        shape: Vec<u64>,
        reserve: impl FnOnce(&mut pinshm::ObjectStore, &str) -> pinshm::Result<pinshm::store::Reservation>
            + Send,
    ) -> PyResult<crate::cache::TensorReservation> {
        let res = self.with(py, false, |s| reserve(s, key))?.map_err(to_py)?;
        Ok(crate::cache::TensorReservation::new(
            res,
            key.to_owned(),
            dtype,
            shape,
            &self.home.name,
        ))
    }

    fn with<R: Send>(
        &self,
        py: Python<'_>,
        release_gil: bool,
        f: impl FnOnce(&mut pinshm::ObjectStore) -> R + Send,
    ) -> PyResult<R> {
        locked(py, &self.home, &self.inner, release_gil, |s| {
            match s.as_mut() {
                Some(s) => Ok(f(s)),
                None => Err(closed("ObjectStore")),
            }
        })?
    }

    /// ValueError if `reservation` (still open) is another store's: it
    /// stays open in its own.
    fn check_ours(
        &self,
        py: Python<'_>,
        reservation: &crate::cache::TensorReservation,
    ) -> PyResult<()> {
        let theirs = crate::lock(&reservation.held).clone();
        if let Some(r) = theirs {
            let ours = self.with(py, false, move |s| crate::lock(&r.res).belongs_to(s))?;
            if !ours {
                return Err(PyValueError::new_err(
                    "the TensorReservation belongs to another store",
                ));
            }
        }
        Ok(())
    }

    /// The core reservation of `reservation`, taken out to be published:
    /// BufferError while an export of it is alive, ValueError if it was
    /// published or aborted already or is another store's.
    fn take_reservation(
        &self,
        py: Python<'_>,
        reservation: &crate::cache::TensorReservation,
    ) -> PyResult<pinshm::store::Reservation> {
        self.check_ours(py, reservation)?;
        let held = crate::buffer::take_unshared(&reservation.held, "TensorReservation")?
            .ok_or_else(|| {
                PyValueError::new_err("the TensorReservation was published or aborted")
            })?;
        Ok(match Arc::try_unwrap(held) {
            Ok(r) => r
                .res
                .into_inner()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
            Err(_) => unreachable!("take_unshared leaves no other owner"),
        })
    }
}

#[pymethods]
impl ObjectStore {
    /// Creates the store's segment (`capacity` bytes of ring, objects up to
    /// `max_object_size` bytes, `n_readers` readers) and becomes its writer.
    #[new]
    ///
    /// `reserve` (default true) takes every page of /dev/shm now, so a
    /// too-small /dev/shm fails here rather than with SIGBUS later;
    /// `prefault` (default: as `reserve`) also maps every page in. With
    /// `reserve=False` the segment is sparse, as Python's `SharedMemory`
    /// makes it (and is then never pinned): pages are backed just before
    /// they are first written, so a full /dev/shm raises `NoSpaceError`
    /// (a `MemoryError`) from that put, never SIGBUS.
    ///
    /// `eviction` is `"second_chance"` (default; CLOCK: an object hit by
    /// `get_cached` since the allocator last passed it stays one more lap)
    /// or `"fifo"` (the oldest reclaimable object goes).
    ///
    /// `shm_headroom` (bytes, default 0; sparse stores): new pages are
    /// backed only while /dev/shm keeps that much free afterwards; below
    /// it the store reuses what it has (a cache beside a queue that must
    /// not run out).
    ///
    /// `back_ahead` (bytes, default `ObjectStore.DEFAULT_BACK_AHEAD`, 16
    /// MiB; sparse stores): a background thread keeps that much past the
    /// last put backed and mapped during the ring's first lap, so a put
    /// into fresh pages costs what a put into backed ones does (while the
    /// thread keeps up); within `shm_headroom`. 0: each put backs its own
    /// pages.
    ///
    /// `pin` is `"auto"` (default: a `cuda` build with a driver pins a
    /// reserved segment in this process), `"off"` (never: a process that
    /// must stay CUDA-free, such as vLLM's API server, which forks the
    /// engine) or `"require"` (pin or raise).
    ///
    /// `cache=True`: objects owe no reads; any object no reader holds or
    /// leases may be reclaimed, read or not (an encoder cache). Not with
    /// `aggregate_reads`. `key_index=N`: a shared key index with room for
    /// N keys, so readers look keys up themselves (`StoreReader.lookup`).
    ///
    /// `reap` (default true): this process's reaper removes the segment
    /// after the process dies, however it ends (SIGKILL included); false
    /// leaves it for a store that must outlive its writer (`pinshm gc`
    /// removes it once nobody writes it).
    #[pyo3(signature = (
        capacity, max_object_size, n_readers, name=None, aggregate_reads=false,
        *, reserve=true, prefault=None, eviction="second_chance", pin="auto", shm_headroom=0,
        cache=false, key_index=0, back_ahead=None, reap=true
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        capacity: usize,
        max_object_size: usize,
        n_readers: u32,
        name: Option<String>,
        aggregate_reads: bool,
        reserve: bool,
        prefault: Option<bool>,
        eviction: &str,
        pin: &str,
        shm_headroom: u64,
        cache: bool,
        key_index: usize,
        back_ahead: Option<u64>,
        reap: bool,
    ) -> PyResult<Self> {
        let pin = crate::pin_mode(pin)?;
        let eviction = match eviction {
            "fifo" => pinshm::store::Eviction::Fifo,
            "second_chance" => pinshm::store::Eviction::SecondChance,
            other => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "eviction must be 'fifo' or 'second_chance', not {other:?}"
                )))
            }
        };
        let mut cfg = pinshm::StoreConfig::new(capacity, max_object_size, n_readers)
            .aggregate_reads(aggregate_reads)
            .reserve(reserve)
            .prefault(prefault.unwrap_or(reserve))
            .eviction(eviction)
            .pin(pin)
            .shm_headroom(shm_headroom)
            .cache(cache)
            .key_index(key_index)
            .back_ahead(back_ahead.unwrap_or(pinshm::StoreConfig::DEFAULT_BACK_AHEAD));
        if let Some(name) = name {
            cfg = cfg.name(name);
        }
        // Reserving and pre-faulting the segment takes a while: no GIL.
        let store = crate::gil::released(py, || pinshm::ObjectStore::create(cfg)).map_err(to_py)?;
        if reap {
            crate::reap(py, store.name(), true)?;
        }
        Ok(ObjectStore {
            home: Home::new(store.name()),
            inner: Arc::new(Mutex::new(Some(store))),
            saves: Arc::new(AtomicUsize::new(0)),
            reaped: reap,
        })
    }

    /// Stores the bytes of `data` (any object with a contiguous buffer:
    /// bytes, bytearray, memoryview, a C-contiguous numpy array) under
    /// `key`, copied once, into the slot. One reference: each reader owes
    /// one read.
    fn put(&self, py: Python<'_>, key: &str, data: &Bound<'_, PyAny>) -> PyResult<ObjectHandle> {
        let buf = Buffer::readable(data)?;
        let bytes = buf.as_slice();
        let h = self.with(py, bytes.len() >= RELEASE_GIL_AT, |s| s.put(key, bytes))?;
        h.map(ObjectHandle).map_err(to_py)
    }

    /// Stores the bytes of every buffer in `parts` (a sequence of bytes,
    /// bytearray, memoryview, C-contiguous numpy arrays, mixed), one after
    /// the other, as ONE object: what `put(key, b"".join(parts))` stores,
    /// without the join. Each part is copied once, straight into the slot.
    /// A part that is not one contiguous run of bytes (a transposed or
    /// sliced array) raises the error its exporter gives, naming the part.
    fn put_parts(
        &self,
        py: Python<'_>,
        key: &str,
        parts: &Bound<'_, PyAny>,
    ) -> PyResult<ObjectHandle> {
        let bufs = parts
            .try_iter()?
            .enumerate()
            .map(|(i, part)| {
                let part = part?;
                Buffer::readable(&part).map_err(|e| name_part(py, e, i, &part))
            })
            .collect::<PyResult<Vec<Buffer>>>()?;
        // Borrowed slices only (`Buffer` stays here, with the GIL): the
        // bytes go from each exporter to the slot with no copy between.
        let slices: Vec<&[u8]> = bufs.iter().map(Buffer::as_slice).collect();
        let total = slices
            .iter()
            .try_fold(0usize, |n, s| n.checked_add(s.len()))
            .ok_or_else(|| PyValueError::new_err("put_parts: the parts' total size overflows"))?;
        let h = self.with(py, total >= RELEASE_GIL_AT, |s| {
            s.put_with(key, total, |slot| {
                let mut at = 0;
                for part in &slices {
                    slot[at..at + part.len()].copy_from_slice(part);
                    at += part.len();
                }
            })
        })?;
        h.map(ObjectHandle).map_err(to_py)
    }

    /// Stores a multimodal item as one object: the C-contiguous numpy
    /// arrays of `fields` (name → array, in the mapping's order) and the
    /// string metadata `meta` (key → value, both `str`), in the format
    /// Rust's `put_item` writes (Rust and Python readers share it).
    #[pyo3(signature = (key, fields, meta=None))]
    fn put_item(
        &self,
        py: Python<'_>,
        key: &str,
        fields: &Bound<'_, PyAny>,
        meta: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<ObjectHandle> {
        let mut arrays = Vec::new();
        for entry in fields.call_method0("items")?.try_iter()? {
            let (name, array): (Bound<'_, PyAny>, Bound<'_, PyAny>) = entry?.extract()?;
            let name: String = name.extract().map_err(|_| {
                PyTypeError::new_err(format!(
                    "put_item: field names must be str, not {}",
                    type_name(&name)
                ))
            })?;
            let field = crate::tensor::Field::of(&array)
                .map_err(|e| e_with_context(py, e, &format!("put_item: field {name:?}")))?;
            arrays.push((name, field));
        }
        let mut entries = Vec::new();
        if let Some(meta) = meta.filter(|m| !m.is_none()) {
            for entry in meta.call_method0("items")?.try_iter()? {
                let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = entry?.extract()?;
                match (k.extract::<String>(), v.extract::<String>()) {
                    (Ok(k), Ok(v)) => entries.push((k, v)),
                    _ => {
                        return Err(PyTypeError::new_err(format!(
                            "put_item: meta keys and values must be str (the item format \
                             stores strings), got {} -> {}",
                            type_name(&k),
                            type_name(&v)
                        )))
                    }
                }
            }
        }
        let total: usize = arrays.iter().map(|(_, f)| f.bytes().len()).sum();
        // Borrowed only: the Buffers stay here, with the GIL.
        let fields: Vec<(&str, pinshm::codec::DType, &[u64], &[u8])> = arrays
            .iter()
            .map(|(n, f)| (n.as_str(), f.dtype, f.shape.as_slice(), f.bytes()))
            .collect();
        let h = self.with(py, total >= RELEASE_GIL_AT, |s| {
            let mut item = pinshm::codec::Item::new();
            for (k, v) in entries {
                item = item.meta(k, v);
            }
            for (name, dtype, shape, bytes) in fields {
                item = item.field(name, pinshm::codec::TensorRef::new(dtype, shape, bytes)?);
            }
            s.put_item(key, &item)
        })?;
        h.map(ObjectHandle).map_err(to_py)
    }

    /// Stores a C-contiguous numpy array (little-endian integers, floats,
    /// bool) as a tensor: dtype and shape in a header, then the elements,
    /// 64-byte aligned, in the format Rust's `put_tensor` writes.
    fn put_tensor(
        &self,
        py: Python<'_>,
        key: &str,
        array: &Bound<'_, PyAny>,
    ) -> PyResult<ObjectHandle> {
        let field = crate::tensor::Field::of(array)?;
        let (dtype, shape, bytes) = (field.dtype, field.shape.as_slice(), field.bytes());
        let h = self.with(py, bytes.len() >= RELEASE_GIL_AT, |s| {
            pinshm::codec::TensorRef::new(dtype, shape, bytes).and_then(|t| s.put_tensor(key, &t))
        })?;
        h.map(ObjectHandle).map_err(to_py)
    }

    /// Reserves a slot for a tensor of `dtype` (torch's names: "float32",
    /// "bfloat16", ...) and `shape` under `key`, for its bytes to be
    /// written in place (a device-to-host copy straight into the slot);
    /// `publish` it then. Errors as `put`.
    fn reserve_tensor(
        &self,
        py: Python<'_>,
        key: &str,
        dtype: &str,
        shape: Vec<u64>,
    ) -> PyResult<crate::cache::TensorReservation> {
        let d = crate::tensor::from_name(dtype)?;
        let sh = shape.clone();
        self.reservation(py, key, crate::tensor::dtype_name(d), shape, move |s, k| {
            s.reserve_tensor(k, d, &sh)
        })
    }

    /// Reserves a slot of `nbytes` bytes under `key`, written through the
    /// reservation's buffer by any means (torch's `copy_` on its intra-op
    /// threads, say), then `publish`ed: what `put(key, bytes)` of the same
    /// bytes stores, read as a put's. Its `dtype` reads "uint8" and its
    /// `shape` `(nbytes,)`. Errors as `put`.
    fn reserve_bytes(
        &self,
        py: Python<'_>,
        key: &str,
        nbytes: usize,
    ) -> PyResult<crate::cache::TensorReservation> {
        self.reservation(py, key, "uint8", vec![nbytes as u64], move |s, k| {
            s.reserve_bytes(k, nbytes)
        })
    }

    /// Publishes a reservation whose bytes are written: readers may get
    /// it from now on. BufferError while an export of it is alive;
    /// ValueError if it was published or aborted already.
    fn publish(
        &self,
        py: Python<'_>,
        reservation: &crate::cache::TensorReservation,
    ) -> PyResult<ObjectHandle> {
        let res = self.take_reservation(py, reservation)?;
        self.with(py, false, move |s| s.publish(res))?
            .map(ObjectHandle)
            .map_err(to_py)
    }

    /// Publishes a reservation once `event` has completed: the save of a
    /// device-to-host copy queued into it, which the caller does not wait
    /// for. `event` is anything with `query() -> bool` (a
    /// `torch.cuda.Event` recorded after the copy); pinshm's poller thread
    /// (and every flush: `flush_pending()`, `PendingSave.wait()`, a get)
    /// queries it, and publishes the reservation only once `query()`
    /// returns true. Until then the key is pending: `is_pending(key)` is
    /// true, `is_cached`, `get_cached` and readers miss it, and a put of
    /// it raises. If `query()` raises, the copy has failed: the
    /// reservation is aborted, its key and slot free at once. With
    /// `event=None` it is published now. `staged`: a buffer of exactly
    /// the reservation's length that the copy writes instead of the slot
    /// (pinned staging memory, where the store's mapping is not pinned and
    /// a copy straight into it would not be asynchronous): its bytes are
    /// copied into the slot, by the poller, once the event has completed,
    /// then published (with `event=None`, at once). Returns the
    /// `PendingSave`. Errors as `publish`. Closing the store discards
    /// saves still pending (none is published); `flush_pending()` first
    /// publishes them.
    #[pyo3(signature = (reservation, event, staged=None))]
    fn publish_after(
        &self,
        py: Python<'_>,
        reservation: &crate::cache::TensorReservation,
        event: Option<Py<PyAny>>,
        staged: Option<Py<PyAny>>,
    ) -> PyResult<crate::save::PendingSave> {
        let key = reservation.key.clone();
        if let Some(st) = &staged {
            let (got, want) = (Buffer::readable(st.bind(py))?.len(), reservation.byte_len());
            if got != want {
                return Err(PyValueError::new_err(format!(
                    "publish_after: the staged buffer is {got} bytes, the reservation {want}"
                )));
            }
        }
        let mut res = self.take_reservation(py, reservation)?;
        let (event, staged) = match (event, staged) {
            (None, Some(st)) => {
                // Nothing to wait for: the staged bytes go in now.
                let buf = Buffer::readable(st.bind(py))?;
                res.bytes_mut().copy_from_slice(buf.as_slice());
                (None, None)
            }
            other => other,
        };
        match event {
            None => {
                let h = self
                    .with(py, false, move |s| s.publish(res))?
                    .map_err(to_py)?;
                Ok(crate::save::PendingSave::published(
                    &key,
                    h,
                    &self.home.name,
                ))
            }
            Some(event) => Ok(crate::save::PendingSave::start(
                &key,
                res,
                event,
                staged,
                &self.inner,
                &self.saves,
                &self.home.name,
            )),
        }
    }

    /// Gives a reservation back unpublished (the copy into it failed, say):
    /// its key is free for another put at once, and so is its slot,
    /// unless a view of it is alive (the slot then goes when the last view
    /// does). Again, or after `publish`, does nothing; ValueError if it
    /// belongs to another store.
    fn abort(&self, py: Python<'_>, reservation: &crate::cache::TensorReservation) -> PyResult<()> {
        self.check_ours(py, reservation)?;
        let Some(held) = lock(&reservation.held).take() else {
            return Ok(());
        };
        lock(&held.res).abandon();
        if let Ok(r) = Arc::try_unwrap(held) {
            let res = r
                .res
                .into_inner()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            self.with(py, false, move |s| s.abort(res))?;
        }
        Ok(())
    }

    /// Whether a save of `key` is in flight: reserved (or its copy queued,
    /// `publish_after`) and not yet published, nor aborted or failed.
    /// `is_cached` is false for a pending key, and a put of it raises.
    fn is_pending(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        self.with(py, false, |s| s.is_pending(key))
    }

    /// Waits until every save of this store queued by `publish_after` is
    /// over (published, or failed), polling their events, at most
    /// `timeout` seconds (None: no limit); returns how many are still
    /// pending (0 unless the timeout passed). For shutdown (before
    /// `close()`, which discards what is pending) and tests.
    #[pyo3(signature = (timeout=None))]
    fn flush_pending(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<usize> {
        self.home.not_forked()?;
        let saves = &self.saves;
        crate::save::wait_until(py, timeout, || saves.load(Ordering::Acquire) == 0)?;
        Ok(saves.load(Ordering::Acquire))
    }

    /// Whether `key` is stored.
    fn is_cached(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        self.with(py, false, |s| s.is_cached(key))
    }

    /// The handle of `key`, counting one more reference (each reader owes
    /// one more read), or None if it is not stored.
    fn get_cached(&self, py: Python<'_>, key: &str) -> PyResult<Option<ObjectHandle>> {
        Ok(self
            .with(py, false, |s| s.get_cached(key))?
            .map(ObjectHandle))
    }

    /// One more reference to `key`: each reader owes one more read
    /// (KeyError if it is not stored).
    fn add_reference(&self, py: Python<'_>, key: &str) -> PyResult<()> {
        self.with(py, false, |s| s.add_reference(key))?
            .map_err(to_py)
    }

    /// The handle of `key`, counting no reference, or None (vLLM's
    /// `key_index[key]`).
    fn lookup(&self, py: Python<'_>, key: &str) -> PyResult<Option<ObjectHandle>> {
        Ok(self.with(py, false, |s| s.lookup(key))?.map(ObjectHandle))
    }

    /// Every stored `(key, handle)`, in no particular order.
    fn keys(&self, py: Python<'_>) -> PyResult<Vec<(String, ObjectHandle)>> {
        self.with(py, false, |s| {
            s.keys()
                .map(|(k, h)| (k.to_owned(), ObjectHandle(h)))
                .collect()
        })
    }

    /// How many keys are stored.
    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, false, |s| s.len())
    }

    /// A copy of the bytes of `handle`, read by the writer itself: no read
    /// is counted (vLLM's writer-side `get`). StaleError if `handle` is not
    /// a live object of this store.
    fn peek<'py>(&self, py: Python<'py>, handle: ObjectHandle) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self.with(py, false, |s| s.peek(handle.0).map(<[u8]>::to_vec))?;
        Ok(PyBytes::new(py, &bytes.map_err(to_py)?))
    }

    /// Protects `key` from eviction until its next `get_cached` or
    /// `release_protections()` (vLLM 0.33's writer `touch`).
    fn protect(&self, py: Python<'_>, key: &str) -> PyResult<()> {
        self.with(py, false, |s| s.protect(key))?.map_err(to_py)
    }

    /// Ends every protection.
    fn release_protections(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, false, |s| s.release_protections())
    }

    /// Reclaims every object nobody owes a read of; returns how many.
    fn free_unused(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, false, |s| s.free_unused())
    }

    /// Forgets every key; old handles read their own bytes until their
    /// slot is reused.
    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, false, |s| s.clear())
    }

    /// Forgets every key and makes every old handle stale at once.
    fn clear_hard(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, false, |s| s.clear_hard())
    }

    /// The 32-byte signature of `key`'s handle, or None if not stored.
    fn signature<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let sig = self.with(py, false, |s| s.signature(key))?;
        Ok(sig.map(|sig| PyBytes::new(py, &sig)))
    }

    /// Whether `signature` signs `key` at `handle`, and `key` still maps
    /// to `handle`.
    fn verify(
        &self,
        py: Python<'_>,
        key: &str,
        handle: ObjectHandle,
        signature: &[u8],
    ) -> PyResult<bool> {
        self.with(py, false, |s| s.verify(key, handle.0, signature))
    }

    /// The writer's counters, as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let st = self.with(py, false, |s| s.stats())?;
        let d = PyDict::new(py);
        d.set_item("puts", st.puts)?;
        d.set_item("hits", st.hits)?;
        d.set_item("evictions", st.evictions)?;
        d.set_item("full_errors", st.full_errors)?;
        d.set_item("objects", st.objects)?;
        d.set_item("bytes_in_use", st.bytes_in_use)?;
        d.set_item("largest_free_block", st.largest_free_block)?;
        d.set_item("dead_readers_reaped", st.dead_readers_reaped)?;
        d.set_item("stale_reads", st.stale_reads)?;
        d.set_item("nospace_fallbacks", st.nospace_fallbacks)?;
        d.set_item("backed_in_put", st.backed_in_put)?;
        d.set_item("indexed", st.indexed)?;
        d.set_item("unindexed", st.unindexed)?;
        d.set_item("oldest_unread", st.oldest_unread.map(|b| b.to_string()))?;
        Ok(d)
    }

    /// Slots start, and a ring's capacity is a multiple of, this many bytes.
    #[classattr]
    const SLOT_ALIGN: usize = pinshm::StoreConfig::SLOT_ALIGN;

    /// The most readers a store serves (`n_readers` up to this).
    #[classattr]
    const MAX_READERS: u32 = pinshm::StoreConfig::MAX_READERS;

    /// `back_ahead`'s default (bytes): how far a sparse store's background
    /// thread backs pages ahead of the writer.
    #[classattr]
    const DEFAULT_BACK_AHEAD: u64 = pinshm::StoreConfig::DEFAULT_BACK_AHEAD;

    /// Ring bytes one object of `payload` bytes takes with `n_readers`
    /// readers (slot header, read counters and 64-byte alignment
    /// included): size a ring as a multiple of this.
    #[staticmethod]
    fn slot_len(n_readers: u32, payload: usize) -> PyResult<usize> {
        check_readers(n_readers)?;
        // Room for the rounding: no slot is within a page of usize::MAX.
        if payload > isize::MAX as usize {
            return Err(to_py(pinshm::Error::InvalidConfig(format!(
                "payload of {payload} bytes: no slot is that large"
            ))));
        }
        Ok(pinshm::StoreConfig::slot_len(n_readers, payload))
    }

    /// The largest `max_object_size` a ring of `capacity` bytes accepts
    /// with `n_readers` readers (0 when not even an empty object fits).
    #[staticmethod]
    fn largest_object(capacity: usize, n_readers: u32) -> PyResult<usize> {
        check_readers(n_readers)?;
        Ok(pinshm::StoreConfig::largest_object(capacity, n_readers))
    }

    /// The writer's mapping of the data region: (address of its first
    /// byte, length in bytes), to register once with a transfer library
    /// that writes into reserved slots. A reservation's offset in it is
    /// its buffer's address minus this one.
    fn data_region(&self, py: Python<'_>) -> PyResult<(usize, u64)> {
        self.with(py, false, |s| s.data_region())?.map_err(to_py)
    }

    /// What a reader process needs to attach (picklable).
    fn handle(&self, py: Python<'_>) -> PyResult<StoreHandle> {
        Ok(StoreHandle(self.with(py, false, |s| s.handle())?))
    }

    /// The segment's name in /dev/shm.
    #[getter]
    fn name(&self) -> &str {
        &self.home.name
    }

    /// Removes the segment's name from /dev/shm now and keeps serving:
    /// readers already attached read on, new attaches by name fail, and
    /// nothing of the store is left once every process mapping it is gone,
    /// however each ends (SIGKILL included). Again does nothing.
    fn unlink(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, false, |s| s.unlink())?.map_err(to_py)
    }

    /// Whether `close()` has run.
    #[getter]
    fn closed(&self, py: Python<'_>) -> PyResult<bool> {
        locked(py, &self.home, &self.inner, false, |s| s.is_none())
    }

    /// Closes the store and unlinks its segment (readers already attached
    /// keep their mapping). Saves still pending (`publish_after`) are
    /// discarded, never published (call `flush_pending()` first to publish
    /// them); closing does not wait for them. Closing twice does nothing,
    /// and so does closing in a forked child (the store is the parent's).
    fn close(&self, py: Python<'_>) {
        crate::close_in(py, &self.home, &self.inner);
        // In a forked child the segment is the parent's: its reaper keeps it.
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
        format!("ObjectStore(name={:?})", self.home.name)
    }
}

/// The type name of `obj`, for messages.
fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string())
}

/// `e`, of the same type (so `except` clauses keep working), its message
/// prefixed with `context`, the original as its cause.
fn e_with_context(py: Python<'_>, e: PyErr, context: &str) -> PyErr {
    let new = PyErr::from_type(e.get_type(py), format!("{context}: {}", e.value(py)));
    new.set_cause(py, Some(e));
    new
}

/// `put_parts`' error for part `i` that exports no contiguous bytes.
fn name_part(py: Python<'_>, e: PyErr, i: usize, part: &Bound<'_, PyAny>) -> PyErr {
    e_with_context(
        py,
        e,
        &format!(
            "put_parts: part {i} ({}) is not one contiguous buffer (numpy.ascontiguousarray \
             copies it into one)",
            type_name(part)
        ),
    )
}

/// The layout helpers' reader count, checked as creating a store checks it
/// and refused with the same error (InvalidArgumentError).
fn check_readers(n_readers: u32) -> PyResult<()> {
    if n_readers == 0 || n_readers > pinshm::StoreConfig::MAX_READERS {
        return Err(to_py(pinshm::Error::InvalidConfig(format!(
            "n_readers must be 1..={}, got {n_readers}",
            pinshm::StoreConfig::MAX_READERS
        ))));
    }
    Ok(())
}
