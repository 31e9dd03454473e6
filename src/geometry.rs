//! Validated, process-local bounds of a segment, store ([`StoreGeometry`])
//! or channel ([`ChannelGeometry`]), and the header validation that
//! produces them (used by writers, readers and the inspector). Both kinds
//! go through one check ([`read_stamped`]): size, magic (Acquire, after the
//! creator's Release stamp), version and reader count of the
//! [`Preamble`](layout::Preamble) they share, with one error type naming
//! the field; each kind then checks the fields of its own layout. Nothing
//! here trusts a number read from shared memory before checking it.

use bytemuck::Pod;

use crate::atomics::{HeaderPtr, IndexPtr, ReaderPtr, SlotPtr};
use crate::error::{Error, Result};
use crate::layout::{self, channel, Preamble, SegmentHeader};
use crate::sys::segment::Segment;

/// Validated, process-local copy of a store segment's geometry. Nothing
/// here is read from shared memory again after attach.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StoreGeometry {
    pub(crate) n_readers: u32,
    pub(crate) capacity: u64,
    pub(crate) max_object_size: u64,
    pub(crate) prefix_len: u64,
    /// `flags::AGGREGATE_READS` of the store.
    pub(crate) aggregate: bool,
    /// `flags::CACHE` of the store: objects owe no reads.
    pub(crate) cache: bool,
    /// Entries of the shared key index (0: none).
    pub(crate) index_entries: u64,
    base: *mut u8,
    data: *mut u8,
}

impl StoreGeometry {
    pub(crate) fn new(
        base: *mut u8,
        n_readers: u32,
        capacity: u64,
        max_object_size: u64,
        flags: u64,
        index_entries: u64,
    ) -> Self {
        let header_len = layout::header_len(n_readers);
        StoreGeometry {
            n_readers,
            capacity,
            max_object_size,
            prefix_len: layout::slot_prefix_len(n_readers) as u64,
            aggregate: flags & layout::flags::AGGREGATE_READS != 0,
            cache: flags & layout::flags::CACHE != 0,
            index_entries,
            base,
            // SAFETY: callers checked the mapping is header_len + capacity bytes.
            data: unsafe { base.add(header_len) },
        }
    }

    #[inline]
    pub(crate) fn header(&self) -> HeaderPtr {
        // SAFETY: the mapping starts with a page-aligned 256-byte header.
        unsafe { HeaderPtr::new(self.base) }
    }

    #[inline]
    pub(crate) fn reader(&self, i: u32) -> ReaderPtr {
        debug_assert!(i < self.n_readers);
        // SAFETY: i < n_readers and the header spans header_len(n_readers)
        // bytes, which holds every entry; entries are 8-aligned (64 B each
        // after a 256 B header).
        unsafe { ReaderPtr::new(self.base.add(layout::reader_entry_offset(i))) }
    }

    /// The shared key index, if the store has one.
    #[inline]
    pub(crate) fn index(&self) -> Option<IndexPtr> {
        if self.index_entries == 0 {
            return None;
        }
        let at = layout::index_offset(self.n_readers, self.capacity) as usize;
        // SAFETY: callers checked that the mapping spans the index after the
        // data region (`validate_store`, or the creator's own size), whose
        // offset is page aligned plus a multiple of 64; `index_entries` is a
        // power of two (checked likewise); the header is this mapping's.
        Some(unsafe { IndexPtr::new(self.base.add(at), self.index_entries, self.header()) })
    }

    /// The first byte of the data region in this mapping (`capacity`
    /// bytes from there are the region; handle addresses are offsets
    /// into it).
    #[inline]
    pub(crate) fn data(&self) -> *const u8 {
        self.data
    }

    /// The slot at `address`, if a slot prefix fits there.
    #[inline]
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
    #[inline]
    pub(crate) fn payload(&self, address: u64, size: u64) -> Option<*mut u8> {
        let start = address.checked_add(self.prefix_len)?;
        if start.checked_add(size)? > self.capacity {
            return None;
        }
        // SAFETY: start + size <= capacity: inside the data region.
        Some(unsafe { self.data.add(start as usize) })
    }
}

/// Validated, process-local bounds of a channel (never re-read from shm).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ChannelGeometry {
    /// Reader entries.
    pub n_readers: u32,
    /// Message slots.
    pub slots: u32,
    /// Largest message.
    pub slot_size: u32,
}

/// The errors of one header's checks, each naming the segment and field.
pub(crate) struct HeaderCheck<'a> {
    name: &'a str,
}

impl HeaderCheck<'_> {
    /// A bad `field`, with what is wrong about it.
    pub(crate) fn bad(&self, field: &'static str, detail: String) -> Error {
        Error::BadHeader {
            name: self.name.to_owned(),
            field,
            detail,
        }
    }

    /// `field` must be `expected` (what the header's other fields, or the
    /// caller's handle, imply).
    pub(crate) fn want(&self, field: &'static str, expected: u64, found: u64) -> Result<()> {
        if expected == found {
            Ok(())
        } else {
            Err(self.bad(field, format!("expected {expected}, found {found}")))
        }
    }

    /// `field` must be in `1..=max`.
    pub(crate) fn within(&self, field: &'static str, v: u64, max: u64) -> Result<()> {
        if v == 0 || v > max {
            return Err(self.bad(field, format!("{v} is not in 1..={max}")));
        }
        Ok(())
    }
}

/// What [`read_stamped`] checks a header for: its kind's magic, the name
/// of its version field, and the version this build reads.
pub(crate) struct Kind {
    /// What a segment of this kind is, for the magic's message.
    pub(crate) what: &'static str,
    pub(crate) magic: u64,
    /// The header's version field, as named in its struct.
    pub(crate) version_field: &'static str,
    pub(crate) version: u32,
}

/// The store's kind.
pub(crate) const STORE: Kind = Kind {
    what: "pinshm segment",
    magic: layout::MAGIC,
    version_field: "layout_version",
    version: layout::LAYOUT_VERSION,
};

/// The channel's kind.
pub(crate) const CHANNEL: Kind = Kind {
    what: "broadcast channel",
    magic: channel::MAGIC,
    version_field: "version",
    version: channel::VERSION,
};

/// The header `H` of a segment of `kind`, after the checks both kinds
/// share: the mapping holds a header, the magic is stamped, the version is
/// this build's, and the reader count is in `1..=MAX_READERS`. The caller
/// checks the rest with the [`HeaderCheck`] it gets back.
pub(crate) fn read_stamped<'a, H: Pod>(
    seg: &Segment,
    name: &'a str,
    kind: &Kind,
) -> Result<(H, HeaderCheck<'a>)> {
    debug_assert!(size_of::<H>() >= size_of::<Preamble>() && size_of::<H>() <= layout::PAGE);
    if seg.len() < size_of::<H>() {
        return Err(HeaderCheck { name }.bad(
            "size",
            format!("{} bytes is smaller than a header", seg.len()),
        ));
    }
    // SAFETY: the mapping is page aligned and holds at least a header.
    let magic = unsafe { crate::atomics::stamped_magic(seg.as_ptr()) };
    // SAFETY: as above; page aligned, so aligned for any header.
    let h: H = unsafe { crate::atomics::read_header(seg.as_ptr()) };
    check_stamped(magic, h, name, kind)
}

/// [`read_stamped`]'s checks of a header already copied out of the
/// segment (`magic` as loaded first, then `h`).
fn check_stamped<'a, H: Pod>(
    magic: u64,
    h: H,
    name: &'a str,
    kind: &Kind,
) -> Result<(H, HeaderCheck<'a>)> {
    let check = HeaderCheck { name };
    if magic != kind.magic {
        return Err(check.bad(
            "magic",
            format!(
                "expected {:#x}, found {magic:#x} (not a {}, or its creator has not finished)",
                kind.magic, kind.what
            ),
        ));
    }
    let p: Preamble =
        bytemuck::pod_read_unaligned(&bytemuck::bytes_of(&h)[..size_of::<Preamble>()]);
    if p.version != kind.version {
        return Err(check.bad(
            kind.version_field,
            format!(
                "this build reads version {}, the segment is version {}",
                kind.version, p.version
            ),
        ));
    }
    check.within("n_readers", p.n_readers as u64, layout::MAX_READERS as u64)?;
    Ok((h, check))
}

/// The header of a store segment of `len` bytes, from a copy of its first
/// bytes (`bytes`, read with `pread`: a file that is not this process's to
/// trust is never mapped, see `crate::sys::segment::Peek`), checked as
/// [`validate_store`] checks a mapping's.
pub(crate) fn validate_store_bytes(bytes: &[u8], len: u64, name: &str) -> Result<SegmentHeader> {
    if bytes.len() < size_of::<SegmentHeader>() || len < size_of::<SegmentHeader>() as u64 {
        return Err(
            HeaderCheck { name }.bad("size", format!("{len} bytes is smaller than a header"))
        );
    }
    let h: SegmentHeader = bytemuck::pod_read_unaligned(&bytes[..size_of::<SegmentHeader>()]);
    let magic = u64::from_le_bytes(bytes[..8].try_into().unwrap_or_default());
    let (h, check) = check_stamped(magic, h, name, &STORE)?;
    check_store(&h, len, &check)?;
    Ok(h)
}

/// The store's own fields of a stamped header `h` of a `len`-byte segment.
fn check_store(h: &SegmentHeader, len: u64, check: &HeaderCheck<'_>) -> Result<()> {
    check.want(
        "header_len",
        layout::header_len(h.n_readers) as u64,
        h.header_len,
    )?;
    check.want(
        "slot_prefix_len",
        layout::slot_prefix_len(h.n_readers) as u64,
        h.slot_prefix_len as u64,
    )?;
    check.want(
        "reader_entry_len",
        size_of::<layout::ReaderEntry>() as u64,
        h.reader_entry_len as u64,
    )?;
    if h.capacity == 0 || h.capacity % layout::SLOT_ALIGN as u64 != 0 {
        return Err(check.bad(
            "capacity",
            format!(
                "{} is not a positive multiple of {}",
                h.capacity,
                layout::SLOT_ALIGN
            ),
        ));
    }
    let total = h.header_len.checked_add(h.capacity);
    if total.is_none_or(|t| t > len) {
        return Err(check.bad(
            "capacity",
            format!(
                "header ({}) + capacity ({}) exceed the segment's {} bytes: the segment is too small",
                h.header_len,
                h.capacity,
                len
            ),
        ));
    }
    if h.max_object_size > h.capacity {
        return Err(check.bad(
            "max_object_size",
            format!("{} exceeds capacity {}", h.max_object_size, h.capacity),
        ));
    }
    if h.index_entries != 0
        && (!h.index_entries.is_power_of_two() || h.index_entries > layout::MAX_INDEX_ENTRIES)
    {
        return Err(check.bad(
            "index_entries",
            format!(
                "{} is neither 0 nor a power of two up to {}",
                h.index_entries,
                layout::MAX_INDEX_ENTRIES
            ),
        ));
    }
    // Checked above: header_len + capacity does not overflow, and the index
    // length is at most 2^29.
    let end = h.header_len + h.capacity + layout::index_len(h.index_entries);
    if end > len {
        return Err(check.bad(
            "index_entries",
            format!(
                "a key index of {} entries ends at byte {end}, past the segment's {} bytes",
                h.index_entries, len
            ),
        ));
    }
    if h.flags & !layout::flags::KNOWN != 0 {
        return Err(check.bad(
            "flags",
            format!(
                "{:#x} has bits this build does not know ({:#x})",
                h.flags,
                layout::flags::KNOWN
            ),
        ));
    }
    Ok(())
}

/// Checks every field of a store segment's header before any of it is used.
pub(crate) fn validate_store(seg: &Segment, name: &str) -> Result<StoreGeometry> {
    let (h, check): (SegmentHeader, _) = read_stamped(seg, name, &STORE)?;
    check_store(&h, seg.len() as u64, &check)?;
    Ok(StoreGeometry::new(
        seg.as_ptr(),
        h.n_readers,
        h.capacity,
        h.max_object_size,
        h.flags,
        h.index_entries,
    ))
}

/// Checks every field of a channel segment's header before any of it is
/// used; returns its geometry and the whole header (nonce, spin), for the
/// caller's checks against its handle.
pub(crate) fn validate_channel(
    seg: &Segment,
    name: &str,
) -> Result<(ChannelGeometry, channel::ChannelHeader)> {
    let (c, check): (channel::ChannelHeader, _) = read_stamped(seg, name, &CHANNEL)?;
    check.within("n_readers", c.n_readers as u64, channel::MAX_READERS as u64)?;
    check.within("slots", c.slots as u64, channel::MAX_SLOTS as u64)?;
    check.within(
        "slot_size",
        c.slot_size as u64,
        channel::MAX_SLOT_SIZE as u64,
    )?;
    check.want(
        "slot_stride",
        channel::slot_stride(c.slot_size) as u64,
        c.slot_stride,
    )?;
    check.want(
        "header_len",
        channel::header_len(c.n_readers) as u64,
        c.header_len,
    )?;
    let total = channel::total_len(c.n_readers, c.slots, c.slot_size)
        .ok_or_else(|| check.bad("total_len", "overflows".into()))?;
    check.want("total_len", total as u64, c.total_len)?;
    if total > seg.len() {
        return Err(check.bad(
            "total_len",
            format!(
                "{total} bytes exceed the segment's {}: the segment is too small",
                seg.len()
            ),
        ));
    }
    let geo = ChannelGeometry {
        n_readers: c.n_readers,
        slots: c.slots,
        slot_size: c.slot_size,
    };
    Ok((geo, c))
}
