//! The mapping of a store segment, shared by everything that may touch it:
//! the writer or reader that opened it, and every copy in flight into or out
//! of it. It is unmapped (and its liveness locks released) only when the
//! last of them lets go, so a copy engine keeps valid memory under a copy
//! even when the `PendingGet` or `PendingPut` that started it was leaked
//! with `mem::forget` and its reader or store dropped.

use std::sync::Arc;

use crate::error::Result;
use crate::pin::{self, PinMode, Pinned};
use crate::sys::segment::Segment;

/// A segment and its pin registration.
#[derive(Debug)]
pub(crate) struct Mapping {
    /// Unregistered before `seg` unmaps (fields drop in order).
    pinned: Option<Pinned>,
    seg: Segment,
}

impl Mapping {
    /// Pins `seg` by `mode` and shares it.
    pub(crate) fn new(seg: Segment, mode: PinMode) -> Result<Arc<Mapping>> {
        let pinned = pin::pin(seg.as_ptr(), seg.len(), mode)?;
        Ok(Arc::new(Mapping { pinned, seg }))
    }

    pub(crate) fn seg(&self) -> &Segment {
        &self.seg
    }

    pub(crate) fn is_pinned(&self) -> bool {
        self.pinned.is_some()
    }
}
