//! Host registration (`cuMemHostRegister`) of a mapped segment, used by
//! [`crate::pin`] below the store.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use super::driver_present;
use crate::error::{Error, Result};

/// The primary context of device `ordinal`, or why there is none.
pub(crate) fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    if !driver_present() {
        return Err(Error::pin_unavailable(
            "no CUDA driver (libcuda.so) found",
            None,
        ));
    }
    CudaContext::new(ordinal).map_err(|e| {
        Error::pin_unavailable(format!("no usable CUDA device {ordinal}"), Some(e.into()))
    })
}

/// A host range registered with `cuMemHostRegister` (portable, device-mapped).
#[derive(Debug)]
pub(crate) struct Registration {
    ptr: usize,
    ctx: Arc<CudaContext>,
}

impl Registration {
    pub(crate) fn new(ptr: *mut u8, len: usize) -> Result<Self> {
        let ctx = context(0)?;
        ctx.bind_to_thread()
            .map_err(|e| Error::pin_unavailable("cannot bind the CUDA context", Some(e.into())))?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: ptr..ptr+len is a live mapping of this process, which the
        // owner keeps mapped until this registration is dropped.
        unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, flags) }
            .result()
            .map_err(|e| {
                Error::pin_unavailable(
                    format!("cuMemHostRegister of {len} bytes failed"),
                    Some(e.into()),
                )
            })?;
        tracing::debug!(len, "shared memory pinned");
        Ok(Registration {
            ptr: ptr as usize,
            ctx,
        })
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the range was registered by `new` and is still mapped (the
        // owner drops the registration before unmapping).
        if let Err(e) = unsafe { sys::cuMemHostUnregister(self.ptr as *mut _) }.result() {
            tracing::warn!(%e, "cuMemHostUnregister failed");
        }
    }
}
