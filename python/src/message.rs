//! `pinshm.MessageView`: a channel message received in place, exported
//! through the buffer protocol with no copy (`BroadcastReader.recv_view`).
//!
//! The same pattern as `reader.rs`'s `ReadGuard`: a Rust `Message<'r>`
//! borrows its `BroadcastReader`, so the reader lives in an `Arc`
//! (`SharedReader`), and a held message (`HeldMessage`) owns a clone of
//! that `Arc` beside the message, whose borrow is erased to `'static`. A
//! `HeldMessage` is shared, in an `Arc`, by the Python `MessageView` and by
//! each buffer export of it (`_MessageExport`, the export's `view.obj`):
//! the message is released when the last of them goes.
//!
//! A receive holds the reader's mutex while it waits (GIL released). A
//! view dropped meanwhile by another thread does not wait for it: its
//! message is queued (`SharedReader::pending`) and released when that
//! receive unlocks (it returns, or its wait step ends, see
//! `channel::STEP`: at most 100 ms later). In one thread, releasing is
//! immediate.

use std::mem::ManuallyDrop;
use std::os::raw::c_int;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::{lock, Home};

/// A message whose view was dropped while a receive held the reader:
/// released (dropped) by the next holder of the reader's mutex.
struct Pending(ManuallyDrop<pinshm::Message<'static>>);

// SAFETY: a `Message` is thread-bound only through its reference to the
// reader, which its drop uses; a `Pending` is dropped only with the
// reader's mutex held (`SharedReader::reader`) or when the `SharedReader`
// itself is dropped (nobody else can use the reader then), so every use of
// the reader stays serialised.
unsafe impl Send for Pending {}

impl Drop for Pending {
    fn drop(&mut self) {
        // SAFETY: dropped once, here (see `unsafe impl Send` for the lock).
        unsafe { ManuallyDrop::drop(&mut self.0) };
    }
}

/// A reader shared by the Python `BroadcastReader` and the messages held
/// from it. It is reached only through `SharedReader::lock` (a shared
/// `&BroadcastReader`, never a `&mut`), so a message's borrow of it is
/// never invalidated.
pub(crate) struct SharedReader {
    /// Before `reader`: a `SharedReader` dropped with messages queued drops
    /// them (releasing them) while the reader still exists.
    pending: Mutex<Vec<Pending>>,
    reader: Mutex<pinshm::BroadcastReader>,
    /// The process that attached it.
    pub(crate) home: Home,
}

impl SharedReader {
    pub(crate) fn new(reader: pinshm::BroadcastReader) -> SharedReader {
        SharedReader {
            home: Home::new(reader.name()),
            pending: Mutex::new(Vec::new()),
            reader: Mutex::new(reader),
        }
    }

    /// Locks the reader, first releasing the messages queued while
    /// another call held it; they are released again when it unlocks.
    pub(crate) fn lock(&self) -> ReaderLock<'_> {
        let g = lock(&self.reader);
        self.release_pending();
        ReaderLock {
            shared: self,
            guard: Some(g),
        }
    }

    /// As `lock`, or `None` if another call holds the reader now.
    pub(crate) fn try_lock(&self) -> Option<ReaderLock<'_>> {
        let g = match self.reader.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        self.release_pending();
        Some(ReaderLock {
            shared: self,
            guard: Some(g),
        })
    }

    /// Drops the queued messages (the caller holds the reader's mutex).
    fn release_pending(&self) {
        let queued = std::mem::take(&mut *lock(&self.pending));
        drop(queued);
    }

    fn has_pending(&self) -> bool {
        !lock(&self.pending).is_empty()
    }
}

/// The reader, locked. Unlocking releases what was queued meanwhile: a
/// view dropped while this lock was held queued its message, and nobody
/// else may come to release it (the writer may be waiting for that slot).
pub(crate) struct ReaderLock<'a> {
    shared: &'a SharedReader,
    guard: Option<MutexGuard<'a, pinshm::BroadcastReader>>,
}

impl std::ops::Deref for ReaderLock<'_> {
    type Target = pinshm::BroadcastReader;
    fn deref(&self) -> &pinshm::BroadcastReader {
        self.guard.as_ref().expect("held until drop")
    }
}

impl Drop for ReaderLock<'_> {
    fn drop(&mut self) {
        self.shared.release_pending();
        drop(self.guard.take());
        // Queued after that drain, while the lock was still held: the
        // queuer saw it held, so it is this lock's (or the next holder's)
        // to release. `try_lock` drains, and so does its own unlock.
        if self.shared.has_pending() {
            drop(self.shared.try_lock());
        }
    }
}

/// One message held open: the core's message, with its borrow of the
/// reader erased, and the reader it borrows.
pub(crate) struct HeldMessage {
    /// Dropped (or queued) by `Drop for HeldMessage`, before `reader`;
    /// leaked, never used again, in a forked child.
    msg: ManuallyDrop<pinshm::Message<'static>>,
    reader: Arc<SharedReader>,
    data: *const u8,
    len: usize,
    seq: u64,
}

// SAFETY: the message's only thread-bound parts are its reference to the
// reader, used only by its drop, which runs with the reader's mutex held
// (`Drop for HeldMessage`, or queued as a `Pending`), and its pointer into
// the mapping, which the reader keeps mapped and which is only read.
unsafe impl Send for HeldMessage {}
// SAFETY: through `&HeldMessage` only the slot's bytes (read-only while
// the message is held) and plain values are read, never the reader.
unsafe impl Sync for HeldMessage {}

impl HeldMessage {
    /// Wraps a message received from `reader` (the caller holds
    /// `shared.reader`'s mutex, and `reader` is the reader inside it).
    pub(crate) fn new(shared: &Arc<SharedReader>, msg: pinshm::Message<'_>) -> HeldMessage {
        let (data, len, seq) = (msg.as_ptr(), msg.len(), msg.seq());
        // SAFETY: erasing the message's borrow of the reader to 'static is
        // sound because the `HeldMessage` built here:
        // 1. keeps the borrowed reader alive: it owns a clone of the Arc
        //    that holds it, and drops (or queues, in the same
        //    `SharedReader`, whose `pending` drops before its `reader`)
        //    the message before that clone; a leaked `HeldMessage` leaks
        //    its Arc too, and a message leaked in a forked child is never
        //    used again, so the reference can never dangle;
        // 2. keeps it in place: the reader lives inside the Arc's heap
        //    allocation and is never moved out nor borrowed mutably (see
        //    `SharedReader`), so the shared borrow stays valid;
        // 3. keeps it single-threaded: the message touches the reader only
        //    in its drop, which runs under the reader's mutex.
        // The message, for its part, keeps its slot from being rewritten,
        // so `data..data + len` holds its bytes until it drops.
        let msg =
            unsafe { std::mem::transmute::<pinshm::Message<'_>, pinshm::Message<'static>>(msg) };
        HeldMessage {
            msg: ManuallyDrop::new(msg),
            reader: Arc::clone(shared),
            data,
            len,
            seq,
        }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `data..data + len` is the slice the message derefs to;
        // the message lives as long as `self`, and with it the mapping and
        // the release mark that keeps the writer off the slot.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }
}

impl Drop for HeldMessage {
    fn drop(&mut self) {
        // In a forked child the message is the parent's: leaked (the
        // reader's mutex may be locked forever there, and the core's drop
        // would release nothing anyway).
        if self.reader.home.forked() {
            return;
        }
        // SAFETY: taken once, here; `self.msg` is not used afterwards.
        let msg = unsafe { ManuallyDrop::take(&mut self.msg) };
        match self.reader.try_lock() {
            Some(_reader) => drop(msg),
            None => {
                // A receive in another thread holds the reader: queued, it
                // is released when that call unlocks (see `ReaderLock`), or
                // here if the call let go meanwhile.
                lock(&self.reader.pending).push(Pending(ManuallyDrop::new(msg)));
                drop(self.reader.try_lock());
            }
        }
    }
}

/// The owner of one buffer export of a `MessageView`: what the exported
/// `Py_buffer`'s `obj` points to, holding the message for as long as a
/// consumer keeps it (as `reader.rs`'s `_SlotExport` does).
#[pyclass(module = "pinshm", frozen, name = "_MessageExport")]
pub(crate) struct MessageExport {
    _held: Arc<HeldMessage>,
}

/// A channel message received in place (`BroadcastReader.recv_view`): its
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
            seq: held.seq,
            len: held.len,
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
        let (data, len) = (held.data, held.len);
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
