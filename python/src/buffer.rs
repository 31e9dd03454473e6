//! Borrowing the bytes of any Python object that exports a contiguous
//! buffer (`bytes`, `bytearray`, `memoryview`, a C-contiguous numpy array),
//! whatever its item format: pinshm stores bytes.

use std::os::raw::c_int;

use pyo3::ffi;
use pyo3::prelude::*;

/// A buffer exported by a Python object, released on drop. Not `Send`: it
/// is released with the GIL held, where it was taken.
pub(crate) struct Buffer {
    view: Box<ffi::Py_buffer>,
}

impl Buffer {
    /// Asks `obj` for its bytes, read-only (`PyBUF_SIMPLE`: one contiguous
    /// run of bytes; a non-contiguous exporter refuses with its own error).
    pub(crate) fn readable(obj: &Bound<'_, PyAny>) -> PyResult<Buffer> {
        Self::get(obj, ffi::PyBUF_SIMPLE)
    }

    /// Asks `obj` for its bytes, writable (`bytes` refuses: `BufferError`).
    pub(crate) fn writable(obj: &Bound<'_, PyAny>) -> PyResult<Buffer> {
        Self::get(obj, ffi::PyBUF_WRITABLE)
    }

    fn get(obj: &Bound<'_, PyAny>, flags: c_int) -> PyResult<Buffer> {
        let mut view = Box::new(std::mem::MaybeUninit::<ffi::Py_buffer>::zeroed());
        // SAFETY: `obj` is a live object (we hold a reference and the GIL);
        // `view` points to writable memory for one Py_buffer, which the call
        // fills on success.
        let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), view.as_mut_ptr(), flags) };
        if rc != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        // SAFETY: the call succeeded, so the Py_buffer is initialised (and
        // the Box<MaybeUninit<T>> has the layout of a Box<T>).
        let view = unsafe { Box::from_raw(Box::into_raw(view).cast::<ffi::Py_buffer>()) };
        Ok(Buffer { view })
    }

    pub(crate) fn len(&self) -> usize {
        // A successful export has len >= 0.
        usize::try_from(self.view.len).unwrap_or(0)
    }

    /// The address of the exported bytes, never borrowed as a slice: for
    /// memory another process may write while it is read.
    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.view.buf.cast::<u8>().cast_const()
    }

    /// The exported bytes. Other Python threads may run while a caller
    /// reads them with the GIL released (as `hashlib` and `file.write` do):
    /// a thread that writes the same buffer meanwhile gets unspecified
    /// bytes stored, as with any C extension that releases the GIL.
    pub(crate) fn as_slice(&self) -> &[u8] {
        if self.len() == 0 {
            return &[];
        }
        // SAFETY: with PyBUF_SIMPLE or PyBUF_WRITABLE (neither asks for
        // strides), a successful export is `len` contiguous bytes at `buf`,
        // valid and not resized until PyBuffer_Release, which runs only when
        // `self` drops, after this borrow ends.
        unsafe { std::slice::from_raw_parts(self.view.buf.cast::<u8>(), self.len()) }
    }

    /// The exported bytes, for writing (only for a buffer from `writable`).
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len() == 0 {
            return &mut [];
        }
        debug_assert!(self.view.readonly == 0);
        // SAFETY: as in `as_slice`; the export was asked for with
        // PyBUF_WRITABLE, so the exporter allows writes, and `&mut self`
        // makes this the only slice of it we hand out.
        unsafe { std::slice::from_raw_parts_mut(self.view.buf.cast::<u8>(), self.len()) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer and
        // is released once; `Buffer` is not Send, so the GIL taken where it
        // was made is held here too.
        unsafe { ffi::PyBuffer_Release(&mut *self.view) };
    }
}

/// Fills `view` (a `__getbuffer__` request) with a read-only export of the
/// `len` bytes at `data`, owned by `owner`, which goes into `view.obj` and
/// so lives at least as long as the export (and as long as any consumer
/// keeps `view.obj`). `what` names the exporter in errors. A writable
/// request is refused (`BufferError`).
///
/// # Safety
/// 1. `view` is the `Py_buffer` Python asked to fill.
/// 2. `data..data + len` stays valid, and nobody writes it, while `owner`
///    lives.
pub(crate) unsafe fn export_read_only(
    owner: Bound<'_, PyAny>,
    view: *mut ffi::Py_buffer,
    flags: c_int,
    data: *const u8,
    len: usize,
    what: &str,
) -> PyResult<()> {
    use pyo3::exceptions::PyBufferError;
    if flags & ffi::PyBUF_WRITABLE != 0 {
        return Err(PyBufferError::new_err(format!(
            "a {what}'s buffer is read-only"
        )));
    }
    // SAFETY: the caller's contract, read-only.
    unsafe { fill(owner, view, flags, data.cast_mut(), len, true, what) }
}

/// As [`export_read_only`], but the export is writable: the bytes are
/// `owner`'s own (no other process or object reads them).
///
/// # Safety
/// 1. `view` is the `Py_buffer` Python asked to fill.
/// 2. `data..data + len` stays valid while `owner` lives, and only the
///    holders of this export (and others of the same owner) write it.
pub(crate) unsafe fn export_writable(
    owner: Bound<'_, PyAny>,
    view: *mut ffi::Py_buffer,
    flags: c_int,
    data: *mut u8,
    len: usize,
    what: &str,
) -> PyResult<()> {
    // SAFETY: the caller's contract.
    unsafe { fill(owner, view, flags, data, len, false, what) }
}

/// # Safety
/// As [`export_writable`]; with `readonly`, nobody writes the bytes.
unsafe fn fill(
    owner: Bound<'_, PyAny>,
    view: *mut ffi::Py_buffer,
    flags: c_int,
    data: *mut u8,
    len: usize,
    readonly: bool,
    what: &str,
) -> PyResult<()> {
    use pyo3::exceptions::PyBufferError;
    let len = ffi::Py_ssize_t::try_from(len)
        .map_err(|_| PyBufferError::new_err(format!("{what} too large for a buffer")))?;
    // SAFETY: the caller's contract: `view` is ours to fill, and the bytes
    // outlive `owner`, to which FillInfo stores a new reference in
    // `view.obj`.
    let rc = unsafe {
        ffi::PyBuffer_FillInfo(
            view,
            owner.as_ptr(),
            data.cast::<std::ffi::c_void>(),
            len,
            c_int::from(readonly),
            flags,
        )
    };
    if rc != 0 {
        return Err(PyErr::fetch(owner.py()));
    }
    Ok(())
}

/// What a view's `release()` takes: the held value in `held`, unless
/// exports of it (its other clones) are alive, which is a BufferError
/// naming `what`. `None` once released. Clones are made only under this
/// mutex, so the count cannot grow meanwhile; it may only shrink.
pub(crate) fn take_unshared<T>(
    held: &std::sync::Mutex<Option<std::sync::Arc<T>>>,
    what: &str,
) -> PyResult<Option<std::sync::Arc<T>>> {
    let mut st = crate::lock(held);
    if let Some(h) = st.as_ref() {
        let others = std::sync::Arc::strong_count(h) - 1;
        if others > 0 {
            return Err(pyo3::exceptions::PyBufferError::new_err(format!(
                "cannot release a {what} while {others} exported view(s) of it are \
                 alive (release the memoryviews, delete the arrays)"
            )));
        }
    }
    Ok(st.take())
}
