//! The CUDA driver, wrapped once (feature `cuda`): loading it, errors,
//! devices' primary contexts, and the guard that leaves the caller's
//! current context as it was. Its users sit above it: host registration in
//! [`crate::pin`] (`pin/register.rs`) and the `CudaEngine` copy engine in
//! [`crate::copy`] (`copy/cuda.rs`, with the pack/unpack kernels of
//! `kernels/pack.cu` in `copy/kernels.rs`). The driver is loaded at run
//! time: nothing here runs, or panics, where no driver is installed.
//!
//! **The caller's context is left as it was.** cudarc binds a context to
//! the calling thread (`cuCtxSetCurrent`) on nearly every call, and never
//! puts the previous one back. A worker that runs PyTorch on GPU k would
//! then find GPU 0's context current after a registration. Every public
//! entry point here (registration, unregistration, each `CudaEngine`
//! method, the drops of tickets, buffers and engines) holds a
//! [`ContextGuard`], which saves the thread's current context first and
//! restores it when the call returns.

use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::sync::OnceLock;

use std::sync::Arc;

use cudarc::driver::{result as cu, sys, CudaContext};

use crate::error::{Error, Result};

pub(crate) fn cuda_err(what: &str, e: cudarc::driver::DriverError) -> Error {
    tracing::debug!(what, %e, "CUDA call failed");
    Error::copy_from(what, e)
}

/// Whether a CUDA driver library can be loaded (no GPU needed to answer).
/// Asked once per process: the answer cannot change, and a failed dlopen
/// searches the library path every time.
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen libcuda; loads nothing else.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// Whether NVRTC (libnvrtc.so) can be loaded.
pub fn nvrtc_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen libnvrtc.
    *PRESENT.get_or_init(|| unsafe { cudarc::nvrtc::sys::is_culib_present() })
}

/// The CUDA driver's version as `major * 1000 + minor * 10` (12040 for
/// 12.4), or `None` without a driver.
pub fn driver_version() -> Option<i32> {
    if !driver_present() {
        return None;
    }
    let mut v = 0i32;
    // SAFETY: the driver library is present (checked above); the call only
    // writes the int it is given, and needs no cuInit.
    unsafe { sys::cuDriverGetVersion(&mut v) }.result().ok()?;
    Some(v)
}

/// Saves the calling thread's current CUDA context; puts it back on drop.
///
/// Made before anything binds a context, dropped after the last CUDA call
/// of a public entry point. `!Send`: it restores the thread it was made on.
/// Drop never panics; a failed restore is logged.
pub(crate) struct ContextGuard {
    prev: sys::CUcontext,
    _this_thread: PhantomData<*const ()>,
}

impl ContextGuard {
    /// The thread's current context (maybe none). Errs without a driver,
    /// or where the driver cannot be initialised.
    pub(crate) fn save() -> Result<ContextGuard> {
        if !driver_present() {
            return Err(Error::copy("no CUDA driver (libcuda.so) found"));
        }
        // cuCtxGetCurrent needs cuInit; cuInit is idempotent and cheap
        // once done.
        cu::init().map_err(|e| cuda_err("cuInit", e))?;
        let prev = cu::ctx::get_current()
            .map_err(|e| cuda_err("cuCtxGetCurrent", e))?
            .unwrap_or(std::ptr::null_mut());
        Ok(ContextGuard {
            prev,
            _this_thread: PhantomData,
        })
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        let now = cu::ctx::get_current().map(|c| c.unwrap_or(std::ptr::null_mut()));
        if now.is_ok_and(|c| c == self.prev) {
            return;
        }
        // SAFETY: `prev` was the thread's current context (or null: none)
        // when the guard was made, so it was valid then; a context this
        // crate releases meanwhile is a primary context, whose handle stays
        // valid for cuCtxSetCurrent (a released one fails with an error,
        // which is logged, not undefined behaviour).
        if let Err(e) = unsafe { cu::ctx::set_current(self.prev) } {
            tracing::warn!(%e, "could not restore the caller's CUDA context");
        }
    }
}

/// A cudarc value whose drop (which binds its context to the thread) runs
/// under a [`ContextGuard`], so dropping it leaves the caller's context.
#[derive(Debug)]
pub(crate) struct Restoring<T>(ManuallyDrop<T>);

impl<T> Restoring<T> {
    pub(crate) fn new(v: T) -> Self {
        Restoring(ManuallyDrop::new(v))
    }
}

impl<T> std::ops::Deref for Restoring<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> Drop for Restoring<T> {
    fn drop(&mut self) {
        let _g = ContextGuard::save().ok();
        // SAFETY: dropped once, here; the field is never used again.
        unsafe { ManuallyDrop::drop(&mut self.0) };
    }
}

/// For tests: the calling thread's current CUDA context, as an address
/// (0: none, or no driver).
pub fn current_context() -> usize {
    if !driver_present() || cu::init().is_err() {
        return 0;
    }
    cu::ctx::get_current()
        .ok()
        .flatten()
        .map_or(0, |c| c as usize)
}

/// For tests: a non-primary CUDA context of device `ordinal` (one that
/// pinshm never uses itself), current on the calling thread while it lives,
/// as a framework's context would be. Destroyed on drop.
#[derive(Debug)]
pub struct ForeignContext(std::sync::Arc<cudarc::driver::CudaContext>);

impl ForeignContext {
    /// Creates it and makes it current on this thread.
    pub fn new(ordinal: usize) -> Result<ForeignContext> {
        if !driver_present() {
            return Err(Error::copy("no CUDA driver (libcuda.so) found"));
        }
        let c = cudarc::driver::CudaContext::new_non_primary(ordinal, 0)
            .map_err(|e| cuda_err("cuCtxCreate", e))?;
        c.bind_to_thread()
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
        Ok(ForeignContext(c))
    }

    /// Its address, as [`current_context`] reports it.
    pub fn id(&self) -> usize {
        self.0.cu_ctx() as usize
    }
}

/// The primary context of device `ordinal`, or why there is none. Binds it
/// to the calling thread: call under a [`ContextGuard`].
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
