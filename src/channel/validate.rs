//! The checks a reader makes of a channel before it trusts it: the header
//! (the checks every segment gets, [`crate::geometry::validate_channel`]),
//! then the handle it attaches with against that header.

use std::time::Duration;

use super::{layout, BroadcastHandle};
use crate::error::{Error, Result};
use crate::geometry::{validate_channel, ChannelGeometry};
use crate::sys::segment::Segment;

/// Validates the header against the mapping, then the handle against the
/// header; returns the geometry and the readers' default spin.
pub(super) fn validate(seg: &Segment, h: &BroadcastHandle) -> Result<(ChannelGeometry, Duration)> {
    let bad = |field, detail: String| Error::BadHeader {
        name: h.name.clone(),
        field,
        detail,
    };
    if h.layout_version != layout::VERSION {
        return Err(bad(
            "version",
            format!(
                "this build reads channel layout {}, the handle is {}",
                layout::VERSION,
                h.layout_version
            ),
        ));
    }
    let (geo, c) = validate_channel(seg, &h.name)?;
    if c.nonce != h.nonce {
        return Err(Error::SegmentMismatch {
            name: h.name.clone(),
            expected: h.nonce,
            found: c.nonce,
        });
    }
    let want = |field, handle: u32, found: u32| {
        if handle == found {
            Ok(())
        } else {
            Err(bad(
                field,
                format!("the handle says {handle}, the segment says {found}"),
            ))
        }
    };
    want("n_readers", h.n_readers, geo.n_readers)?;
    want("slots", h.slots, geo.slots)?;
    want("slot_size", h.slot_size, geo.slot_size)?;
    let spin = Duration::from_nanos(c.spin_ns.min(super::MAX_SPIN.as_nanos() as u64));
    Ok((geo, spin))
}
