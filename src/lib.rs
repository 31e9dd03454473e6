#![doc = include_str!("../docs/crate.md")]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
#![warn(unreachable_pub)]

#[cfg(not(target_os = "linux"))]
compile_error!(
    "pinshm needs Linux: POSIX shared memory under /dev/shm and open-file-description locks"
);

// Layers, lowest first (a module imports only modules before it here;
// tools/import_graph.py checks it): dtype, layout, error, sys, atomics, ring,
// geometry, codec, cuda (the driver wrapper), pin, copy, store, channel,
// inspect, gc. The modules are private; the public API is the flat
// page below.
mod atomics;
mod channel;
mod codec;
mod copy;
#[cfg(feature = "cuda")]
mod cuda;
mod dtype;
mod error;
mod gc;
mod geometry;
mod inspect;
mod layout;
mod pin;
mod ring;
mod store;
mod sys;

pub use channel::{Broadcast, BroadcastReader, Canceller, Message};
pub use channel::{BroadcastConfig, BroadcastHandle, WaitStats};
pub use codec::{
    payload_len, FieldRef, FieldSpec, Item, ItemHeader, ItemLayout, ItemLayoutBuilder, ItemSlots,
    ItemView, TensorRef, TensorView, CODEC_VERSION, MAX_DIMS,
};
#[cfg(feature = "cuda")]
pub use copy::cuda::CudaEngine;
#[cfg(feature = "cuda")]
pub use copy::kernels::KernelSource;
pub use copy::{
    Completion, CopyEngine, CpuEngine, DeviceBuffer, DeviceId, KeepAlive, PackDesc, Pause, Ticket,
};
pub use dtype::{DType, Element};
pub use error::{Blocker, BoxError, Error, Result};
pub use gc::{gc, remove_if_abandoned_file, Abandoned};
pub use inspect::{inspect, ReaderInfo, SlotInfo, Snapshot};
pub use layout::ObjectKind;
pub use pin::{PinMode, Pinning};
pub use store::{
    Eviction, ItemGuard, Lease, ObjectHandle, ObjectStore, PendingGet, PendingPut, ReadGuard,
    ReaderOptions, Reservation, Signature, StoreConfig, StoreHandle, StoreReader, StoreStats,
    TensorGuard, SIGNATURE_LEN,
};

/// This process's fork generation (registering the `pthread_atfork` child
/// handler on first use): it changes in every forked child. For bindings
/// that must tell a forked child's inherited objects apart the way the
/// crate does for its own handles. Not semver API.
#[doc(hidden)]
pub fn fork_generation() -> u64 {
    sys::fork::register()
}

/// Internals that tests, benchmarks and tools reach for: the on-segment
/// layout, the CPU references of the kernels, kernel compilation. Not
/// semver API: the on-segment format may change with any release.
#[doc(hidden)]
pub mod testing {
    pub use crate::codec::TENSOR_HEADER_LEN;
    #[cfg(feature = "cuda")]
    pub use crate::copy::kernels::{compile_kernels, kernel_binaries, KernelBuild};
    pub use crate::copy::{check_pack, pack_cpu, unpack_cpu};
    #[cfg(feature = "cuda")]
    pub use crate::cuda::{
        current_context, driver_present, driver_version, nvrtc_present, ForeignContext,
    };
    pub use crate::layout::*;
}

/// The Rust examples of the README and of `docs/`, run as doctests (they
/// are the crate's documentation too, so they must compile and pass).
#[cfg(doctest)]
mod doc_examples {
    #[doc = include_str!("../README.md")]
    struct Readme;
    #[doc = include_str!("../docs/guide.md")]
    struct Guide;
    #[doc = include_str!("../docs/channel.md")]
    struct Channel;
    #[doc = include_str!("../docs/gpu.md")]
    struct Gpu;
    #[doc = include_str!("../docs/design.md")]
    struct Design;
    #[doc = include_str!("../docs/reliability.md")]
    struct Reliability;
}
