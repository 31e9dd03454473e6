//! What `python -m pinshm inspect` and `python -m pinshm doctor` read
//! through the binding: the crate's own inspector (the one behind the Rust
//! `pinshm-inspect`, so a segment is parsed in one place only) and whether
//! a CUDA driver loads.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::to_py;

/// The segment `name` (as in /dev/shm/NAME), read-only: header, readers,
/// slots, the oldest blocker, the text `pinshm-inspect` prints (`report`),
/// and an explanation for each `(address, id)` of `handles`.
#[pyfunction(name = "_inspect_segment")]
#[pyo3(signature = (name, handles = None))]
pub(crate) fn inspect_segment<'py>(
    py: Python<'py>,
    name: &str,
    handles: Option<Vec<(u64, u64)>>,
) -> PyResult<Bound<'py, PyDict>> {
    let snap = crate::gil::released(py, || pinshm::inspect::inspect(name)).map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("name", &snap.name)?;
    d.set_item("layout_version", snap.layout_version)?;
    d.set_item("epoch", snap.epoch)?;
    d.set_item("capacity", snap.capacity)?;
    d.set_item("max_object_size", snap.max_object_size)?;
    d.set_item("aggregate_reads", snap.aggregate_reads)?;
    d.set_item("cache", snap.cache)?;
    d.set_item("store_kind", snap.store_kind())?;
    d.set_item("writer_pid", snap.writer_pid)?;
    d.set_item("owner_uid", snap.owner_uid)?;
    d.set_item("mode", snap.mode)?;
    d.set_item("writer_alive", snap.writer_alive)?;
    d.set_item("next_id", snap.next_id)?;
    d.set_item("cleared_below", snap.cleared_below)?;
    d.set_item("ring_cursor", snap.ring.0)?;
    d.set_item("ring_high_water", snap.ring.1)?;
    let readers = PyList::empty(py);
    for r in &snap.readers {
        let e = PyDict::new(py);
        e.set_item("index", r.index)?;
        e.set_item("state", r.state)?;
        e.set_item("pid", r.pid)?;
        e.set_item("alive", r.alive)?;
        e.set_item("last_ack_ms_ago", r.last_ack_ms_ago)?;
        e.set_item("counted_from", r.counted_from)?;
        e.set_item("stale_reads", r.stale_reads)?;
        e.set_item("holds", r.guards)?;
        e.set_item("generation", r.generation)?;
        readers.append(e)?;
    }
    d.set_item("readers", readers)?;
    let (used, free) = snap.reader_entries();
    d.set_item("entries_used", used)?;
    d.set_item("entries_free", free)?;
    let slots = PyList::empty(py);
    for s in &snap.slots {
        let e = PyDict::new(py);
        e.set_item("address", s.address)?;
        e.set_item("monotonic_id", s.monotonic_id)?;
        e.set_item("size", s.size)?;
        e.set_item("kind", s.kind_name())?;
        e.set_item("refs", s.refs)?;
        e.set_item("reads_owed", s.reads_owed.clone())?;
        e.set_item("holds", s.holds.clone())?;
        slots.append(e)?;
    }
    d.set_item("slots", slots)?;
    match snap.oldest_blocker() {
        Some((s, why)) => {
            let b = PyDict::new(py);
            b.set_item("address", s.address)?;
            b.set_item("monotonic_id", s.monotonic_id)?;
            b.set_item("size", s.size)?;
            b.set_item("why", why)?;
            d.set_item("blocker", b)?;
        }
        None => d.set_item("blocker", py.None())?,
    }
    d.set_item("report", snap.to_string())?;
    let explained: Vec<String> = handles
        .unwrap_or_default()
        .iter()
        .map(|&(address, id)| snap.explain(address, id))
        .collect();
    d.set_item("explanations", explained)?;
    Ok(d)
}

/// Removes segment `name` if the name still names the file (`dev`, `ino`)
/// and no live writer holds it (`pinshm::inspect::remove_if_abandoned_file`):
/// whether that file left the name. What a process's reaper runs for the
/// segments the process made, after it died.
#[pyfunction(name = "_remove_if_abandoned_file")]
pub(crate) fn remove_if_abandoned_file(
    py: Python<'_>,
    name: &str,
    dev: u64,
    ino: u64,
) -> PyResult<bool> {
    crate::gil::released(py, || {
        pinshm::inspect::remove_if_abandoned_file(name, dev, ino)
    })
    .map_err(to_py)
}

/// The segments in /dev/shm whose name starts with `prefix` and whose
/// writer is gone (`pinshm::inspect::gc`): listed with `dry_run`, else removed, each
/// under the dead writer's liveness lock.
#[pyfunction(name = "_gc_segments")]
#[pyo3(signature = (prefix = "", dry_run = true))]
pub(crate) fn gc_segments<'py>(
    py: Python<'py>,
    prefix: &str,
    dry_run: bool,
) -> PyResult<Bound<'py, PyList>> {
    let found = crate::gil::released(py, || pinshm::inspect::gc(prefix, dry_run)).map_err(to_py)?;
    let out = PyList::empty(py);
    for a in found {
        let d = PyDict::new(py);
        d.set_item("name", &a.name)?;
        d.set_item("kind", a.kind)?;
        d.set_item("bytes", a.bytes)?;
        d.set_item("writer_pid", a.writer_pid)?;
        d.set_item("owner_uid", a.owner_uid)?;
        d.set_item("removed", a.removed)?;
        out.append(d)?;
    }
    Ok(out)
}

/// Whether this build has the `cuda` feature, whether a CUDA driver
/// library loads, and its version (`major * 1000 + minor * 10`).
#[pyfunction]
pub(crate) fn cuda_status(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    #[cfg(feature = "cuda")]
    {
        d.set_item("feature", true)?;
        d.set_item("driver", pinshm::testing::driver_present())?;
        d.set_item("driver_version", pinshm::testing::driver_version())?;
    }
    #[cfg(not(feature = "cuda"))]
    {
        d.set_item("feature", false)?;
        d.set_item("driver", false)?;
        d.set_item("driver_version", py.None())?;
    }
    Ok(d)
}
