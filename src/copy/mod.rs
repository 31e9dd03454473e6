//! Asynchronous host↔device copies into and out of slots.
//!
//! A [`CopyEngine`] starts copies and hands back [`Ticket`]s that complete
//! later. [`CpuEngine`] emulates a device with host memory and a worker
//! thread (completions over crossbeam-channel), so the whole asynchronous
//! protocol runs in CI without a GPU; `CudaEngine` (feature `cuda`) uses a
//! CUDA stream and events.
//!
//! The protocol the store keeps:
//! * [`ObjectStore::put_from_device`] reserves a slot and starts the copy
//!   into it; the [`ObjectHandle`] exists only once the copy has completed
//!   ([`ObjectStore::finish_put`]), so no reader can see a half-filled slot.
//!   Several puts can be in flight; a pending slot is never reclaimed.
//! * [`StoreReader::get_to_device`] validates the handle, holds the slot (a
//!   guard) and starts the copy out; the read is acknowledged and the slot
//!   released only when the copy has completed, never at enqueue.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};

mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(feature = "cuda")]
pub(crate) mod kernels;
pub use cpu::{CpuEngine, Pause};

/// Which device an engine or buffer belongs to.
pub type DeviceId = u64;

/// A range of device memory: an address on one device, a length, and
/// whatever keeps it alive.
#[derive(Clone)]
pub struct DeviceBuffer {
    ptr: u64,
    len: usize,
    device: DeviceId,
    keep: Option<Arc<dyn Any + Send + Sync>>,
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("device", &self.device)
            .finish()
    }
}

impl DeviceBuffer {
    /// A buffer over memory the caller owns (a tensor of another framework).
    ///
    /// # Safety
    /// 1. `ptr..ptr+len` is device memory of `device` (as the engine that
    ///    will copy it names its device).
    /// 2. It stays allocated, and nobody else writes it while a copy into
    ///    or out of it is in flight.
    pub unsafe fn from_raw(ptr: u64, len: usize, device: DeviceId) -> Self {
        DeviceBuffer {
            ptr,
            len,
            device,
            keep: None,
        }
    }

    pub(crate) fn owned(
        ptr: u64,
        len: usize,
        device: DeviceId,
        keep: Arc<dyn Any + Send + Sync>,
    ) -> Self {
        DeviceBuffer {
            ptr,
            len,
            device,
            keep: Some(keep),
        }
    }

    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device it lives on.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// Whatever keeps the memory alive (for engines to hold while copying).
    pub fn keep_alive(&self) -> Option<KeepAlive> {
        self.keep.clone()
    }

    /// A sub-range of this buffer, sharing its keep-alive.
    pub fn slice(&self, offset: usize, len: usize) -> Result<DeviceBuffer> {
        if offset.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(Error::DeviceRange(format!(
                "slice {offset}..{} of a {}-byte device buffer",
                offset.saturating_add(len),
                self.len
            )));
        }
        Ok(DeviceBuffer {
            ptr: self.ptr + offset as u64,
            len,
            device: self.device,
            keep: self.keep.clone(),
        })
    }
}

/// Whatever keeps memory alive under a copy: an engine holds it until the
/// copy has stopped touching that memory.
pub type KeepAlive = Arc<dyn Any + Send + Sync>;

/// Completion of one asynchronous operation.
///
/// # Safety
/// The store releases memory on this trait's word, so an implementation
/// promises:
/// 1. `poll` returns `Ok(true)`, and `wait` returns `Ok` or an error other
///    than [`Error::DeviceLost`], only once the operation will never again
///    read or write any memory it was started on. `poll` returns `Err` only
///    when it cannot tell; callers treat that as "not done". `wait` returns
///    `Err(DeviceLost)` when it cannot confirm the end: the engine then
///    keeps the operation's keep-alives for good, and callers never reuse
///    the memory.
/// 2. Dropping the completion (or leaking it) before it is done does not
///    release the keep-alives the operation was started with while the
///    operation may still touch their memory.
pub unsafe trait Completion: Send + Sync + fmt::Debug {
    /// Whether it has finished (successfully or not), without blocking.
    fn poll(&self) -> Result<bool>;
    /// Blocks until it has finished; its outcome.
    fn wait(&self) -> Result<()>;
}

/// A handle on an asynchronous copy.
#[derive(Clone, Debug)]
pub struct Ticket {
    inner: Arc<dyn Completion>,
}

impl Ticket {
    /// Wraps an engine's completion.
    pub fn new(c: impl Completion + 'static) -> Self {
        Ticket { inner: Arc::new(c) }
    }

    /// Whether the copy has finished.
    pub fn poll(&self) -> Result<bool> {
        self.inner.poll()
    }

    /// Blocks until the copy has finished.
    pub fn wait(&self) -> Result<()> {
        self.inner.wait()
    }
}

/// One piece of a gather (`pack`) or scatter (`unpack`): `rows` rows of
/// `row_bytes` bytes, `pitch` bytes apart on the device, laid out densely at
/// `offset` in the packed host buffer. A contiguous tensor is one row.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct PackDesc {
    /// Device address of the first row.
    pub device_ptr: u64,
    /// Offset of this piece in the packed buffer.
    pub offset: u64,
    /// Number of rows.
    pub rows: u64,
    /// Bytes per row.
    pub row_bytes: u64,
    /// Distance between row starts on the device (≥ row_bytes).
    pub pitch: u64,
}

impl PackDesc {
    /// A contiguous piece.
    pub fn contiguous(device_ptr: u64, len: u64, offset: u64) -> Self {
        PackDesc {
            device_ptr,
            offset,
            rows: 1,
            row_bytes: len,
            pitch: len,
        }
    }

    fn packed_len(&self) -> Option<u64> {
        self.rows.checked_mul(self.row_bytes)
    }
}

/// Checks that every piece fits a packed buffer of `len` bytes and has a
/// sane pitch; returns the bytes the pieces cover.
pub fn check_pack(descs: &[PackDesc], len: usize) -> Result<u64> {
    let mut total = 0u64;
    for (i, d) in descs.iter().enumerate() {
        let bad = |why: &str| Error::DeviceRange(format!("pack piece {i}: {why}"));
        let n = d.packed_len().ok_or_else(|| bad("size overflows"))?;
        if d.rows > 1 && d.pitch < d.row_bytes {
            return Err(bad("pitch smaller than a row"));
        }
        if d.offset.checked_add(n).is_none_or(|e| e > len as u64) {
            return Err(bad(&format!("ends past the {len}-byte buffer")));
        }
        if d.rows > 0
            && d.pitch
                .checked_mul(d.rows - 1)
                .and_then(|x| x.checked_add(d.row_bytes))
                .and_then(|x| x.checked_add(d.device_ptr))
                .is_none()
        {
            return Err(bad("device range overflows"));
        }
        total = total.saturating_add(n);
    }
    Ok(total)
}

/// CPU reference of the `pack` kernel: gathers every piece into `dst`.
///
/// # Safety
/// Every piece's rows (`device_ptr + r × pitch`, `row_bytes` long) are
/// readable host memory not written meanwhile; `check_pack(descs, dst.len())`
/// holds (it is checked again here).
pub unsafe fn pack_cpu(descs: &[PackDesc], dst: &mut [u8]) -> Result<()> {
    check_pack(descs, dst.len())?;
    for d in descs {
        for r in 0..d.rows {
            let src = (d.device_ptr + r * d.pitch) as *const u8;
            let at = (d.offset + r * d.row_bytes) as usize;
            // SAFETY: the caller's contract for the source; the destination
            // range was checked by check_pack.
            unsafe {
                std::ptr::copy_nonoverlapping(src, dst[at..].as_mut_ptr(), d.row_bytes as usize)
            };
        }
    }
    Ok(())
}

/// CPU reference of the `unpack` kernel: scatters `src` back to the pieces.
///
/// # Safety
/// Every piece's rows are writable host memory nobody else touches
/// meanwhile; `check_pack(descs, src.len())` holds (checked again here).
pub unsafe fn unpack_cpu(descs: &[PackDesc], src: &[u8]) -> Result<()> {
    check_pack(descs, src.len())?;
    for d in descs {
        for r in 0..d.rows {
            let dst = (d.device_ptr + r * d.pitch) as *mut u8;
            let at = (d.offset + r * d.row_bytes) as usize;
            // SAFETY: the caller's contract for the destination; the source
            // range was checked by check_pack.
            unsafe { std::ptr::copy_nonoverlapping(src[at..].as_ptr(), dst, d.row_bytes as usize) };
        }
    }
    Ok(())
}

/// Starts asynchronous copies between host memory and one device.
///
/// # Safety
/// The store hands an engine memory it may free or reuse as soon as the
/// engine says a copy is done, so an implementation promises:
/// 1. Every [`Ticket`] it returns carries a [`Completion`] that keeps that
///    trait's promises.
/// 2. Each `*_async` method holds `keep` (and the device buffers'
///    [`DeviceBuffer::keep_alive`]) until the copy has stopped touching
///    that memory, whatever happens to the ticket (dropped, leaked).
/// 3. `upload` and `download` are ordered with the copies started before
///    them, as on one stream: they do not touch a buffer a queued copy is
///    still using.
pub unsafe trait CopyEngine: Send + Sync {
    /// The device this engine copies to and from.
    fn device(&self) -> DeviceId;

    /// Device memory of `len` bytes.
    fn alloc(&self, len: usize) -> Result<DeviceBuffer>;

    /// Synchronous upload (for setting up and testing), ordered after the
    /// copies started before it.
    fn upload(&self, src: &[u8], dst: &DeviceBuffer) -> Result<()>;

    /// Synchronous download (for setting up and testing), ordered after the
    /// copies started before it.
    fn download(&self, src: &DeviceBuffer, dst: &mut [u8]) -> Result<()>;

    /// Starts copying `src` (all of it) to host memory at `dst`.
    ///
    /// # Safety
    /// `dst..dst+src.len()` is valid for writes and nobody else reads or
    /// writes it until the ticket completes; it stays valid that long, or
    /// `keep` keeps it valid.
    unsafe fn d2h_async(
        &self,
        src: &DeviceBuffer,
        dst: *mut u8,
        keep: Option<KeepAlive>,
    ) -> Result<Ticket>;

    /// Starts copying `len` host bytes at `src` into `dst` (from its start).
    ///
    /// # Safety
    /// `src..src+len` is valid and nobody writes it until the ticket
    /// completes; it stays valid that long, or `keep` keeps it valid.
    unsafe fn h2d_async(
        &self,
        src: *const u8,
        len: usize,
        dst: &DeviceBuffer,
        keep: Option<KeepAlive>,
    ) -> Result<Ticket>;

    /// Starts gathering `descs` into `len` host bytes at `dst` in one go
    /// (one kernel launch on CUDA).
    ///
    /// # Safety
    /// As [`pack_cpu`] for the pieces (device memory of this engine's
    /// device, kept alive until completion), and as `d2h_async` for `dst`.
    unsafe fn pack_async(
        &self,
        descs: &[PackDesc],
        dst: *mut u8,
        len: usize,
        keep: Option<KeepAlive>,
    ) -> Result<Ticket>;

    /// Starts scattering `len` host bytes at `src` to `descs`.
    ///
    /// # Safety
    /// As [`unpack_cpu`] for the pieces, and as `h2d_async` for `src`.
    unsafe fn unpack_async(
        &self,
        src: *const u8,
        len: usize,
        descs: &[PackDesc],
        keep: Option<KeepAlive>,
    ) -> Result<Ticket>;

    /// `Err(WrongDevice)` unless `buf` is memory of this engine's device.
    fn check_device(&self, buf: &DeviceBuffer) -> Result<()> {
        if buf.device != self.device() {
            return Err(Error::WrongDevice {
                buffer: buf.device,
                engine: self.device(),
            });
        }
        Ok(())
    }

    /// `Err` unless `len` bytes fit in `buf`, of this engine's device.
    fn check_fits(&self, len: usize, buf: &DeviceBuffer) -> Result<()> {
        self.check_device(buf)?;
        if len > buf.len {
            return Err(Error::DeviceRange(format!(
                "{len} bytes do not fit a {}-byte device buffer",
                buf.len
            )));
        }
        Ok(())
    }
}

/// Waits for every ticket, even after one fails (every copy must have
/// stopped before its memory is released); the first error, except that a
/// [`Error::DeviceLost`] wins (the memory must then never be released).
pub(crate) fn wait_all(tickets: impl IntoIterator<Item = Ticket>) -> Result<()> {
    let mut first = Ok(());
    for t in tickets {
        if let Err(e) = t.wait() {
            let lost = matches!(e, Error::DeviceLost { .. });
            if first.is_ok() || lost {
                first = Err(e);
            }
        }
    }
    first
}
