//! The CUDA backend (feature `cuda`): host registration for [`crate::pin`]
//! (`register`, below the store) and [`CudaEngine`] (`engine`, above the
//! copy layer: a stream, async copies, events, the pack/unpack kernels of
//! `kernels/pack.cu`). The driver is loaded at run
//! time: nothing here runs, or panics, where no driver is installed.

use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::error::{Error, Result};

pub(crate) mod engine;
pub(crate) mod register;

const KERNELS: &str = include_str!("../../kernels/pack.cu");

pub(crate) fn cuda_err(what: &str, e: cudarc::driver::DriverError) -> Error {
    tracing::debug!(what, %e, "CUDA call failed");
    Error::copy_from(what, e)
}

/// Whether a CUDA driver library can be loaded (no GPU needed to answer).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda; loads nothing else.
    unsafe { sys::is_culib_present() }
}

/// Whether NVRTC (libnvrtc.so) can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen libnvrtc.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

pub(crate) fn kernel_ptx() -> Result<cudarc::nvrtc::Ptx> {
    static PTX: OnceLock<Result<cudarc::nvrtc::Ptx, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        if !nvrtc_present() {
            return Err("NVRTC (libnvrtc.so) not found".into());
        }
        cudarc::nvrtc::compile_ptx(KERNELS)
            .map_err(|e| format!("NVRTC failed on kernels/pack.cu: {e}"))
    })
    .clone()
    .map_err(Error::copy)
}

/// Compiles `kernels/pack.cu` with NVRTC (no GPU needed) and returns the
/// PTX's size: a check that the kernels build where NVRTC is installed.
pub fn compile_kernels() -> Result<usize> {
    Ok(kernel_ptx()?.to_src().len())
}
