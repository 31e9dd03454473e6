#![doc = include_str!("../README.md")]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

#[cfg(not(target_os = "linux"))]
compile_error!(
    "pinshm needs Linux: POSIX shared memory under /dev/shm and /proc for liveness checks"
);

pub mod codec;
pub mod copy;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
pub mod inspect;
pub mod layout;
mod pin;
mod ring;
mod store;
mod sys;

pub use codec::{DType, Element, Item, ItemLayout, ItemSlots, ItemView, TensorRef, TensorView};
pub use copy::{CopyEngine, CpuEngine, DeviceBuffer, PackDesc, PendingGet, PendingPut, Ticket};
#[cfg(feature = "cuda")]
pub use cuda::CudaEngine;
pub use error::{Blocker, Error, Result};
pub use store::{
    ObjectHandle, ObjectStore, PinMode, ReadGuard, ReaderOptions, StoreConfig, StoreHandle,
    StoreReader, StoreStats,
};
