//! Page-locking (CUDA host registration) of a mapped segment, in
//! every process that maps it, so device copies into and out of slots run
//! as DMA with no staging buffer. Without a driver (or without the `cuda`
//! feature) `PinMode::Auto` carries on unpinned and says so in a tracing
//! event; `PinMode::Require` fails.

use serde::{Deserialize, Serialize};

#[cfg(not(feature = "cuda"))]
use crate::error::Error;
use crate::error::Result;

/// Whether to page-lock (CUDA host-register) the mapping.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PinMode {
    /// Never pin.
    Off,
    /// Pin where a CUDA driver is present; otherwise carry on unpinned.
    #[default]
    Auto,
    /// Pin or fail.
    Require,
}

/// A registered range; unregistered on drop (before the unmap).
#[derive(Debug)]
pub(crate) struct Pinned {
    #[cfg(feature = "cuda")]
    _inner: crate::cuda::register::Registration,
}

/// Registers `len` bytes at `ptr` according to `mode`.
pub(crate) fn pin(ptr: *mut u8, len: usize, mode: PinMode) -> Result<Option<Pinned>> {
    if mode == PinMode::Off {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        match crate::cuda::register::Registration::new(ptr, len) {
            Ok(inner) => Ok(Some(Pinned { _inner: inner })),
            Err(e) if mode == PinMode::Auto => {
                tracing::info!(%e, "shared memory not pinned; device copies will be staged by the driver");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (ptr, len);
        if mode == PinMode::Require {
            return Err(Error::pin_unavailable(
                "pinshm was built without the `cuda` feature",
                None,
            ));
        }
        tracing::debug!("built without the `cuda` feature: shared memory not pinned");
        Ok(None)
    }
}
