//! Layer 6: asynchronous host↔device copies into and out of slots.
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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};

use crate::codec::{self, DType, ItemLayout};
use crate::error::{Error, Result};
use crate::store::{ObjectHandle, ObjectStore, PendingCopy, ReadGuard, StoreReader};

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
    pub fn keep_alive(&self) -> Option<Arc<dyn Any + Send + Sync>> {
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

/// Completion of one asynchronous operation.
pub trait Completion: Send + Sync + fmt::Debug {
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
        total += n;
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
pub trait CopyEngine: Send + Sync {
    /// The device this engine copies to and from.
    fn device(&self) -> DeviceId;

    /// Device memory of `len` bytes.
    fn alloc(&self, len: usize) -> Result<DeviceBuffer>;

    /// Synchronous upload (for setting up and testing).
    fn upload(&self, src: &[u8], dst: &DeviceBuffer) -> Result<()>;

    /// Synchronous download (for setting up and testing).
    fn download(&self, src: &DeviceBuffer, dst: &mut [u8]) -> Result<()>;

    /// Starts copying `src` (all of it) to host memory at `dst`.
    ///
    /// # Safety
    /// `dst..dst+src.len()` stays valid for writes, and nobody else reads or
    /// writes it, until the ticket completes.
    unsafe fn d2h_async(&self, src: &DeviceBuffer, dst: *mut u8) -> Result<Ticket>;

    /// Starts copying `len` host bytes at `src` into `dst` (from its start).
    ///
    /// # Safety
    /// `src..src+len` stays valid and unwritten until the ticket completes.
    unsafe fn h2d_async(&self, src: *const u8, len: usize, dst: &DeviceBuffer) -> Result<Ticket>;

    /// Starts gathering `descs` into `len` host bytes at `dst` in one go
    /// (one kernel launch on CUDA).
    ///
    /// # Safety
    /// As [`pack_cpu`] for the pieces (device memory of this engine's
    /// device, kept alive until completion), and as `d2h_async` for `dst`.
    unsafe fn pack_async(&self, descs: &[PackDesc], dst: *mut u8, len: usize) -> Result<Ticket>;

    /// Starts scattering `len` host bytes at `src` to `descs`.
    ///
    /// # Safety
    /// As [`unpack_cpu`] for the pieces, and as `h2d_async` for `src`.
    unsafe fn unpack_async(&self, src: *const u8, len: usize, descs: &[PackDesc])
        -> Result<Ticket>;
}

fn check_device(engine: &(impl CopyEngine + ?Sized), buf: &DeviceBuffer) -> Result<()> {
    if buf.device != engine.device() {
        return Err(Error::WrongDevice {
            buffer: buf.device,
            engine: engine.device(),
        });
    }
    Ok(())
}

// ---------------------------------------------------------------- CpuEngine

enum Job {
    Copy {
        src: usize,
        dst: usize,
        len: usize,
    },
    Pack {
        descs: Vec<PackDesc>,
        dst: usize,
        len: usize,
    },
    Unpack {
        descs: Vec<PackDesc>,
        src: usize,
        len: usize,
    },
}

struct Work {
    job: Job,
    keep: Vec<Arc<dyn Any + Send + Sync>>,
    done: Sender<Result<(), String>>,
}

/// An emulated device: "device memory" is host memory, copies run in order
/// on one worker thread (like a stream), optionally slowed down to let tests
/// observe copies in flight.
#[derive(Debug)]
pub struct CpuEngine {
    id: DeviceId,
    jobs: Option<Sender<Work>>,
    worker: Option<std::thread::JoinHandle<()>>,
}

/// Memory of a [`CpuEngine`] buffer.
struct CpuMem {
    _bytes: Box<[std::cell::UnsafeCell<u8>]>,
}
// SAFETY: the bytes are only reached through raw pointers under the copy
// protocol (a buffer is not written by two copies at once, by contract).
unsafe impl Sync for CpuMem {}

impl Default for CpuEngine {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuEngine {
    /// An engine whose copies run at memcpy speed.
    pub fn new() -> Self {
        Self::with_delay(Duration::ZERO)
    }

    /// An engine that waits `delay` before each copy (for tests).
    pub fn with_delay(delay: Duration) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let (tx, rx) = crossbeam_channel::unbounded::<Work>();
        let worker = std::thread::Builder::new()
            .name("pinshm-cpu-engine".into())
            .spawn(move || {
                for w in rx {
                    if !delay.is_zero() {
                        std::thread::sleep(delay);
                    }
                    let r = run_job(&w.job);
                    drop(w.keep);
                    let _ = w.done.send(r);
                }
            })
            .expect("spawn the CPU copy engine's worker thread");
        CpuEngine {
            id: (1 << 63) | NEXT.fetch_add(1, Ordering::Relaxed),
            jobs: Some(tx),
            worker: Some(worker),
        }
    }

    fn submit(&self, job: Job, keep: Vec<Arc<dyn Any + Send + Sync>>) -> Result<Ticket> {
        let (done, rx) = crossbeam_channel::bounded(1);
        self.jobs
            .as_ref()
            .expect("jobs sender lives until drop")
            .send(Work { job, keep, done })
            .map_err(|_| Error::Copy("CPU engine worker is gone".into()))?;
        Ok(Ticket::new(CpuCompletion {
            rx,
            outcome: std::sync::OnceLock::new(),
        }))
    }
}

fn run_job(job: &Job) -> Result<(), String> {
    // SAFETY (all arms): the submitter's contract (d2h_async / h2d_async /
    // pack_async / unpack_async) keeps every range valid and unshared until
    // this job reports completion.
    match *job {
        Job::Copy { src, dst, len } => unsafe {
            std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len);
            Ok(())
        },
        Job::Pack {
            ref descs,
            dst,
            len,
        } => unsafe {
            pack_cpu(descs, std::slice::from_raw_parts_mut(dst as *mut u8, len))
                .map_err(|e| e.to_string())
        },
        Job::Unpack {
            ref descs,
            src,
            len,
        } => unsafe {
            unpack_cpu(descs, std::slice::from_raw_parts(src as *const u8, len))
                .map_err(|e| e.to_string())
        },
    }
}

impl Drop for CpuEngine {
    fn drop(&mut self) {
        // Close the queue, let queued copies finish (their memory is still
        // borrowed by pending puts and gets), then join.
        self.jobs.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

#[derive(Debug)]
struct CpuCompletion {
    rx: Receiver<Result<(), String>>,
    outcome: std::sync::OnceLock<Result<(), String>>,
}

impl Completion for CpuCompletion {
    fn poll(&self) -> Result<bool> {
        if self.outcome.get().is_none() {
            if let Ok(r) = self.rx.try_recv() {
                let _ = self.outcome.set(r);
            }
        }
        Ok(self.outcome.get().is_some())
    }

    fn wait(&self) -> Result<()> {
        let r = self.outcome.get_or_init(|| {
            self.rx
                .recv()
                .unwrap_or_else(|_| Err("CPU engine stopped before the copy ran".into()))
        });
        r.clone().map_err(Error::Copy)
    }
}

impl CopyEngine for CpuEngine {
    fn device(&self) -> DeviceId {
        self.id
    }

    fn alloc(&self, len: usize) -> Result<DeviceBuffer> {
        let mem: Box<[std::cell::UnsafeCell<u8>]> =
            (0..len).map(|_| std::cell::UnsafeCell::new(0)).collect();
        let ptr = mem.as_ptr() as u64;
        Ok(DeviceBuffer::owned(
            ptr,
            len,
            self.id,
            Arc::new(CpuMem { _bytes: mem }),
        ))
    }

    fn upload(&self, src: &[u8], dst: &DeviceBuffer) -> Result<()> {
        check_device(self, dst)?;
        if src.len() > dst.len {
            return Err(Error::DeviceRange(format!(
                "{} bytes into a {}-byte buffer",
                src.len(),
                dst.len
            )));
        }
        // SAFETY: dst is this engine's host-backed buffer of dst.len bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.ptr as *mut u8, src.len()) };
        Ok(())
    }

    fn download(&self, src: &DeviceBuffer, dst: &mut [u8]) -> Result<()> {
        check_device(self, src)?;
        if dst.len() < src.len {
            return Err(Error::DeviceRange(format!(
                "{} bytes into {}",
                src.len,
                dst.len()
            )));
        }
        // SAFETY: src is this engine's host-backed buffer of src.len bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.ptr as *const u8, dst.as_mut_ptr(), src.len) };
        Ok(())
    }

    unsafe fn d2h_async(&self, src: &DeviceBuffer, dst: *mut u8) -> Result<Ticket> {
        check_device(self, src)?;
        let keep = src.keep.iter().cloned().collect();
        self.submit(
            Job::Copy {
                src: src.ptr as usize,
                dst: dst as usize,
                len: src.len,
            },
            keep,
        )
    }

    unsafe fn h2d_async(&self, src: *const u8, len: usize, dst: &DeviceBuffer) -> Result<Ticket> {
        check_device(self, dst)?;
        if len > dst.len {
            return Err(Error::DeviceRange(format!(
                "{len} bytes into a {}-byte device buffer",
                dst.len
            )));
        }
        let keep = dst.keep.iter().cloned().collect();
        self.submit(
            Job::Copy {
                src: src as usize,
                dst: dst.ptr as usize,
                len,
            },
            keep,
        )
    }

    unsafe fn pack_async(&self, descs: &[PackDesc], dst: *mut u8, len: usize) -> Result<Ticket> {
        check_pack(descs, len)?;
        self.submit(
            Job::Pack {
                descs: descs.to_vec(),
                dst: dst as usize,
                len,
            },
            Vec::new(),
        )
    }

    unsafe fn unpack_async(
        &self,
        src: *const u8,
        len: usize,
        descs: &[PackDesc],
    ) -> Result<Ticket> {
        check_pack(descs, len)?;
        self.submit(
            Job::Unpack {
                descs: descs.to_vec(),
                src: src as usize,
                len,
            },
            Vec::new(),
        )
    }
}

// ---------------------------------------------------------- store protocol

/// The store's view of a put in flight: its tickets, and whether the
/// caller still holds the [`PendingPut`].
#[derive(Debug)]
struct PutInFlight {
    tickets: Vec<Ticket>,
    token_alive: AtomicBool,
}

impl PendingCopy for PutInFlight {
    fn is_done(&self) -> bool {
        self.tickets.iter().all(|t| t.poll().unwrap_or(true))
    }
    fn wait(&self) -> Result<()> {
        // Wait for every ticket even after a failure: the slot must be quiet.
        let mut first = Ok(());
        for t in &self.tickets {
            if let Err(e) = t.wait() {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
    fn abandoned(&self) -> bool {
        !self.token_alive.load(Ordering::Acquire)
    }
}

/// A put whose copy into its slot is in flight. Finish it with
/// [`ObjectStore::finish_put`] (or poll with [`ObjectStore::try_finish_put`]);
/// dropped unfinished, the slot is freed once the copy stops.
#[derive(Debug)]
#[must_use = "the object is published only by finish_put"]
pub struct PendingPut {
    id: u64,
    store: u64,
    state: Arc<PutInFlight>,
}

impl Drop for PendingPut {
    fn drop(&mut self) {
        self.state.token_alive.store(false, Ordering::Release);
    }
}

impl ObjectStore {
    fn start_put(
        &mut self,
        key: &str,
        len: usize,
        kind: u32,
        start: impl FnOnce(*mut u8) -> Result<Vec<Ticket>>,
    ) -> Result<PendingPut> {
        let mut state = None;
        let id = self.begin_pending(key, len, kind, |payload| {
            let s = Arc::new(PutInFlight {
                tickets: start(payload)?,
                token_alive: AtomicBool::new(true),
            });
            state = Some(s.clone());
            Ok(s as Arc<dyn PendingCopy>)
        })?;
        Ok(PendingPut {
            id,
            store: self.identity(),
            state: state.expect("set by begin_pending on success"),
        })
    }

    /// Reserves a slot for `src.len()` bytes and starts copying `src` into
    /// it. The object becomes visible (gets its handle) only when
    /// [`ObjectStore::finish_put`] sees the copy complete.
    pub fn put_from_device<E: CopyEngine + ?Sized>(
        &mut self,
        key: &str,
        src: &DeviceBuffer,
        engine: &E,
    ) -> Result<PendingPut> {
        check_device(engine, src)?;
        // SAFETY: the slot is reserved for this put and not published until
        // finish_put has waited for the ticket; the store waits for pending
        // copies before unmapping.
        self.start_put(key, src.len, codec::KIND_RAW, |p| {
            Ok(vec![unsafe { engine.d2h_async(src, p)? }])
        })
    }

    /// As [`ObjectStore::put_from_device`] for a tensor of `dtype` and `shape`.
    pub fn put_tensor_from_device<E: CopyEngine + ?Sized>(
        &mut self,
        key: &str,
        dtype: DType,
        shape: &[u64],
        src: &DeviceBuffer,
        engine: &E,
    ) -> Result<PendingPut> {
        check_device(engine, src)?;
        let len = codec::payload_len(dtype, shape)?;
        if len != src.len {
            return Err(Error::DeviceRange(format!(
                "tensor {shape:?} of {dtype:?} is {len} bytes, the device buffer {}",
                src.len
            )));
        }
        self.start_put(
            key,
            len + codec::TENSOR_HEADER_LEN,
            codec::KIND_TENSOR,
            |p| {
                // SAFETY: p spans the reserved, unpublished object.
                let obj =
                    unsafe { std::slice::from_raw_parts_mut(p, len + codec::TENSOR_HEADER_LEN) };
                codec::write_tensor_header(obj, dtype, shape, len);
                // SAFETY: as put_from_device; the payload starts after the header.
                Ok(vec![unsafe {
                    engine.d2h_async(src, p.add(codec::TENSOR_HEADER_LEN))?
                }])
            },
        )
    }

    /// As [`ObjectStore::put_from_device`] for an item: one device buffer
    /// per field of `layout`, in order, each copied into its field.
    pub fn put_item_from_device<E: CopyEngine + ?Sized>(
        &mut self,
        key: &str,
        layout: &ItemLayout,
        srcs: &[&DeviceBuffer],
        engine: &E,
    ) -> Result<PendingPut> {
        let fields = &layout.header().fields;
        if srcs.len() != fields.len() {
            return Err(Error::DeviceRange(format!(
                "{} device buffers for {} fields",
                srcs.len(),
                fields.len()
            )));
        }
        for (f, s) in fields.iter().zip(srcs) {
            check_device(engine, s)?;
            if s.len as u64 != f.len {
                return Err(Error::DeviceRange(format!(
                    "field '{}' is {} bytes, its device buffer {}",
                    f.name, f.len, s.len
                )));
            }
        }
        self.start_put(key, layout.len(), codec::KIND_ITEM, |p| {
            // SAFETY: p spans the reserved, unpublished object.
            layout.write_header(unsafe { std::slice::from_raw_parts_mut(p, layout.len()) });
            let mut tickets = Vec::with_capacity(srcs.len());
            for (f, s) in fields.iter().zip(srcs) {
                // SAFETY: as put_from_device, into the field's own range.
                match unsafe { engine.d2h_async(s, p.add(f.offset as usize)) } {
                    Ok(t) => tickets.push(t),
                    Err(e) => {
                        // Copies already started must stop before the slot
                        // is given back.
                        tickets.iter().for_each(|t| drop(t.wait()));
                        return Err(e);
                    }
                }
            }
            Ok(tickets)
        })
    }

    /// Gathers many small or strided device tensors into one object of
    /// `len` bytes in one operation (one kernel launch on CUDA).
    ///
    /// # Safety
    /// Every piece of `descs` is device memory of `engine`'s device, kept
    /// alive and unwritten until the put is finished.
    pub unsafe fn put_packed_from_device<E: CopyEngine + ?Sized>(
        &mut self,
        key: &str,
        descs: &[PackDesc],
        len: usize,
        engine: &E,
    ) -> Result<PendingPut> {
        check_pack(descs, len)?;
        // SAFETY: the caller's contract for the pieces; the slot as in
        // put_from_device.
        self.start_put(key, len, codec::KIND_RAW, |p| {
            Ok(vec![unsafe { engine.pack_async(descs, p, len)? }])
        })
    }

    /// Waits for a pending put's copy and publishes the object. Errors if
    /// the copy failed (the slot is then freed in turn) or the store was
    /// cleared meanwhile (`Stale`).
    pub fn finish_put(&mut self, p: PendingPut) -> Result<ObjectHandle> {
        self.check_token(&p)?;
        self.finish_pending(p.id)
    }

    /// Publishes a pending put if its copy has completed; `None` if not yet.
    pub fn try_finish_put(&mut self, p: &PendingPut) -> Result<Option<ObjectHandle>> {
        self.check_token(p)?;
        if !self.pending_done(p.id) {
            return Ok(None);
        }
        self.finish_pending(p.id).map(Some)
    }

    fn check_token(&self, p: &PendingPut) -> Result<()> {
        if p.store != self.identity() {
            return Err(Error::InvalidConfig(
                "this PendingPut belongs to another store".into(),
            ));
        }
        Ok(())
    }
}

/// A copy out of a slot in flight. The slot is held (and the read not yet
/// acknowledged) until the copy has completed: [`PendingGet::wait`], or
/// drop, which waits too.
#[derive(Debug)]
#[must_use = "dropping a PendingGet blocks until its copy completes"]
pub struct PendingGet<'r> {
    tickets: Vec<Ticket>,
    guard: Option<ReadGuard<'r>>,
    len: usize,
}

impl PendingGet<'_> {
    /// Whether the copy has completed.
    pub fn poll(&self) -> Result<bool> {
        for t in &self.tickets {
            if !t.poll()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Waits for the copy, then acknowledges the read; returns bytes copied.
    pub fn wait(mut self) -> Result<usize> {
        let r = self.finish();
        r.map(|_| self.len)
    }

    fn finish(&mut self) -> Result<()> {
        let mut first = Ok(());
        for t in self.tickets.drain(..) {
            if let Err(e) = t.wait() {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        // Only now may the writer reuse the slot.
        self.guard.take();
        first
    }
}

impl Drop for PendingGet<'_> {
    fn drop(&mut self) {
        if self.guard.is_some() {
            if let Err(e) = self.finish() {
                tracing::debug!(%e, "copy out of a slot failed");
            }
        }
    }
}

impl StoreReader {
    /// Starts copying the object `h` into `dst` (from its start).
    pub fn get_to_device<'r, E: CopyEngine + ?Sized>(
        &'r self,
        h: ObjectHandle,
        dst: &DeviceBuffer,
        engine: &E,
    ) -> Result<PendingGet<'r>> {
        check_device(engine, dst)?;
        let guard = self.get(h)?;
        let len = guard.len();
        self.copy_out(guard, 0, len, dst, engine)
    }

    /// Starts copying the payload of tensor `h` into `dst`.
    pub fn get_tensor_to_device<'r, E: CopyEngine + ?Sized>(
        &'r self,
        h: ObjectHandle,
        dst: &DeviceBuffer,
        engine: &E,
    ) -> Result<PendingGet<'r>> {
        check_device(engine, dst)?;
        let guard = self.get(h)?;
        if guard.kind() != codec::KIND_TENSOR {
            return Err(Error::WrongKind {
                expected: codec::KIND_TENSOR,
                found: guard.kind(),
            });
        }
        let len = codec::TensorView::parse(&guard)?.bytes().len();
        self.copy_out(guard, codec::TENSOR_HEADER_LEN, len, dst, engine)
    }

    fn copy_out<'r, E: CopyEngine + ?Sized>(
        &'r self,
        guard: ReadGuard<'r>,
        offset: usize,
        len: usize,
        dst: &DeviceBuffer,
        engine: &E,
    ) -> Result<PendingGet<'r>> {
        debug_assert!(offset + len <= guard.len());
        if len > dst.len {
            return Err(Error::DeviceRange(format!(
                "object {}:{} has {len} bytes to copy, the device buffer {}",
                guard.handle().address,
                guard.handle().monotonic_id,
                dst.len
            )));
        }
        // SAFETY: the guard holds the slot (its hazard keeps the writer from
        // reusing it) until PendingGet has waited for the ticket.
        let t = unsafe { engine.h2d_async(guard.as_ptr().add(offset), len, dst)? };
        Ok(PendingGet {
            tickets: vec![t],
            guard: Some(guard),
            len,
        })
    }
}
