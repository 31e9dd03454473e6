//! Devices: the copy engines that move bytes between a device and the
//! store's slots, the device buffers they copy, and how the store's memory
//! is pinned for them.
//!
//! A user picks an engine ([`CpuEngine`] anywhere; `CudaEngine` with the
//! `cuda` feature) and hands it to the store's device methods. The rest of
//! this module ([`Ticket`], [`Completion`], [`KeepAlive`], [`PackDesc`]) is
//! the contract for writing an engine of one's own: [`CopyEngine`] is an
//! `unsafe` trait, and these are the types its methods speak.

#[cfg(feature = "cuda")]
pub use crate::copy::cuda::CudaEngine;
#[cfg(feature = "cuda")]
pub use crate::copy::kernels::KernelSource;
pub use crate::copy::{
    Completion, CopyEngine, CpuEngine, DeviceBuffer, DeviceId, KeepAlive, PackDesc, Ticket,
};
pub use crate::pin::{PinMode, Pinning};
