//! The remote tier's digest of an encoder output's bytes (BLAKE3, the
//! `blake3` crate: SIMD, a few GB/s on one core), and the copy of fetched
//! bytes into their slot fused with it (`_Digest.copy_update`), so that
//! the bytes are read once and hashed while they are in cache. Both run with the GIL released:
//! the scheduler's thread goes on while a fetch is checked.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::buffer::Buffer;

/// Bytes copied and hashed at a time: small enough that a chunk just
/// written is still in the core's cache when it is hashed.
const CHUNK: usize = 256 << 10;

/// The BLAKE3 digest (32 bytes) of a buffer's bytes.
#[pyfunction(name = "_digest")]
pub(crate) fn digest<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let buf = Buffer::readable(data)?;
    let bytes = buf.as_slice();
    let (ptr, len) = (bytes.as_ptr() as usize, bytes.len());
    let out = crate::gil::released(py, move || {
        // SAFETY: `buf` (the export of `ptr..ptr + len`) lives until this
        // function returns, after this closure; the bytes are only read.
        let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
        *blake3::hash(bytes).as_bytes()
    });
    drop(buf);
    Ok(PyBytes::new(py, &out))
}

/// A BLAKE3 digest taken piece by piece, each piece copied into its place
/// first (`copy_update`): an output whose bytes arrive in chunks is hashed
/// as each lands, while the next is still being read.
#[pyclass(module = "pinshm", name = "_Digest")]
pub(crate) struct Digest {
    hasher: Option<blake3::Hasher>,
}

#[pymethods]
impl Digest {
    #[new]
    fn new() -> Self {
        Digest {
            hasher: Some(blake3::Hasher::new()),
        }
    }

    /// Copies `src` into `dst` (the same length) and adds what `dst` now
    /// holds to the digest (the GIL released).
    fn copy_update(
        &mut self,
        py: Python<'_>,
        dst: &Bound<'_, PyAny>,
        src: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let hasher = self.hasher.as_mut().ok_or_else(finished)?;
        copy_update(py, hasher, dst, src)
    }

    /// The digest of every piece added (32 bytes); the object is spent.
    fn finish<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let hasher = self.hasher.take().ok_or_else(finished)?;
        Ok(PyBytes::new(py, hasher.finalize().as_bytes()))
    }
}

fn finished() -> PyErr {
    pyo3::exceptions::PyValueError::new_err("this _Digest is finished")
}

/// Copies `src` into `dst` chunk by chunk, adding each chunk to `hasher`
/// from `dst` just after it is written.
fn copy_update(
    py: Python<'_>,
    hasher: &mut blake3::Hasher,
    dst: &Bound<'_, PyAny>,
    src: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let mut to = Buffer::writable(dst)?;
    let from = Buffer::readable(src)?;
    if to.len() != from.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "copy_update: a destination of {} bytes for a source of {}",
            to.len(),
            from.len()
        )));
    }
    let (d, s, len) = (
        to.as_mut_slice().as_mut_ptr() as usize,
        from.as_ptr() as usize,
        from.len(),
    );
    crate::gil::released(py, || {
        let mut at = 0;
        while at < len {
            let n = CHUNK.min(len - at);
            // SAFETY: both exports live until this function returns (after
            // this closure); `d..d + len` is writable (a writable export we
            // hold), `s..s + len` readable. The source is another process's
            // mapping: it is copied with a raw copy, never borrowed as a
            // slice, and `ptr::copy` (memmove) stays defined if a caller
            // passes overlapping buffers. The chunk hashed is the one just
            // written to `dst`, which only this call writes meanwhile.
            let chunk = unsafe {
                std::ptr::copy((s + at) as *const u8, (d + at) as *mut u8, n);
                std::slice::from_raw_parts((d + at) as *const u8, n)
            };
            hasher.update(chunk);
            at += n;
        }
    });
    drop(from);
    drop(to);
    Ok(())
}
