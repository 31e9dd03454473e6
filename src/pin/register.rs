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
//! One call covers at most 64 GiB (a single registration of 512 GiB or
//! more fails): larger mappings are registered in chunks, and a failure
//! part way unregisters what was registered.
//!
//! `cuMemHostRegister` page-locks the range: the driver faults in (and
//! allocates, on tmpfs) every page and pins it, which takes about 0.1 to
//! 0.3 s per GiB in each process that registers. A segment that is pinned
//! therefore needs no separate pre-faulting (`MAP_POPULATE`), and a sparse
//! one would lose its sparseness.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use super::chunks::{register_in_chunks, Pinning};
use crate::cuda::{context, driver_present, ContextGuard, Restoring};
use crate::error::{Error, Result};

/// A host range registered with `cuMemHostRegister` (portable,
/// device-mapped), in chunks of at most 64 GiB ([`super::chunks`]).
#[derive(Debug)]
pub(crate) struct Registration {
    /// Where each chunk starts (what `cuMemHostUnregister` takes).
    chunks: Vec<usize>,
    ctx: Restoring<Arc<CudaContext>>,
    pub(crate) report: Pinning,
}

impl Registration {
    /// Registers `len` bytes at `ptr` in device `ordinal`'s primary context,
    /// in chunks of `chunk` bytes at most.
    pub(crate) fn new(ptr: *mut u8, len: usize, ordinal: usize, chunk: usize) -> Result<Self> {
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
        let chunks = register_in_chunks(
            ptr as usize,
            len,
            chunk,
            |start, n| {
                // SAFETY: start..start+n lies inside ptr..ptr+len, a live
                // mapping of this process, which the owner keeps mapped
                // until this registration is dropped.
                unsafe { sys::cuMemHostRegister_v2(start as *mut _, n, flags) }.result()
            },
            unregister,
        )
        .map_err(|(e, at)| {
            Error::pin_unavailable(
                format!(
                    "cuMemHostRegister of {len} bytes on device {ordinal} failed \
                     (the chunk at offset {} of at most {chunk} bytes)",
                    at - ptr as usize
                ),
                Some(e.into()),
            )
        })?;
        let report = Pinning {
            bytes: len,
            chunks: chunks.len(),
            elapsed: t.elapsed(),
        };
        tracing::debug!(
            len,
            ordinal,
            chunks = report.chunks,
            secs = report.elapsed.as_secs_f64(),
            "shared memory pinned"
        );
        Ok(Registration {
            chunks,
            ctx,
            report,
        })
    }
}

/// Unregisters the chunk registered at `start`; a failure is logged (the
/// mapping goes anyway).
fn unregister(start: usize) {
    // SAFETY: `start` is the start of a chunk registered by
    // `Registration::new`, and the range is still mapped (the owner drops
    // the registration before unmapping).
    if let Err(e) = unsafe { sys::cuMemHostUnregister(start as *mut _) }.result() {
        tracing::warn!(%e, "cuMemHostUnregister failed");
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _g = ContextGuard::save().ok();
        let _ = self.ctx.bind_to_thread();
        for &start in self.chunks.iter().rev() {
            unregister(start);
        }
    }
}
