#![doc = include_str!("../README.md")]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

#[cfg(not(target_os = "linux"))]
compile_error!(
    "pinshm needs Linux: POSIX shared memory under /dev/shm and /proc for liveness checks"
);

mod channel;
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

/// The channel's protocol cores, for the loom models (`cfg(loom)` only).
#[cfg(loom)]
#[doc(hidden)]
pub use channel::loom_api as __loom_channel;
#[cfg(not(loom))]
pub use channel::{Broadcast, BroadcastReader, Message};
pub use channel::{BroadcastConfig, BroadcastHandle};
pub use codec::{DType, Element, Item, ItemLayout, ItemSlots, ItemView, TensorRef, TensorView};
pub use copy::{CopyEngine, CpuEngine, DeviceBuffer, PackDesc, PendingGet, PendingPut, Ticket};
#[cfg(feature = "cuda")]
pub use cuda::CudaEngine;
pub use error::{Blocker, Error, Result};
pub use store::{
    ObjectHandle, ObjectStore, PinMode, ReadGuard, ReaderOptions, StoreConfig, StoreHandle,
    StoreReader, StoreStats,
};
