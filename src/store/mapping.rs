//! The mapping of a store segment, shared by everything that may touch it:
//! the writer or reader that opened it, and every copy in flight into or out
//! of it. It is unmapped (and its liveness locks released) only when the
//! last of them lets go, so a copy engine keeps valid memory under a copy
//! even when the `PendingGet` or `PendingPut` that started it was leaked
//! with `mem::forget` and its reader or store dropped.

use std::sync::Arc;

use crate::error::Result;
use crate::pin::{self, PinSpec, Pinned};
use crate::sys::segment::{ReadOnlyMap, Segment};

/// A segment and its pin registration.
#[derive(Debug)]
pub(crate) struct Mapping {
    /// Unregistered before `seg` unmaps (fields drop in order).
    pinned: Option<Pinned>,
    /// A read-only mapping of the same segment, for payload views
    /// (`ReaderOptions::read_only_views`).
    views: Option<ReadOnlyMap>,
    seg: Segment,
}

/// Whether to pre-fault at map time, when pre-faulting is wanted: not when
/// the segment may be pinned, since registration faults every page itself
/// ([`Mapping::new`] pre-faults afterwards if it was not pinned).
pub(crate) fn prefault_at_map(prefault: bool, spec: PinSpec) -> bool {
    prefault && !pin::may_pin(spec.mode)
}

impl Mapping {
    /// Pins `seg` by `spec` (`reserved`: every page of it is allocated),
    /// then pre-faults it if `prefault_after` (pre-faulting was asked for
    /// and not done at map time) and it was not pinned.
    /// With `read_only_views`, also a second, read-only mapping of the
    /// segment that payload views point into ([`Mapping::view_of`]).
    pub(crate) fn new(
        seg: Segment,
        spec: PinSpec,
        reserved: bool,
        prefault_after: bool,
        read_only_views: bool,
    ) -> Result<Arc<Mapping>> {
        let views = read_only_views.then(|| seg.map_read_only()).transpose()?;
        let pinned = pin::pin(seg.as_ptr(), seg.len(), spec, reserved)?;
        if pinned.is_none() && prefault_after {
            seg.prefault();
        }
        Ok(Arc::new(Mapping { pinned, views, seg }))
    }

    /// Where the bytes at `p` (inside the read-write mapping, or one past
    /// its end: an empty payload that ends the ring) are seen in the
    /// read-only one, if there is one; `p` itself otherwise. The same
    /// pages either way: only the permission differs.
    ///
    /// `p` one past the end maps to one past the end of the read-only
    /// mapping: a pointer Rust allows (an allocation's end), from which
    /// only an empty slice is ever made (a payload of `len` bytes at
    /// offset `off` has `off + len <= seg.len()`), which reads nothing.
    pub(crate) fn view_of(&self, p: *const u8) -> *const u8 {
        match &self.views {
            Some(ro) => {
                let off = (p as usize).wrapping_sub(self.seg.as_ptr() as usize);
                debug_assert!(off <= self.seg.len(), "a payload outside the segment");
                // In bounds or one past the end: both mappings span the
                // whole segment. `wrapping_add` forms the pointer without
                // any in-bounds precondition; it keeps `ro`'s provenance,
                // so it reads the read-only mapping where it is in bounds.
                ro.as_ptr().wrapping_add(off)
            }
            None => p,
        }
    }

    /// The offset in the segment of `p`, a pointer [`Mapping::view_of`]
    /// gave (into the read-only mapping where there is one).
    pub(crate) fn offset_of(&self, p: *const u8) -> usize {
        let base = match &self.views {
            Some(ro) => ro.as_ptr(),
            None => self.seg.as_ptr(),
        };
        (p as usize).wrapping_sub(base as usize)
    }

    pub(crate) fn seg(&self) -> &Segment {
        &self.seg
    }

    pub(crate) fn is_pinned(&self) -> bool {
        self.pinned.is_some()
    }

    /// How this process's mapping was pinned, if it was.
    pub(crate) fn pinning(&self) -> Option<crate::pin::Pinning> {
        self.pinned.as_ref().map(|p| p.report)
    }
}
