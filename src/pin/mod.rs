//! Page-locking (CUDA host registration) of a mapped segment, in
//! every process that maps it, so device copies into and out of slots run
//! as DMA with no staging buffer. Without a driver (or without the `cuda`
//! feature) `PinMode::Auto` carries on unpinned and says so in a tracing
//! event; `PinMode::Require` fails.
//!
//! What pinning costs: `cuMemHostRegister` faults in and page-locks every
//! page, about 0.1 to 0.3 s per GiB, in each process that maps the segment
//! (writer and every reader), and the memory can no longer be swapped.
//! So `PinMode::Auto` pins only segments whose pages are all reserved (the
//! default, `StoreConfig::reserve(true)`); a sparse segment (`reserve(false)`)
//! stays sparse and unpinned unless `PinMode::Require` asks for it. Readers
//! tell a sparse segment from the file's allocated blocks (`st_blocks`),
//! which the kernel keeps: nothing in the segment header is trusted for it.

use serde::{Deserialize, Serialize};

mod chunks;
#[cfg(feature = "cuda")]
mod register;

pub use chunks::Pinning;

#[cfg(not(feature = "cuda"))]
use crate::error::Error;
use crate::error::Result;

/// Whether to page-lock (CUDA host-register) the mapping.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum PinMode {
    /// Never pin.
    Off,
    /// Pin a reserved segment where a CUDA driver is present; otherwise
    /// (no driver, no GPU, a sparse segment) carry on unpinned.
    #[default]
    Auto,
    /// Pin or fail.
    Require,
}

/// How to pin: the mode and the CUDA device whose context registers
/// (default: `Auto`, device 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PinSpec {
    pub(crate) mode: PinMode,
    pub(crate) device: usize,
}

/// A registered range; unregistered on drop (before the unmap).
#[derive(Debug)]
pub(crate) struct Pinned {
    /// How the mapping was pinned (size, calls, time).
    pub(crate) report: Pinning,
    #[cfg(feature = "cuda")]
    _inner: register::Registration,
}

/// A registration at least this large is logged at info level with its
/// time (a reader attaching a large store waits for it).
#[cfg(feature = "cuda")]
const LARGE: usize = 1 << 30;

/// Whether `pin` might register a segment under `mode` in this process
/// (whatever the segment): then pre-faulting at map time would fault the
/// pages twice, since registration faults every page itself.
pub(crate) fn may_pin(mode: PinMode) -> bool {
    #[cfg(feature = "cuda")]
    {
        mode != PinMode::Off && crate::cuda::driver_present()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = mode;
        false
    }
}

/// Registers `len` bytes at `ptr` according to `spec`; `reserved` says
/// whether every page of the segment is allocated (`Auto` skips sparse
/// segments).
pub(crate) fn pin(
    ptr: *mut u8,
    len: usize,
    spec: PinSpec,
    reserved: bool,
) -> Result<Option<Pinned>> {
    if spec.mode == PinMode::Off {
        return Ok(None);
    }
    if spec.mode == PinMode::Auto && !reserved {
        tracing::debug!(
            len,
            "sparse segment (not reserved): not pinned under PinMode::Auto"
        );
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        match register::Registration::new(ptr, len, spec.device, chunks::chunk_size()) {
            Ok(inner) => {
                let r = inner.report;
                if r.bytes >= LARGE {
                    tracing::info!(
                        gib = r.bytes as f64 / (1u64 << 30) as f64,
                        chunks = r.chunks,
                        secs = r.elapsed.as_secs_f64(),
                        "pinned a large mapping (cuMemHostRegister faults in and locks every page)"
                    );
                }
                Ok(Some(Pinned {
                    report: r,
                    _inner: inner,
                }))
            }
            Err(e) if spec.mode == PinMode::Auto => {
                tracing::info!(%e, "shared memory not pinned; device copies will be staged by the driver");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (ptr, len);
        if spec.mode == PinMode::Require {
            return Err(Error::pin_unavailable(
                "pinshm was built without the `cuda` feature",
                None,
            ));
        }
        tracing::debug!("built without the `cuda` feature: shared memory not pinned");
        Ok(None)
    }
}
