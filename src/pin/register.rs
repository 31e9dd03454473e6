//! Host registration (`cuMemHostRegister`) of a mapped segment: what
//! [`crate::pin`] does with the `cuda` feature.
//!
//! The registration is made in the primary context of the configured
//! device (`StoreConfig::cuda_device`, `ReaderOptions::cuda_device`;
//! default 0) with `CU_MEMHOSTREGISTER_PORTABLE`, which makes the pinned
//! range usable from every CUDA context of the process, so engines of other
//! devices copy from it at DMA speed too. The calling thread's current
//! context is left as it was (see [`crate::cuda::ContextGuard`]).
//!
//! `cuMemHostRegister` page-locks the range: the driver faults in (and
//! allocates, on tmpfs) every page and pins it, which takes about 0.1 to
//! 0.3 s per GiB in each process that registers. A segment that is pinned
//! therefore needs no separate pre-faulting (`MAP_POPULATE`), and a sparse
//! one would lose its sparseness.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use crate::cuda::{context, driver_present, ContextGuard, Restoring};
use crate::error::{Error, Result};

/// A host range registered with `cuMemHostRegister` (portable, device-mapped).
#[derive(Debug)]
pub(crate) struct Registration {
    ptr: usize,
    ctx: Restoring<Arc<CudaContext>>,
}

impl Registration {
    /// Registers `len` bytes at `ptr` in device `ordinal`'s primary context.
    pub(crate) fn new(ptr: *mut u8, len: usize, ordinal: usize) -> Result<Self> {
        if !driver_present() {
            return Err(Error::pin_unavailable(
                "no CUDA driver (libcuda.so) found",
                None,
            ));
        }
        let _g = ContextGuard::save()
            .map_err(|e| Error::pin_unavailable("cannot initialise CUDA", Some(e.into())))?;
        let ctx = Restoring::new(context(ordinal)?);
        ctx.bind_to_thread()
            .map_err(|e| Error::pin_unavailable("cannot bind the CUDA context", Some(e.into())))?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        let t = std::time::Instant::now();
        // SAFETY: ptr..ptr+len is a live mapping of this process, which the
        // owner keeps mapped until this registration is dropped.
        unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, flags) }
            .result()
            .map_err(|e| {
                Error::pin_unavailable(
                    format!("cuMemHostRegister of {len} bytes on device {ordinal} failed"),
                    Some(e.into()),
                )
            })?;
        tracing::debug!(
            len,
            ordinal,
            secs = t.elapsed().as_secs_f64(),
            "shared memory pinned"
        );
        Ok(Registration {
            ptr: ptr as usize,
            ctx,
        })
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _g = ContextGuard::save().ok();
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the range was registered by `new` and is still mapped (the
        // owner drops the registration before unmapping).
        if let Err(e) = unsafe { sys::cuMemHostUnregister(self.ptr as *mut _) }.result() {
            tracing::warn!(%e, "cuMemHostUnregister failed");
        }
    }
}
