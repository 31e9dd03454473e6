//! [`CudaEngine`]: copies on a CUDA stream, completions as events, and the
//! pack/unpack kernels.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{
    result as cu, sys, CudaContext, CudaEvent, CudaFunction, CudaStream, DeviceRepr, LaunchConfig,
    PushKernelArg,
};

use super::kernels::{self, KernelSource, INLINE_DESCS};
use crate::copy::{
    check_pack, Completion, CopyEngine, DeviceBuffer, DeviceId, KeepAlive, PackDesc, Ticket,
};
use crate::cuda::{context, cuda_err, driver_present, ContextGuard, Restoring};
use crate::error::{Error, Result};

/// Device memory from `cuMemAlloc`, freed when the last buffer using it goes.
#[derive(Debug)]
struct DeviceAlloc {
    ptr: sys::CUdeviceptr,
    ctx: Restoring<Arc<CudaContext>>,
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        let _g = ContextGuard::save().ok();
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_sync in this context, freed once; no
        // copy uses it any more (copies hold the buffer's keep-alive).
        if let Err(e) = unsafe { cu::free_sync(self.ptr) } {
            tracing::warn!(%e, "cuMemFree failed");
        }
    }
}

/// An event recorded after a copy, with everything the copy touches.
#[derive(Debug)]
struct EventCompletion {
    event: Restoring<CudaEvent>,
    /// Set once the event was seen complete.
    done: AtomicBool,
    /// Set once its end could not be confirmed: the keep-alives are leaked.
    lost: AtomicBool,
    keep: std::sync::Mutex<Vec<KeepAlive>>,
}

impl EventCompletion {
    /// The copy's end cannot be confirmed: keep its memory for good.
    fn lose(&self, e: cudarc::driver::DriverError) -> Error {
        if !self.lost.swap(true, Ordering::AcqRel) {
            let keep = std::mem::take(&mut *self.keep.lock().unwrap_or_else(|p| p.into_inner()));
            std::mem::forget(keep);
            tracing::error!(%e, "a CUDA copy could not be confirmed finished; its memory is kept for good");
        }
        Error::DeviceLost {
            what: "cuEventSynchronize failed".into(),
            source: Some(e.into()),
        }
    }
}

// SAFETY: `poll` says done only when cuEventQuery reports the event (recorded
// after the copy on the same stream) complete (a driver error is an error,
// never "done"); `wait` returns Ok only after cuEventSynchronize, and when
// that fails it leaks the keep-alives and answers DeviceLost. Dropped before
// it was seen done, the completion waits first (and so leaks if it must).
unsafe impl Completion for EventCompletion {
    fn poll(&self) -> Result<bool> {
        // cuEventQuery needs no current context: nothing to restore.
        let done = self
            .event
            .try_is_complete()
            .map_err(|e| cuda_err("cuEventQuery", e))?;
        if done {
            self.done.store(true, Ordering::Release);
        }
        Ok(done)
    }
    fn wait(&self) -> Result<()> {
        if self.lost.load(Ordering::Acquire) {
            return Err(Error::DeviceLost {
                what: "an earlier wait could not confirm the copy's end".into(),
                source: None,
            });
        }
        let _g = match ContextGuard::save() {
            Ok(g) => g,
            Err(e) => {
                // Not even the context can be asked: the end is unknown.
                return Err(Error::DeviceLost {
                    what: format!("cannot wait for the copy: {e}"),
                    source: None,
                })
                .inspect_err(|_| {
                    if !self.lost.swap(true, Ordering::AcqRel) {
                        let mut k = self.keep.lock().unwrap_or_else(|p| p.into_inner());
                        std::mem::forget(std::mem::take(&mut *k));
                    }
                });
            }
        };
        self.event.synchronize().map_err(|e| self.lose(e))?;
        self.done.store(true, Ordering::Release);
        Ok(())
    }
}

impl Drop for EventCompletion {
    fn drop(&mut self) {
        if !self.done.load(Ordering::Acquire) {
            // Waits; if the end cannot be confirmed, `wait` has leaked the
            // keep-alives, so the memory stays.
            let _ = self.wait();
        }
    }
}

/// Up to [`INLINE_DESCS`] descriptors, passed by value as the kernels'
/// last parameter (`InlineDescs` in kernels/pack.cu: 3,840 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
struct InlineDescs {
    d: [PackDesc; INLINE_DESCS],
}

// SAFETY: #[repr(C)], plain u64 fields, the same layout as the kernels'
// `struct InlineDescs` (96 × 5 unsigned long long).
unsafe impl DeviceRepr for InlineDescs {}

/// The loaded kernels; the functions hold their module.
#[derive(Debug)]
struct Kernels {
    pack: CudaFunction,
    unpack: CudaFunction,
    source: KernelSource,
}

/// Copies on one CUDA stream of one device; completions are events.
///
/// Every method (and dropping the engine, its tickets and buffers) leaves
/// the calling thread's current CUDA context as it found it. An engine may
/// be used from any thread.
///
/// Both directions share the engine's one stream, on purpose: copies run
/// in the order they were started, as on [`crate::device::CpuEngine`], and callers
/// may rely on it (a get into a buffer, then a put out of it). The writer
/// (device to slot) and the workers (slot to device) are separate processes
/// with engines of their own, so their directions overlap anyway; a process
/// that wants both directions at once makes two engines.
#[derive(Debug)]
pub struct CudaEngine {
    // Dropped in this order, each under a ContextGuard: the kernels'
    // module, the stream, then the context.
    kernels: Restoring<OnceLock<Result<Kernels, String>>>,
    stream: Restoring<Arc<CudaStream>>,
    ctx: Restoring<Arc<CudaContext>>,
    ordinal: usize,
    sm_count: u32,
}

impl CudaEngine {
    /// An engine on a new stream of device `ordinal`. Errors (never panics)
    /// where there is no driver or no such device.
    pub fn new(ordinal: usize) -> Result<Self> {
        let _g = ContextGuard::save()?;
        let ctx = context(ordinal)?;
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_err("cuStreamCreate", e))?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| cuda_err("cuDeviceGetAttribute", e))?
            .max(1) as u32;
        Ok(CudaEngine {
            kernels: Restoring::new(OnceLock::new()),
            stream: Restoring::new(stream),
            ctx: Restoring::new(ctx),
            ordinal,
            sm_count,
        })
    }

    /// Whether a CUDA device can be used here.
    pub fn available() -> bool {
        if !driver_present() {
            return false;
        }
        let Ok(_g) = ContextGuard::save() else {
            return false;
        };
        CudaContext::device_count().map(|n| n > 0).unwrap_or(false)
    }

    /// The device's name.
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "?".into())
    }

    /// The device's compute capability (major, minor).
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        self.ctx
            .compute_capability()
            .map_err(|e| cuda_err("cuDeviceGetAttribute", e))
    }

    /// The device's number of streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// Which kernel binary this engine runs (loading the kernels if they
    /// are not loaded yet): an embedded cubin or the embedded PTX.
    pub fn kernel_source(&self) -> Result<KernelSource> {
        let _g = ContextGuard::save()?;
        Ok(self.kernels()?.source)
    }

    /// Runs `f`, which starts work on this engine's stream (and may wait
    /// for it), between two timing events recorded on the stream, and
    /// waits for the second. Returns what `f` returned and the device time
    /// between the events, in seconds: the copies' own time, without the
    /// host's bookkeeping before or after them.
    pub fn time_on_stream<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<(T, f64)> {
        let _g = ContextGuard::save()?;
        // Timing events (no CU_EVENT_DISABLE_TIMING) that sleep on wait.
        let flags = Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC);
        let event = || {
            self.ctx
                .new_event(flags)
                .map(Restoring::new)
                .map_err(|e| cuda_err("cuEventCreate", e))
        };
        let (start, end) = (event()?, event()?);
        start
            .record(&self.stream)
            .map_err(|e| cuda_err("cuEventRecord", e))?;
        let v = f()?;
        end.record(&self.stream)
            .map_err(|e| cuda_err("cuEventRecord", e))?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(|e| cuda_err("cuEventElapsedTime", e))?;
        Ok((v, f64::from(ms) / 1e3))
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("bind context", e))
    }

    /// A ticket for the work just enqueued on the stream, holding `keep`.
    fn record(&self, keep: Vec<KeepAlive>) -> Result<Ticket> {
        // Blocking sync: a waiting thread sleeps instead of spinning a core.
        match self
            .stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
        {
            Ok(event) => Ok(Ticket::new(EventCompletion {
                event: Restoring::new(event),
                done: AtomicBool::new(false),
                lost: AtomicBool::new(false),
                keep: std::sync::Mutex::new(keep),
            })),
            Err(e) => Err(self.after_enqueue_failure(cuda_err("cuEventRecord", e), keep)),
        }
    }

    /// Work is on the stream and something after it failed: its memory
    /// must not go while it may still run. Drains the stream (then `keep`
    /// may go, and `err` is the answer) or, if even that fails, leaks
    /// `keep` and answers DeviceLost.
    fn after_enqueue_failure(&self, err: Error, keep: Vec<KeepAlive>) -> Error {
        match self.stream.synchronize() {
            Ok(()) => err,
            Err(e) => {
                std::mem::forget(keep);
                tracing::error!(%err, %e, "a CUDA copy's end cannot be confirmed; its memory is kept for good");
                Error::DeviceLost {
                    what: format!("{err}, then cuStreamSynchronize failed"),
                    source: Some(e.into()),
                }
            }
        }
    }

    /// The pack and unpack kernels, loaded once per engine from the best
    /// binary the driver accepts: the one load path (see `copy::kernels`
    /// for the two binaries and why each is there). Call under a guard.
    fn kernels(&self) -> Result<&Kernels> {
        self.kernels
            .get_or_init(|| {
                let cc = self
                    .ctx
                    .compute_capability()
                    .map_err(|e| format!("compute capability: {e}"))?;
                let mut why = Vec::new();
                for src in kernels::candidates(cc) {
                    let loaded = kernels::image(src)
                        .map_err(|e| e.to_string())
                        .and_then(|img| {
                            self.ctx
                                .load_module(img)
                                .map_err(|e| format!("cuModuleLoadData: {e}"))
                        })
                        .and_then(|m| {
                            let f = |n: &str| m.load_function(n).map_err(|e| format!("{n}: {e}"));
                            Ok(Kernels {
                                pack: f("pinshm_pack")?,
                                unpack: f("pinshm_unpack")?,
                                source: src,
                            })
                        });
                    match loaded {
                        Ok(k) => {
                            tracing::debug!(source = %src, "pack kernels loaded");
                            return Ok(k);
                        }
                        Err(e) => why.push(format!("{src}: {e}")),
                    }
                }
                if why.is_empty() {
                    why.push("older than compute 7.0, the oldest the kernels run on".into());
                }
                Err(format!(
                    "no kernel binary loads on sm_{}{}: {}",
                    cc.0,
                    cc.1,
                    why.join("; ")
                ))
            })
            .as_ref()
            .map_err(|e| Error::copy(e.clone()))
    }

    /// Launches pack (`to_packed`) or unpack over `descs` and `packed`, a
    /// host pointer into pinned, device-mapped memory: one launch per
    /// [`INLINE_DESCS`] pieces, all on the stream, one event after them.
    ///
    /// # Safety
    /// As [`CopyEngine::pack_async`] (or `unpack_async`).
    unsafe fn launch(
        &self,
        descs: &[PackDesc],
        packed: *mut u8,
        len: usize,
        to_packed: bool,
        keep: Option<KeepAlive>,
    ) -> Result<Ticket> {
        check_pack(descs, len)?;
        let _g = ContextGuard::save()?;
        let k = self.kernels()?;
        self.bind()?;
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: asks the driver for the device view of a host pointer; it
        // fails (and we report it) unless the memory is registered.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, packed.cast(), 0) }
            .result()
            .map_err(|e| {
                Error::copy_from(
                    "pack needs a pinned, device-mapped destination (is the store pinned?)",
                    e,
                )
            })?;
        let f = if to_packed { &k.pack } else { &k.unpack };
        for chunk in descs.chunks(INLINE_DESCS) {
            let mut inl = InlineDescs {
                d: [PackDesc::default(); INLINE_DESCS],
            };
            inl.d[..chunk.len()].copy_from_slice(chunk);
            let n = chunk.len() as u32;
            let cfg = grid(chunk, self.sm_count);
            let mut b = self.stream.launch_builder(f);
            b.arg(&n).arg(&dptr).arg(&inl);
            // SAFETY: the kernel reads `n` descriptors from its parameter
            // and moves bytes between the pieces (the caller's contract) and
            // `packed` (checked by check_pack, device-mapped). The driver
            // copies the parameters at launch.
            if let Err(e) = unsafe { b.launch(cfg) } {
                // Earlier chunks may be running: they keep their memory.
                let module: KeepAlive = Arc::new(f.clone());
                let keep = [module].into_iter().chain(keep).collect();
                return Err(self.after_enqueue_failure(cuda_err("kernel launch", e), keep));
            }
        }
        // The kernels' module and the host memory stay alive until the last
        // launch is done.
        let module: KeepAlive = Arc::new(f.clone());
        self.record([module].into_iter().chain(keep).collect())
    }
}

/// The launch shape for `pieces`: y walks the pieces (at most
/// [`INLINE_DESCS`] < 65,535); x gives each piece blocks enough for its
/// bytes (16 per thread), so that the whole grid is about 4 blocks per SM.
fn grid(pieces: &[PackDesc], sm_count: u32) -> LaunchConfig {
    const THREADS: u32 = 256;
    let max_bytes = pieces
        .iter()
        .map(|d| d.rows.saturating_mul(d.row_bytes))
        .max()
        .unwrap_or(0);
    let want = max_bytes.div_ceil(u64::from(THREADS) * 16).max(1);
    let budget = u64::from((4 * sm_count) / (pieces.len().max(1) as u32)).max(1);
    LaunchConfig {
        grid_dim: (want.min(budget) as u32, pieces.len().max(1) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

// SAFETY: tickets carry EventCompletions (see there) holding every
// keep-alive; upload and download run on the engine's stream and wait for it,
// so they are ordered after the copies started before them.
unsafe impl CopyEngine for CudaEngine {
    fn device(&self) -> DeviceId {
        self.ordinal as u64
    }

    fn alloc(&self, len: usize) -> Result<DeviceBuffer> {
        let _g = ContextGuard::save()?;
        self.bind()?;
        // SAFETY: plain allocation in the bound context.
        let ptr = unsafe { cu::malloc_sync(len.max(1)) }.map_err(|e| cuda_err("cuMemAlloc", e))?;
        let keep = Arc::new(DeviceAlloc {
            ptr,
            ctx: Restoring::new(Arc::clone(&self.ctx)),
        });
        Ok(DeviceBuffer::owned(ptr, len, self.device(), keep))
    }

    fn upload(&self, src: &[u8], dst: &DeviceBuffer) -> Result<()> {
        self.check_fits(src.len(), dst)?;
        let _g = ContextGuard::save()?;
        self.bind()?;
        // SAFETY: dst is device memory of this context with room for src,
        // which stays borrowed until the stream has drained below.
        unsafe { cu::memcpy_htod_async(dst.ptr(), src, self.stream.cu_stream()) }
            .map_err(|e| cuda_err("cuMemcpyHtoDAsync", e))?;
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("cuStreamSynchronize", e))
    }

    fn download(&self, src: &DeviceBuffer, dst: &mut [u8]) -> Result<()> {
        self.check_device(src)?;
        if dst.len() < src.len() {
            return Err(Error::DeviceRange(format!(
                "{} bytes into {}",
                src.len(),
                dst.len()
            )));
        }
        let _g = ContextGuard::save()?;
        self.bind()?;
        // SAFETY: src is device memory of this context of src.len() bytes;
        // dst stays mutably borrowed until the stream has drained below.
        unsafe { cu::memcpy_dtoh_async(&mut dst[..src.len()], src.ptr(), self.stream.cu_stream()) }
            .map_err(|e| cuda_err("cuMemcpyDtoHAsync", e))?;
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("cuStreamSynchronize", e))
    }

    unsafe fn d2h_async(
        &self,
        src: &DeviceBuffer,
        dst: *mut u8,
        keep: Option<KeepAlive>,
    ) -> Result<Ticket> {
        self.check_device(src)?;
        let _g = ContextGuard::save()?;
        self.bind()?;
        // SAFETY: the caller's contract for dst; src is this device's memory.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.cast(), src.ptr(), src.len(), self.stream.cu_stream())
        }
        .result()
        .map_err(|e| cuda_err("cuMemcpyDtoHAsync", e))?;
        self.record(src.keep_alive().into_iter().chain(keep).collect())
    }

    unsafe fn h2d_async(
        &self,
        src: *const u8,
        len: usize,
        dst: &DeviceBuffer,
        keep: Option<KeepAlive>,
    ) -> Result<Ticket> {
        self.check_fits(len, dst)?;
        let _g = ContextGuard::save()?;
        self.bind()?;
        // SAFETY: the caller's contract for src; dst has room for len bytes.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst.ptr(), src.cast(), len, self.stream.cu_stream()) }
            .result()
            .map_err(|e| cuda_err("cuMemcpyHtoDAsync", e))?;
        self.record(dst.keep_alive().into_iter().chain(keep).collect())
    }

    unsafe fn pack_async(
        &self,
        descs: &[PackDesc],
        dst: *mut u8,
        len: usize,
        keep: Option<KeepAlive>,
    ) -> Result<Ticket> {
        // SAFETY: forwarded contract.
        unsafe { self.launch(descs, dst, len, true, keep) }
    }

    unsafe fn unpack_async(
        &self,
        src: *const u8,
        len: usize,
        descs: &[PackDesc],
        keep: Option<KeepAlive>,
    ) -> Result<Ticket> {
        // SAFETY: forwarded contract; unpack only reads `src`.
        unsafe { self.launch(descs, src as *mut u8, len, false, keep) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_inline_descriptors_fit_the_4_kib_parameter_limit() {
        // n (4, padded to 8) + packed (8) + the descriptors.
        let params = 8 + 8 + std::mem::size_of::<InlineDescs>();
        assert_eq!(std::mem::size_of::<InlineDescs>(), 3840);
        assert!(params <= 4096, "{params} bytes of kernel parameters");
    }

    #[test]
    fn the_grid_is_sized_from_the_sm_count() {
        let big = [PackDesc::contiguous(0, 256 << 20, 0)];
        let g = grid(&big, 132);
        assert_eq!(g.grid_dim, (528, 1, 1), "one big piece: 4 blocks per SM");
        let small: Vec<_> = (0..96)
            .map(|i| PackDesc::contiguous(0, 100, i * 128))
            .collect();
        let g = grid(&small, 132);
        assert_eq!(g.grid_dim, (1, 96, 1), "small pieces: one block each");
        let g = grid(&[PackDesc::contiguous(0, 1, 0)], 132);
        assert_eq!(g.grid_dim, (1, 1, 1));
    }
}
