//! [`CudaEngine`]: copies on a CUDA stream, completions as events, and the
//! pack/unpack kernels.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{
    result as cu, sys, CudaContext, CudaEvent, CudaFunction, CudaStream, LaunchConfig,
    PushKernelArg,
};

use super::register::context;
use super::{cuda_err, driver_present, kernel_ptx};
use crate::copy::{
    check_pack, Completion, CopyEngine, DeviceBuffer, DeviceId, KeepAlive, PackDesc, Ticket,
};
use crate::error::{Error, Result};

/// Device memory from `cuMemAlloc`, freed when the last buffer using it goes.
#[derive(Debug)]
struct DeviceAlloc {
    ptr: sys::CUdeviceptr,
    ctx: Arc<CudaContext>,
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_sync in this context, freed once.
        if let Err(e) = unsafe { cu::free_sync(self.ptr) } {
            tracing::warn!(%e, "cuMemFree failed");
        }
    }
}

/// An event recorded after a copy, with everything the copy touches.
#[derive(Debug)]
struct EventCompletion {
    event: CudaEvent,
    /// Set once the event was seen complete.
    done: AtomicBool,
    keep: Vec<KeepAlive>,
}

// SAFETY: `poll` says done only when cuEventQuery reports the event (recorded
// after the copy on the same stream) complete, and `wait` returns only after
// cuEventSynchronize; a driver error is passed up as an error (never "done").
// Dropped before it was seen done, the completion synchronizes first, and
// leaks its keep-alives if even that fails.
unsafe impl Completion for EventCompletion {
    fn poll(&self) -> Result<bool> {
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
        self.event
            .synchronize()
            .map_err(|e| cuda_err("cuEventSynchronize", e))?;
        self.done.store(true, Ordering::Release);
        Ok(())
    }
}

impl Drop for EventCompletion {
    fn drop(&mut self) {
        if !self.done.load(Ordering::Acquire) && self.wait().is_err() {
            // Cannot tell whether the copy still runs: keep its memory.
            tracing::warn!("a CUDA copy could not be confirmed finished; leaking its buffers");
            std::mem::forget(std::mem::take(&mut self.keep));
        }
    }
}

/// Copies on one CUDA stream of one device; completions are events.
#[derive(Debug)]
pub struct CudaEngine {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    kernels: OnceLock<Result<(CudaFunction, CudaFunction), String>>,
}

impl CudaEngine {
    /// An engine on a new stream of device `ordinal`. Errors (never panics)
    /// where there is no driver or no such device.
    pub fn new(ordinal: usize) -> Result<Self> {
        let ctx = context(ordinal)?;
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_err("cuStreamCreate", e))?;
        Ok(CudaEngine {
            ctx,
            stream,
            ordinal,
            kernels: OnceLock::new(),
        })
    }

    /// Whether a CUDA device can be used here.
    pub fn available() -> bool {
        driver_present() && CudaContext::device_count().map(|n| n > 0).unwrap_or(false)
    }

    /// The device's name.
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "?".into())
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("bind context", e))
    }

    fn record(&self, keep: Vec<KeepAlive>) -> Result<Ticket> {
        // Blocking sync: a waiting thread sleeps instead of spinning a core.
        let event = self
            .stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(|e| cuda_err("cuEventRecord", e))?;
        Ok(Ticket::new(EventCompletion {
            event,
            done: AtomicBool::new(false),
            keep,
        }))
    }

    /// The pack and unpack kernels, compiled once per engine.
    fn kernels(&self) -> Result<&(CudaFunction, CudaFunction)> {
        self.kernels
            .get_or_init(|| {
                // One PTX cache (crate::cuda), which checks NVRTC is present
                // first: cudarc panics when it calls a missing libnvrtc.
                let ptx = kernel_ptx().map_err(|e| e.to_string())?;
                let m = self
                    .ctx
                    .load_module(ptx)
                    .map_err(|e| format!("cuModuleLoad: {e}"))?;
                let pack = m.load_function("pinshm_pack").map_err(|e| e.to_string())?;
                let unpack = m
                    .load_function("pinshm_unpack")
                    .map_err(|e| e.to_string())?;
                Ok((pack, unpack))
            })
            .as_ref()
            .map_err(|e| Error::copy(e.clone()))
    }

    /// Launches pack (`to_packed`) or unpack over `descs` and `packed`, a
    /// host pointer into pinned, device-mapped memory.
    unsafe fn launch(
        &self,
        descs: &[PackDesc],
        packed: *mut u8,
        len: usize,
        to_packed: bool,
        keep: Option<KeepAlive>,
    ) -> Result<Ticket> {
        check_pack(descs, len)?;
        let (pack, unpack) = self.kernels()?;
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
        let table = self.alloc(std::mem::size_of_val(descs).max(1))?;
        // SAFETY: `table` holds size_of_val(descs) bytes. The copy is on our
        // stream, so the kernel after it sees the table; from pageable
        // memory the driver has staged `descs` before the call returns.
        unsafe {
            cu::memcpy_htod_async(
                table.ptr(),
                bytemuck::cast_slice::<PackDesc, u8>(descs),
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| cuda_err("upload pack table", e))?;
        let n = descs.len() as u32;
        let cfg = LaunchConfig {
            grid_dim: (64, n.clamp(1, 65_535), 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = if to_packed { pack } else { unpack };
        let table_ptr = table.ptr();
        let mut b = self.stream.launch_builder(f);
        b.arg(&table_ptr).arg(&n).arg(&dptr);
        // SAFETY: the kernel reads `n` descriptors from `table` (kept alive
        // by the ticket) and moves bytes between the pieces (the caller's
        // contract) and `packed` (checked by check_pack, device-mapped).
        unsafe { b.launch(cfg) }.map_err(|e| cuda_err("kernel launch", e))?;
        // The table, the kernel's module and the host memory stay alive
        // until the kernel is done.
        let module: KeepAlive = Arc::new(f.clone());
        let keep = table
            .keep_alive()
            .into_iter()
            .chain([module])
            .chain(keep)
            .collect();
        self.record(keep)
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
        self.bind()?;
        // SAFETY: plain allocation in the bound context.
        let ptr = unsafe { cu::malloc_sync(len.max(1)) }.map_err(|e| cuda_err("cuMemAlloc", e))?;
        let keep = Arc::new(DeviceAlloc {
            ptr,
            ctx: self.ctx.clone(),
        });
        Ok(DeviceBuffer::owned(ptr, len, self.device(), keep))
    }

    fn upload(&self, src: &[u8], dst: &DeviceBuffer) -> Result<()> {
        self.check_fits(src.len(), dst)?;
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
