//! The checks a reader makes of a channel's header before it trusts it.

use std::time::Duration;

use super::atomics::{self, Geometry};
use super::{layout, BroadcastHandle};
use crate::error::{Error, Result};
use crate::sys::segment::Segment;

/// Validates the header against the mapping and the handle.
pub(super) fn validate(seg: &Segment, h: &BroadcastHandle) -> Result<(Geometry, Duration)> {
    let bad = |field, detail: String| Error::BadHeader {
        name: h.name.clone(),
        field,
        detail,
    };
    if seg.len() < size_of::<layout::ChannelHeader>() {
        return Err(bad(
            "size",
            format!("{} bytes is smaller than a header", seg.len()),
        ));
    }
    // SAFETY: the mapping is page aligned and at least 256 bytes long.
    let magic = unsafe { atomics::magic(seg.as_ptr()) };
    if magic != layout::MAGIC {
        return Err(bad(
            "magic",
            format!("expected {:#x}, found {magic:#x} (not a broadcast channel, or its creator has not finished)", layout::MAGIC),
        ));
    }
    // SAFETY: as above.
    let c = unsafe { atomics::read_header(seg.as_ptr()) };
    if c.version != layout::VERSION || h.layout_version != layout::VERSION {
        return Err(bad(
            "version",
            format!(
                "this build reads channel layout {}, the segment is {} and the handle {}",
                layout::VERSION,
                c.version,
                h.layout_version
            ),
        ));
    }
    if c.nonce != h.nonce {
        return Err(Error::SegmentMismatch {
            name: h.name.clone(),
            expected: h.nonce,
            found: c.nonce,
        });
    }
    let want = |field, handle: u64, found: u64| {
        if handle == found {
            Ok(())
        } else {
            Err(bad(
                field,
                format!("the handle says {handle}, the segment says {found}"),
            ))
        }
    };
    want("n_readers", h.n_readers as u64, c.n_readers as u64)?;
    want("slots", h.slots as u64, c.slots as u64)?;
    want("slot_size", h.slot_size as u64, c.slot_size as u64)?;
    if c.n_readers == 0 || c.n_readers > layout::MAX_READERS {
        return Err(bad(
            "n_readers",
            format!("{} is not in 1..={}", c.n_readers, layout::MAX_READERS),
        ));
    }
    if c.slots == 0 || c.slots > layout::MAX_SLOTS {
        return Err(bad(
            "slots",
            format!("{} is not in 1..={}", c.slots, layout::MAX_SLOTS),
        ));
    }
    if c.slot_size == 0 || c.slot_size > layout::MAX_SLOT_SIZE {
        return Err(bad(
            "slot_size",
            format!("{} is not in 1..={}", c.slot_size, layout::MAX_SLOT_SIZE),
        ));
    }
    want(
        "slot_stride",
        layout::slot_stride(c.slot_size) as u64,
        c.slot_stride,
    )?;
    want(
        "header_len",
        layout::header_len(c.n_readers) as u64,
        c.header_len,
    )?;
    let total = layout::total_len(c.n_readers, c.slots, c.slot_size)
        .ok_or_else(|| bad("total_len", "overflows".into()))?;
    want("total_len", total as u64, c.total_len)?;
    if total > seg.len() {
        return Err(bad(
            "total_len",
            format!(
                "{total} bytes exceed the segment's {}: the segment is too small",
                seg.len()
            ),
        ));
    }
    let spin = Duration::from_nanos(c.spin_ns.min(super::MAX_SPIN.as_nanos() as u64));
    Ok((
        Geometry {
            n_readers: c.n_readers,
            slots: c.slots,
            slot_size: c.slot_size,
        },
        spin,
    ))
}
