#![doc = include_str!("../docs/crate.md")]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(missing_docs)]
#![warn(unreachable_pub)]

#[cfg(not(target_os = "linux"))]
compile_error!(
    "pinshm needs Linux: POSIX shared memory under /dev/shm and open-file-description locks"
);

// Layers, lowest first (a module imports only modules before it here;
// tools/import_graph.py checks it): dtype, layout, error, sys, atomics, ring,
// geometry, codec, cuda (the driver wrapper), pin, copy, device, store,
// channel, inspect. The public modules are the API's rooms, named for what
// they hold; the rest are internals.
mod atomics;
pub mod channel;
pub mod codec;
mod copy;
#[cfg(feature = "cuda")]
mod cuda;
pub mod device;
mod dtype;
pub mod error;
mod geometry;
pub mod inspect;
mod layout;
mod pin;
mod ring;
pub mod store;
mod sys;

// The few types a user starts from; everything else is in its room.
pub use channel::{Broadcast, BroadcastReader};
pub use error::{Error, Result};
pub use store::{ObjectStore, PrivateView, ReadGuard, StoreConfig, StoreReader};

/// Internals that tests, benchmarks, tools and the Python bindings reach
/// for: the on-segment layout, the codec's header, the CPU references of
/// the kernels, kernel compilation, the fork generation. Not semver API:
/// the on-segment format may change with any release.
#[doc(hidden)]
pub mod testing {
    /// Bytes before a tensor's payload in its slot.
    pub const TENSOR_HEADER_LEN: usize = crate::codec::TENSOR_HEADER_LEN;
    #[cfg(feature = "cuda")]
    pub use crate::copy::kernels::{compile_kernels, kernel_binaries, KernelBuild};
    pub use crate::copy::Pause;
    pub use crate::copy::{check_pack, pack_cpu, unpack_cpu};
    #[cfg(feature = "cuda")]
    pub use crate::cuda::{
        current_context, driver_present, driver_version, nvrtc_present, ForeignContext,
    };
    pub use crate::layout::*;

    /// This process's fork generation (registering the `pthread_atfork`
    /// child handler on first use): it changes in every forked child. For
    /// bindings that must tell a forked child's inherited objects apart the
    /// way the crate does for its own handles.
    pub fn fork_generation() -> u64 {
        crate::sys::fork::register()
    }
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
