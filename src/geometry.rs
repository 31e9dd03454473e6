//! Validated, process-local bounds of a store segment, and the header
//! validation that produces them (used by the writer, the readers and the
//! inspector). Nothing here trusts a number read from shared memory before
//! checking it.

use crate::atomics::{HeaderPtr, ReaderPtr, SlotPtr};
use crate::error::{Error, Result};
use crate::layout::{self, SegmentHeader};
use crate::sys::segment::Segment;

/// Validated, process-local copy of a segment's geometry. Nothing here is
/// read from shared memory again after attach.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub(crate) n_readers: u32,
    pub(crate) capacity: u64,
    pub(crate) max_object_size: u64,
    pub(crate) prefix_len: u64,
    /// `flags::AGGREGATE_READS` of the store.
    pub(crate) aggregate: bool,
    base: *mut u8,
    data: *mut u8,
}

impl Geometry {
    pub(crate) fn new(
        base: *mut u8,
        n_readers: u32,
        capacity: u64,
        max_object_size: u64,
        flags: u64,
    ) -> Self {
        let header_len = layout::header_len(n_readers);
        Geometry {
            n_readers,
            capacity,
            max_object_size,
            prefix_len: layout::slot_prefix_len(n_readers) as u64,
            aggregate: flags & layout::flags::AGGREGATE_READS != 0,
            base,
            // SAFETY: callers checked the mapping is header_len + capacity bytes.
            data: unsafe { base.add(header_len) },
        }
    }

    pub(crate) fn header(&self) -> HeaderPtr {
        // SAFETY: the mapping starts with a page-aligned 256-byte header.
        unsafe { HeaderPtr::new(self.base) }
    }

    pub(crate) fn reader(&self, i: u32) -> ReaderPtr {
        debug_assert!(i < self.n_readers);
        // SAFETY: i < n_readers and the header spans header_len(n_readers)
        // bytes, which holds every entry; entries are 8-aligned (128 B each
        // after a 256 B header).
        unsafe { ReaderPtr::new(self.base.add(layout::reader_entry_offset(i))) }
    }

    /// The slot at `address`, if a slot prefix fits there.
    pub(crate) fn slot(&self, address: u64) -> Option<SlotPtr> {
        if address % layout::SLOT_ALIGN as u64 != 0
            || address.checked_add(self.prefix_len)? > self.capacity
        {
            return None;
        }
        // SAFETY: address is 64-aligned and address + prefix_len <= capacity,
        // so the prefix (of n_readers) lies inside the data region (itself
        // page aligned).
        Some(unsafe { SlotPtr::new(self.data.add(address as usize), self.n_readers) })
    }

    /// The payload of `size` bytes of the slot at `address`, if it fits.
    pub(crate) fn payload(&self, address: u64, size: u64) -> Option<*mut u8> {
        let start = address.checked_add(self.prefix_len)?;
        if start.checked_add(size)? > self.capacity {
            return None;
        }
        // SAFETY: start + size <= capacity: inside the data region.
        Some(unsafe { self.data.add(start as usize) })
    }
}

/// Checks every field of a segment's header before any of it is used.
pub(crate) fn validate_header(seg: &Segment, name: &str) -> Result<Geometry> {
    let bad = |field, detail: String| Error::BadHeader {
        name: name.to_owned(),
        field,
        detail,
    };
    if seg.len() < size_of::<SegmentHeader>() {
        return Err(bad(
            "size",
            format!("{} bytes is smaller than a header", seg.len()),
        ));
    }
    // SAFETY: the mapping is page aligned and at least 256 bytes long.
    let hp = unsafe { HeaderPtr::new(seg.as_ptr()) };
    let magic = hp.magic();
    if magic != layout::MAGIC {
        return Err(bad(
            "magic",
            format!(
                "expected {:#x}, found {magic:#x} (not a pinshm segment, or its creator has not finished)",
                layout::MAGIC
            ),
        ));
    }
    let h = hp.read();
    if h.layout_version != layout::LAYOUT_VERSION {
        return Err(bad(
            "layout_version",
            format!(
                "this build reads version {}, the segment is version {}",
                layout::LAYOUT_VERSION,
                h.layout_version
            ),
        ));
    }
    if h.n_readers == 0 || h.n_readers > layout::MAX_READERS {
        return Err(bad(
            "n_readers",
            format!("{} is not in 1..={}", h.n_readers, layout::MAX_READERS),
        ));
    }
    let want = |field, expected: u64, found: u64| {
        if expected == found {
            Ok(())
        } else {
            Err(bad(field, format!("expected {expected}, found {found}")))
        }
    };
    want(
        "header_len",
        layout::header_len(h.n_readers) as u64,
        h.header_len,
    )?;
    want(
        "slot_prefix_len",
        layout::slot_prefix_len(h.n_readers) as u64,
        h.slot_prefix_len as u64,
    )?;
    want(
        "reader_entry_len",
        size_of::<layout::ReaderEntry>() as u64,
        h.reader_entry_len as u64,
    )?;
    if h.capacity == 0 || h.capacity % layout::SLOT_ALIGN as u64 != 0 {
        return Err(bad(
            "capacity",
            format!(
                "{} is not a positive multiple of {}",
                h.capacity,
                layout::SLOT_ALIGN
            ),
        ));
    }
    let total = h.header_len.checked_add(h.capacity);
    if total.is_none_or(|t| t > seg.len() as u64) {
        return Err(bad(
            "capacity",
            format!(
                "header ({}) + capacity ({}) exceed the segment's {} bytes: the segment is too small",
                h.header_len,
                h.capacity,
                seg.len()
            ),
        ));
    }
    if h.max_object_size > h.capacity {
        return Err(bad(
            "max_object_size",
            format!("{} exceeds capacity {}", h.max_object_size, h.capacity),
        ));
    }
    if h.flags & !layout::flags::KNOWN != 0 {
        return Err(bad(
            "flags",
            format!(
                "{:#x} has bits this build does not know ({:#x})",
                h.flags,
                layout::flags::KNOWN
            ),
        ));
    }
    Ok(Geometry::new(
        seg.as_ptr(),
        h.n_readers,
        h.capacity,
        h.max_object_size,
        h.flags,
    ))
}
