//! The channel segment's layout, version 1, written down once.
//!
//! ```text
//! offset 0        ChannelHeader (256 B): line 0 immutable geometry,
//!                 line 1 the writer's publish words, line 2 the writer's
//!                 sleep words, line 3 zero
//! 256             ReaderEntry × n_readers (64 B each, one cache line)
//! header_len      slot × slots, each `slot_stride` bytes (64 B aligned):
//!   +0            SlotHeader (64 B): sequence number and length
//!   +64           payload, `slot_size` bytes rounded up to 64
//! ```
//!
//! It begins with the [`Preamble`](super::Preamble) every segment
//! begins with, and its reader entries use the store's state word
//! ([`super::reader_state`]); the rest is its own: fixed slots with
//! sequence numbers, per-reader release marks and futex words, where the
//! store has an allocator's data region, hold words and a hazard.
//!
//! Every field that changes while the channel is live is reached through an
//! atomic in `crate::channel::atomics`, which chooses every ordering; these `Pod`
//! structs are written whole by the creator (before the magic is stamped)
//! and copied out and validated whole by an opener before a single number
//! is trusted. Any change bumps [`VERSION`]; `channel_layout_is_pinned`
//! fixes every size and offset.

use bytemuck::{Pod, Zeroable};

/// `b"PINBCST\x01"` as little-endian: stamped last at create.
pub const MAGIC: u64 = u64::from_le_bytes(*b"PINBCST\x01");
/// Bumped on every change to the structs of this module.
pub const VERSION: u32 = 1;
/// Cache line, and the alignment of every slot and payload.
pub const LINE: usize = 64;
pub use super::round_up;
/// Most readers one channel serves.
pub const MAX_READERS: u32 = 64;
/// Most slots one channel has.
pub const MAX_SLOTS: u32 = 1 << 24;
/// Largest slot payload.
pub const MAX_SLOT_SIZE: u32 = 1 << 30;

/// The first 256 bytes of a channel segment.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct ChannelHeader {
    // ---- line 0: written once by the creator ----
    /// [`MAGIC`], stored last (Release).
    pub magic: u64,
    /// [`VERSION`] of the creator.
    pub version: u32,
    /// Reader entries.
    pub n_readers: u32,
    /// Message slots.
    pub slots: u32,
    /// Largest message.
    pub slot_size: u32,
    /// Bytes from one slot to the next.
    pub slot_stride: u64,
    /// Bytes before the first slot.
    pub header_len: u64,
    /// Bytes of the whole segment.
    pub total_len: u64,
    /// Random at create: tells two channels of one name apart.
    pub nonce: u64,
    /// Readers' default spin before sleeping, ns.
    pub spin_ns: u64,
    // ---- line 1: the writer publishes ----
    /// Atomic. Messages published (sequence numbers `0..write_seq`).
    pub write_seq: u64,
    /// Atomic. 1 once the writer has dropped its `Broadcast`.
    pub closed: u32,
    /// Atomic. Event count readers sleep on (a futex word): bits 0..8
    /// count the readers announced as sleepers in the current epoch,
    /// bits 8.. are the epoch, which the writer bumps when it wakes them.
    pub msg_event: u32,
    /// Zero.
    pub pad1: [u32; 12],
    // ---- line 2: the writer sleeps ----
    /// Atomic. Event count the writer sleeps on (as `msg_event`; readers
    /// bump its epoch when they wake the writer).
    pub slot_event: u32,
    /// Zero.
    pub pad2: [u32; 15],
    // ---- line 3 ----
    /// Zero. Room for later versions.
    pub reserved: [u64; 8],
}

/// One reader's row: one cache line, written by that reader.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct ReaderEntry {
    /// Atomic. Generation and state ([`crate::layout::reader_state`], as
    /// the store's reader table).
    pub state: u64,
    /// Atomic. Messages released: every sequence number below is done with.
    pub released: u64,
    /// Pid of the attached process (for error messages only).
    pub pid: u32,
    /// Zero.
    pub pad: [u32; 11],
}

/// The head of every slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct SlotHeader {
    /// Atomic. Sequence number of the message in the slot.
    pub seq: u64,
    /// Atomic. Its length.
    pub len: u64,
    /// Zero.
    pub pad: [u64; 6],
}

/// Byte offset of reader `i`'s entry.
pub const fn reader_offset(i: u32) -> usize {
    size_of::<ChannelHeader>() + i as usize * size_of::<ReaderEntry>()
}

/// Bytes before the first slot.
pub const fn header_len(n_readers: u32) -> usize {
    round_up(reader_offset(n_readers), LINE)
}

/// Bytes from one slot to the next.
pub const fn slot_stride(slot_size: u32) -> usize {
    size_of::<SlotHeader>() + round_up(slot_size as usize, LINE)
}

/// Bytes of a whole channel segment (`None` on overflow).
pub fn total_len(n_readers: u32, slots: u32, slot_size: u32) -> Option<usize> {
    slot_stride(slot_size)
        .checked_mul(slots as usize)?
        .checked_add(header_len(n_readers))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn channel_layout_is_pinned() {
        assert_eq!(
            VERSION, 1,
            "changing the layout? bump VERSION and this test"
        );
        assert_eq!(size_of::<ChannelHeader>(), 256);
        // The preamble every segment begins with (validated the same way).
        assert_eq!(offset_of!(ChannelHeader, magic), 0);
        assert_eq!(offset_of!(ChannelHeader, version), 8);
        assert_eq!(offset_of!(ChannelHeader, n_readers), 12);
        assert_eq!(offset_of!(ChannelHeader, nonce), 48);
        assert_eq!(offset_of!(ChannelHeader, spin_ns), 56);
        assert_eq!(offset_of!(ChannelHeader, write_seq), 64);
        assert_eq!(offset_of!(ChannelHeader, closed), 72);
        assert_eq!(offset_of!(ChannelHeader, msg_event), 76);
        assert_eq!(offset_of!(ChannelHeader, slot_event), 128);
        assert_eq!(offset_of!(ChannelHeader, reserved), 192);
        assert_eq!(size_of::<ReaderEntry>(), 64);
        assert_eq!(offset_of!(ReaderEntry, released), 8);
        assert_eq!(offset_of!(ReaderEntry, pid), 16);
        assert_eq!(size_of::<SlotHeader>(), 64);
        assert_eq!(offset_of!(SlotHeader, len), 8);
        assert_eq!(reader_offset(2), 384);
        assert_eq!(header_len(3), 448);
        assert_eq!(slot_stride(1), 128);
        assert_eq!(slot_stride(64), 128);
        assert_eq!(slot_stride(65), 192);
        assert_eq!(total_len(1, 4, 64), Some(320 + 4 * 128));
    }
}
