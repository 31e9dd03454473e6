//! The segment layout, written down once; its version is [`LAYOUT_VERSION`].
//!
//! Version 2 added `SegmentHeader::cleared_below` and the reader entry's
//! `stale_reads` and `attached_ns` (for the inspector and stuck readers).
//! Version 3 moved liveness to open-file-description locks: the reader
//! entry's state word carries an attach generation (so the writer's "dead"
//! mark cannot hit a reader that re-attached meanwhile), and the pid start
//! times and the slot's copy of the epoch are gone.
//! Version 4 added `SegmentHeader::flags` (aggregate read accounting) and
//! the handle-signing `secret`.
//! Version 5 replaced the 64 hazard words per reader (a limit of 64 guards
//! and a long writer scan) by per-slot hold counters, one per reader, next
//! to the read counters; one hazard word per reader remains, held only for
//! the instant a hold is being taken. The header's ring head and tail
//! became the allocator's cursor and high-water mark (objects are no longer
//! freed in FIFO order).
//! Version 6 keyed the slot tag with the segment's secret
//! ([`keyed_slot_tag`]), and the writer zeroes a slot's tag with its id when
//! it frees it: a reader checks id and tag after an optimistic copy, and
//! neither can be reproduced by the payload of a newer object that covers
//! the old header. It also added `SegmentHeader::backed`, how much of the
//! data region the writer has backed: readers touch nothing past it.
//! Version 7 wrote the one hazard word per reader as one
//! (`ReaderEntry::hazard`, at the offset of the old one-element array) and
//! dropped the header's `hazards_per_reader` (now `reserved1`, zero): there
//! is nothing left to configure, so nothing to check.
//! Version 8 added the shared key index (`SegmentHeader::index_entries`
//! and `index_seq`, and an [`IndexEntry`] table after the data region), the
//! slot's `key_fp` (the fingerprint of its key, which a lookup checks under
//! its hold) and `touched` (set by readers' key hits, for the writer's
//! second-chance eviction), and the [`flags::CACHE`] flag.
//! Version 9 computes key fingerprints (the slot's `key_fp`, the index's
//! `fp`) with keyed SipHash-1-3 ([`FingerprintKey`]) instead of keyed
//! SHA-256: the same 128 bits in the same places, of another function.
//! It also made the reader entry one cache line (64 B, the hazard word at
//! offset 48, where two reserved words were): what a reclaim reads of each
//! reader (state, `counted_from`, hazard) is one line, not two, and the
//! lines a reader writes (hazard, acknowledgement time) are that one too.
//!
//! ```text
//! offset 0            SegmentHeader (256 B)
//! 256                 ReaderEntry × n_readers (64 B each, one cache line: state, pid, counters, times, the hazard word)
//! header_len          data region (capacity bytes, page aligned): slots and gaps
//! header_len+capacity key index: IndexEntry × index_entries (32 B each; none if 0)
//!   slot (64 B aligned):
//!     +0              SlotHeader (64 B)
//!     +64             reads: [u32; n_readers], one acknowledged-read counter per reader
//!     +holds_offset   holds: [u64; n_readers], one hold word per reader (8 B aligned)
//!     +prefix_len     payload (64 B aligned), `size` bytes
//!   gap (64 B aligned): a SlotHeader with id 0, size 0 and slot_len = the gap's length
//! ```
//!
//! Every field that another process changes while the segment is live is
//! reached through an atomic at a fixed offset (`offset_of!`) and its
//! orderings are chosen in [`crate::atomics`]; the structs here are `Pod` so the
//! creator can write them whole and an opener can copy them out and validate
//! them before trusting a single number. Any change to these structs bumps
//! [`LAYOUT_VERSION`]; `layout_is_pinned` in the tests fixes every size and
//! offset.

use bytemuck::{Pod, Zeroable};

pub mod channel;

/// `b"PINSHM\0\x01"` read as little-endian: written last at create, so an
/// opener that sees it sees an initialised header.
pub const MAGIC: u64 = u64::from_le_bytes(*b"PINSHM\0\x01");
/// Bumped on every change to the structs in this module.
pub const LAYOUT_VERSION: u32 = 9;
/// Page size the header is rounded to; the data region starts page aligned.
pub const PAGE: usize = 4096;
/// Alignment of every slot and every payload.
pub const SLOT_ALIGN: usize = 64;
/// Most readers one store segment can serve: enough for every rank of a
/// node's largest deployments (TP × DP × PP = 128 and past). Each reader
/// costs 12 bytes of every slot's prefix and 64 of the header; a
/// channel's limit is its own ([`channel::MAX_READERS`]). Builds from
/// before the limit was raised (same layout version) refuse a segment of
/// more than 64 readers by name (`n_readers`).
pub const MAX_READERS: u32 = 1024;

/// The first 16 bytes of every segment, store ([`SegmentHeader`]) or
/// channel ([`channel::ChannelHeader`]): the magic, stamped last, then the
/// layout version and the reader count, at the same offsets in both, so
/// one check reads them (`crate::geometry`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct Preamble {
    /// The kind's magic, stored last (Release) by the creator.
    pub magic: u64,
    /// The kind's layout version of the creator.
    pub version: u32,
    /// Reader table entries.
    pub n_readers: u32,
}

/// What a slot's payload is (`SlotHeader::kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
#[non_exhaustive]
pub enum ObjectKind {
    /// Raw bytes.
    Raw = 0,
    /// A tensor (codec: header, then payload).
    Tensor = 1,
    /// An item (codec: named tensors and metadata).
    Item = 2,
}

impl ObjectKind {
    /// The kind stored as `code`, if it is one.
    pub fn from_code(code: u32) -> Option<ObjectKind> {
        match code {
            0 => Some(ObjectKind::Raw),
            1 => Some(ObjectKind::Tensor),
            2 => Some(ObjectKind::Item),
            _ => None,
        }
    }
}

/// Bits of `SegmentHeader::flags`.
pub mod flags {
    /// Reads are counted in one counter per slot (`reads[0]`), from any
    /// reader: an object referenced k times is done after k × readers
    /// reads (vLLM's accounting). Unset: one counter per reader.
    pub const AGGREGATE_READS: u64 = 1;
    /// A cache (v8): objects owe no reads. Any object nobody holds or
    /// leases may be reclaimed, read or not.
    pub const CACHE: u64 = 2;
    /// Every flag this build knows.
    pub const KNOWN: u64 = AGGREGATE_READS | CACHE;
}

/// Reader table entry states, for the store's and the channel's reader
/// tables alike: the low byte of an entry's 64-bit state word, whose upper
/// 56 bits count attaches into the entry (the generation), so a
/// compare-and-swap of the whole word fails against a newer attach.
pub mod reader_state {
    /// Never attached since create: counted (the writer keeps what it is
    /// owed: a store its reads, a channel every message).
    pub const VACANT: u32 = 0;
    /// A process is taking over an entry that was left; not counted yet.
    pub const ATTACHING: u32 = 1;
    /// A live reader: counted (a store's reader for objects with
    /// `id >= counted_from`).
    pub const ATTACHED: u32 = 2;
    /// Detached or found dead: not counted, its hazard and holds ignored.
    pub const LEFT: u32 = 3;

    /// The state of a state word.
    #[inline]
    pub const fn state(word: u64) -> u32 {
        (word & 0xff) as u32
    }

    /// The generation of a state word.
    #[inline]
    pub const fn generation(word: u64) -> u64 {
        word >> 8
    }

    /// The generation the next attach into an entry whose word is `word`
    /// takes (wrapping within its 56 bits).
    pub const fn next_generation(word: u64) -> u64 {
        generation(word).wrapping_add(1) & (u64::MAX >> 8)
    }

    /// The state word of `state` in `generation`.
    #[inline]
    pub const fn word(generation: u64, state: u32) -> u64 {
        (generation << 8) | (state as u64 & 0xff)
    }
}

/// The first 256 bytes of a segment.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct SegmentHeader {
    /// [`MAGIC`], stored last (Release) by the creator.
    pub magic: u64,
    /// [`LAYOUT_VERSION`] of the creator.
    pub layout_version: u32,
    /// Number of reader table entries.
    pub n_readers: u32,
    /// Bytes before the data region (page multiple).
    pub header_len: u64,
    /// Bytes in the data region (multiple of [`SLOT_ALIGN`]).
    pub capacity: u64,
    /// Largest payload a put accepts.
    pub max_object_size: u64,
    /// Random at create, never changes: tells two segments of one name apart.
    pub nonce: u64,
    /// `SlotHeader` + reader counters, rounded to [`SLOT_ALIGN`].
    pub slot_prefix_len: u32,
    /// Zero (v6: the hazard words per reader, always 1).
    pub reserved1: u32,
    /// `size_of::<ReaderEntry>()` of the creator.
    pub reader_entry_len: u32,
    /// Atomic. Writer's pid, for messages only (liveness is the writer's
    /// lock); 0 once the writer has closed the store.
    pub writer_pid: u32,
    /// Zero (v2: the writer's start time).
    pub reserved0: u64,
    /// Atomic. Changes on create and `clear`; mixed into every slot's tag.
    pub epoch: u64,
    /// Atomic. The id the next put will get (ids start at 1; 0 means "none").
    pub next_id: u64,
    /// Atomic. Where the writer's allocator looks next (for inspection, v5).
    pub cursor: u64,
    /// Atomic. One past the furthest byte ever allocated: below it the data
    /// region is slots and marked gaps (for inspection, v5).
    pub high_water: u64,
    /// Atomic. Ids below this were dropped by the last `clear` (v2).
    pub cleared_below: u64,
    /// [`flags`] of the store, fixed at create (v4).
    pub flags: u64,
    /// Random at create: the key of the handles' HMAC signatures (v4).
    /// Readers map it; the inspector never prints it.
    pub secret: [u8; 32],
    /// Atomic. Bytes of the data region, from its start, that the writer
    /// has backed (allocated in /dev/shm, v6): a reader touches no byte at
    /// or past it, so a handle past what was ever written (stale, of
    /// another store, corrupted) allocates no page and cannot raise
    /// SIGBUS. Only grows; for a reserved store, the whole segment after
    /// the header (readers bound every access by `capacity` as well).
    pub backed: u64,
    /// Entries of the shared key index after the data region: 0 (no index)
    /// or a power of two (v8).
    pub index_entries: u64,
    /// Atomic. The key index's sequence word: odd while the writer changes
    /// the table, bumped twice per change (v8).
    pub index_seq: u64,
    /// Zero. Room for fields of later versions.
    pub reserved: [u64; 10],
}

/// One reader's row of the reader table.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct ReaderEntry {
    /// Atomic. `reader_state::word(generation, state)`: one of
    /// [`reader_state`] in the low byte, attaches into this entry above.
    pub state: u64,
    /// Pid of the attached process, for messages only (0 while unknown):
    /// liveness is the holder's lock, which no pid namespace confuses.
    pub pid: u32,
    /// Zero.
    pub reserved0: u32,
    /// Objects with a smaller id are not counted for this reader.
    pub counted_from: u64,
    /// Atomic. Monotonic-clock nanoseconds of the last acknowledged read.
    pub last_ack_ns: u64,
    /// Atomic. Stale handles this reader met (v2).
    pub stale_reads: u64,
    /// Monotonic-clock nanoseconds of the attach (v2).
    pub attached_ns: u64,
    /// Atomic. The hazard: the id of the object this reader is taking a
    /// hold on, for that instant (0 = none). One per reader, whatever the
    /// number of its guards (they are counted in the slots' hold words).
    /// In the entry's one cache line with the state and `counted_from`
    /// (v9): a reclaim's scan of the table reads one line per reader.
    pub hazard: u64,
    /// Zero: the entry is one cache line.
    pub reserved: u64,
}

/// The fixed head of every slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct SlotHeader {
    /// Atomic. Monotonic id of the object here; 0 while free or being written.
    pub id: u64,
    /// `keyed_slot_tag(key, id, address, epoch, size, kind)`: a stale
    /// handle that points into the middle of a newer object's payload cannot
    /// match it, by accident or by the payload's design, and a corrupted
    /// size or kind is caught before it is used. Zeroed with `id` when the
    /// slot is freed (v6).
    pub tag: u64,
    /// Payload bytes.
    pub size: u64,
    /// Bytes the slot spans in the ring (prefix + payload, aligned).
    pub slot_len: u64,
    /// Atomic. Writer references: each put / get_cached adds one expected
    /// read per reader.
    pub refs: u32,
    /// What the payload is: an [`ObjectKind`] code.
    pub kind: u32,
    /// The fingerprint of the object's key ([`key_fingerprint`]), written
    /// before the id is published (v8): a lookup by key checks it once it
    /// holds the slot, so a torn or outdated index entry never yields
    /// another key's object.
    pub key_fp: [u64; 2],
    /// Atomic. Set by a reader's hit by key, cleared by the writer's
    /// second-chance sweep (v8).
    pub touched: u64,
}

/// One entry of the shared key index (v8): a key's fingerprint and where
/// its object is. Empty while `id` is 0. Written only by the writer, under
/// the index's sequence word; read lock-free by readers, who trust nothing
/// in it before the slot it names has been checked.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct IndexEntry {
    /// Atomic. [`key_fingerprint`] of the key.
    pub fp: [u64; 2],
    /// Atomic. The object's id; 0 = empty.
    pub id: u64,
    /// Atomic. The object's slot address in the data region.
    pub address: u64,
}

/// The most entries a key index may have (2^24: 512 MiB of table).
pub const MAX_INDEX_ENTRIES: u64 = 1 << 24;

/// Byte offset of the key index in a segment.
pub const fn index_offset(n_readers: u32, capacity: u64) -> u64 {
    header_len(n_readers) as u64 + capacity
}

/// Bytes of a key index of `entries` entries.
pub const fn index_len(entries: u64) -> u64 {
    entries * size_of::<IndexEntry>() as u64
}

/// The key of a segment's key fingerprints (v9): SipHash-1-3's 128-bit
/// key, derived once from the segment's `secret` (random at create, never
/// in a handle, never printed). Build it once per process (attach, create)
/// and fingerprint every key with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FingerprintKey(u64, u64);

impl FingerprintKey {
    /// The fingerprint key of a segment whose secret is `secret`: SipHash
    /// keyed with the secret's first half, over a label and its second
    /// half. So every byte of the secret counts, and the key is not the
    /// raw bytes the handle signatures' HMAC is keyed with (a function of
    /// its own, whatever the other computes).
    pub fn new(secret: &[u8; 32]) -> FingerprintKey {
        use siphasher::sip128::{Hasher128, SipHasher13};
        use std::hash::Hasher;
        let half: [u8; 16] = secret[..16].try_into().expect("16 bytes");
        let mut h = SipHasher13::new_with_key(&half);
        h.write(b"pinshm key fingerprint v9");
        h.write(&secret[16..]);
        let k = h.finish128();
        FingerprintKey(k.h1, k.h2)
    }

    /// The fingerprint of `key`: SipHash-1-3 with 128-bit output, keyed,
    /// never all zero (an index entry's 0 means empty). A keyed PRF: nobody
    /// who has not mapped the segment can make two keys collide but by a
    /// 2^-128 accident per pair (an online search would need about 2^64
    /// puts and lookups).
    #[inline]
    pub fn fingerprint(&self, key: &str) -> [u64; 2] {
        use siphasher::sip128::SipHasher13;
        let d = SipHasher13::new_with_keys(self.0, self.1).hash(key.as_bytes());
        if d.h1 == 0 && d.h2 == 0 {
            [1, 0]
        } else {
            [d.h1, d.h2]
        }
    }
}

/// The fingerprint of `key` in a segment whose secret is `secret`
/// ([`FingerprintKey::fingerprint`], deriving the key each call: where a
/// key is fingerprinted often, keep a [`FingerprintKey`]). Up to v8 it was
/// the first 128 bits of SHA-256(secret ‖ key), most of a lookup's cost.
pub fn key_fingerprint(secret: &[u8; 32], key: &str) -> [u64; 2] {
    FingerprintKey::new(secret).fingerprint(key)
}

/// Byte offset of reader `i`'s entry in the header.
#[inline]
pub const fn reader_entry_offset(i: u32) -> usize {
    size_of::<SegmentHeader>() + i as usize * size_of::<ReaderEntry>()
}

/// Bytes before the data region for `n_readers` readers.
pub const fn header_len(n_readers: u32) -> usize {
    round_up(reader_entry_offset(n_readers), PAGE)
}

/// Bytes from a slot's start to its hold words (after the read counters).
#[inline]
pub const fn holds_offset(n_readers: u32) -> usize {
    round_up(size_of::<SlotHeader>() + 4 * n_readers as usize, 8)
}

/// Bytes from a slot's start to its payload.
pub const fn slot_prefix_len(n_readers: u32) -> usize {
    round_up(holds_offset(n_readers) + 8 * n_readers as usize, SLOT_ALIGN)
}

/// A hold word: `count` holds taken by the reader of attach generation
/// `generation` (its low 32 bits). A word of another generation is a dead
/// holder's leftover and counts as no hold.
pub mod hold {
    /// The word of `count` holds in `generation`.
    #[inline]
    pub const fn word(generation: u64, count: u32) -> u64 {
        ((generation & 0xffff_ffff) << 32) | count as u64
    }

    /// Holds this word counts for a reader of `generation`.
    #[inline]
    pub const fn count_for(word: u64, generation: u64) -> u32 {
        if word >> 32 == generation & 0xffff_ffff {
            word as u32
        } else {
            0
        }
    }
}

/// Bytes a slot of `payload` bytes spans.
pub const fn slot_len(n_readers: u32, payload: usize) -> usize {
    slot_prefix_len(n_readers) + round_up(payload, SLOT_ALIGN)
}

/// Round `v` up to a multiple of `to` (a power of two).
pub const fn round_up(v: usize, to: usize) -> usize {
    (v + to - 1) & !(to - 1)
}

/// splitmix64's finaliser: a bijection of 64-bit words that spreads every
/// input bit over the output.
#[inline]
const fn splitmix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// An unkeyed 64-bit mix of id, address, epoch, payload size and kind:
/// what layout version 5 stored as the tag. Everything in it is in a
/// handle (or follows from one), so whoever builds a payload from a
/// handle can compute it; the stored tag is [`keyed_slot_tag`].
#[inline]
pub fn slot_tag(id: u64, address: u64, epoch: u64, size: u64, kind: u32) -> u64 {
    let a = splitmix(id ^ address.rotate_left(23) ^ epoch.rotate_left(41) ^ MAGIC);
    splitmix(a ^ size.rotate_left(7) ^ ((kind as u64) << 57))
}

/// The key of a segment's tags, from its `secret` (random at create,
/// never in a handle, never printed).
pub fn tag_key(secret: &[u8; 32]) -> u64 {
    secret.chunks_exact(8).fold(MAGIC, |k, w| {
        splitmix(k ^ u64::from_le_bytes(w.try_into().expect("8 bytes")))
    })
}

/// The check word stored in a slot (v6): [`slot_tag`] mixed with the
/// segment's [`tag_key`].
///
/// Keyed because a slot's header can become another object's payload: once
/// a slot is freed, a newer object may start before it, and its payload
/// bytes then lie where the old header was. Payload bytes equal to the old
/// id, size or kind are easy (small integers in a token tensor); equal to
/// the unkeyed tag, easy for anyone holding the old handle. Equal to the
/// keyed tag, only by a 2^-64 accident or by someone who maps the segment
/// and reads its secret, a party that could write the bytes it wants
/// anyway. So a reader that checks the tag, at the start of a read and
/// again after an optimistic copy, never takes payload bytes for a header.
#[inline]
pub fn keyed_slot_tag(key: u64, id: u64, address: u64, epoch: u64, size: u64, kind: u32) -> u64 {
    splitmix(slot_tag(id, address, epoch, size, kind) ^ key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn layout_is_pinned() {
        assert_eq!(size_of::<Preamble>(), 16);
        assert_eq!(offset_of!(Preamble, version), 8);
        assert_eq!(offset_of!(Preamble, n_readers), 12);
        assert_eq!(size_of::<SegmentHeader>(), 256);
        assert_eq!(offset_of!(SegmentHeader, magic), 0);
        assert_eq!(offset_of!(SegmentHeader, layout_version), 8);
        assert_eq!(offset_of!(SegmentHeader, n_readers), 12);
        assert_eq!(offset_of!(SegmentHeader, header_len), 16);
        assert_eq!(offset_of!(SegmentHeader, capacity), 24);
        assert_eq!(offset_of!(SegmentHeader, max_object_size), 32);
        assert_eq!(offset_of!(SegmentHeader, nonce), 40);
        assert_eq!(offset_of!(SegmentHeader, slot_prefix_len), 48);
        assert_eq!(offset_of!(SegmentHeader, reserved1), 52);
        assert_eq!(offset_of!(SegmentHeader, reader_entry_len), 56);
        assert_eq!(offset_of!(SegmentHeader, writer_pid), 60);
        assert_eq!(offset_of!(SegmentHeader, reserved0), 64);
        assert_eq!(offset_of!(SegmentHeader, epoch), 72);
        assert_eq!(offset_of!(SegmentHeader, next_id), 80);
        assert_eq!(offset_of!(SegmentHeader, cursor), 88);
        assert_eq!(offset_of!(SegmentHeader, high_water), 96);
        assert_eq!(offset_of!(SegmentHeader, cleared_below), 104);
        assert_eq!(offset_of!(SegmentHeader, flags), 112);
        assert_eq!(offset_of!(SegmentHeader, secret), 120);
        assert_eq!(offset_of!(SegmentHeader, backed), 152);
        assert_eq!(offset_of!(SegmentHeader, index_entries), 160);
        assert_eq!(offset_of!(SegmentHeader, index_seq), 168);
        assert_eq!(offset_of!(SegmentHeader, reserved), 176);

        assert_eq!(size_of::<ReaderEntry>(), 64);
        assert_eq!(offset_of!(ReaderEntry, state), 0);
        assert_eq!(offset_of!(ReaderEntry, pid), 8);
        assert_eq!(offset_of!(ReaderEntry, counted_from), 16);
        assert_eq!(offset_of!(ReaderEntry, last_ack_ns), 24);
        assert_eq!(offset_of!(ReaderEntry, stale_reads), 32);
        assert_eq!(offset_of!(ReaderEntry, attached_ns), 40);
        assert_eq!(offset_of!(ReaderEntry, hazard), 48);
        assert_eq!(offset_of!(ReaderEntry, reserved), 56);

        assert_eq!(size_of::<SlotHeader>(), 64);
        assert_eq!(offset_of!(SlotHeader, id), 0);
        assert_eq!(offset_of!(SlotHeader, tag), 8);
        assert_eq!(offset_of!(SlotHeader, size), 16);
        assert_eq!(offset_of!(SlotHeader, slot_len), 24);
        assert_eq!(offset_of!(SlotHeader, refs), 32);
        assert_eq!(offset_of!(SlotHeader, kind), 36);
        assert_eq!(offset_of!(SlotHeader, key_fp), 40);
        assert_eq!(offset_of!(SlotHeader, touched), 56);

        assert_eq!(size_of::<IndexEntry>(), 32);
        assert_eq!(offset_of!(IndexEntry, fp), 0);
        assert_eq!(offset_of!(IndexEntry, id), 16);
        assert_eq!(offset_of!(IndexEntry, address), 24);
        assert_eq!(index_offset(2, 1 << 20), 4096 + (1 << 20));
        assert_eq!(index_len(1024), 32 * 1024);

        assert_eq!(LAYOUT_VERSION, 9);
        assert_eq!(header_len(1), 4096);
        assert_eq!(header_len(8), 4096);
        assert_eq!(header_len(64), 8192);
        assert_eq!(
            header_len(MAX_READERS),
            4096 + 1024 * size_of::<ReaderEntry>()
        );
        assert_eq!(reader_entry_offset(1) % 64, 0, "entries start on lines");
        assert_eq!(holds_offset(1), 72);
        assert_eq!(holds_offset(2), 72);
        assert_eq!(holds_offset(3), 80);
        assert_eq!(slot_prefix_len(1), 128);
        assert_eq!(slot_prefix_len(4), 128);
        assert_eq!(slot_prefix_len(5), 128);
        assert_eq!(slot_prefix_len(6), 192);
        assert_eq!(slot_prefix_len(8), 192);
        assert_eq!(slot_prefix_len(64), 832);
        assert_eq!(slot_prefix_len(MAX_READERS), 12352);
        assert_eq!(slot_len(2, 0), 128);
        assert_eq!(slot_len(2, 1), 192);
    }

    #[test]
    fn hold_words_count_only_for_their_generation() {
        let w = hold::word(7, 3);
        assert_eq!(hold::count_for(w, 7), 3);
        assert_eq!(hold::count_for(w, 8), 0, "a dead holder's leftover");
        assert_eq!(hold::count_for(0, 0), 0);
        assert_eq!(
            hold::count_for(hold::word(1 << 32 | 5, 2), 5),
            2,
            "low 32 bits"
        );
    }

    #[test]
    fn state_words_keep_state_and_generation_apart() {
        use reader_state::*;
        let w = word(0x00ab_cdef_0123_4567, LEFT);
        assert_eq!(state(w), LEFT);
        assert_eq!(generation(w), 0x00ab_cdef_0123_4567);
        assert_ne!(word(1, ATTACHED), word(2, ATTACHED));
        assert_eq!(state(word(7, ATTACHING)), ATTACHING);
        assert_eq!(next_generation(word(7, LEFT)), 8);
        assert_eq!(
            next_generation(word(u64::MAX >> 8, LEFT)),
            0,
            "wraps in 56 bits"
        );
    }

    #[test]
    fn key_fingerprints_depend_on_key_and_secret_and_are_never_zero() {
        let a = key_fingerprint(&[1; 32], "image-1");
        assert_ne!(a, key_fingerprint(&[1; 32], "image-2"));
        assert_ne!(a, key_fingerprint(&[2; 32], "image-1"));
        assert_eq!(a, key_fingerprint(&[1; 32], "image-1"));
        assert_ne!(key_fingerprint(&[0; 32], ""), [0, 0]);
        let mut one_bit = [1; 32];
        one_bit[31] ^= 0x80;
        assert_ne!(a, key_fingerprint(&one_bit, "image-1"), "every byte counts");
        one_bit = [1; 32];
        one_bit[0] ^= 1;
        assert_ne!(a, key_fingerprint(&one_bit, "image-1"), "every byte counts");
        let k = FingerprintKey::new(&[1; 32]);
        assert_eq!(k.fingerprint("image-1"), a, "the kept key gives the same");
    }

    #[test]
    fn tags_differ_for_neighbouring_ids_addresses_epochs_sizes_and_kinds() {
        let t = slot_tag(7, 4096, 99, 10, 0);
        assert_ne!(t, slot_tag(8, 4096, 99, 10, 0));
        assert_ne!(t, slot_tag(7, 4160, 99, 10, 0));
        assert_ne!(t, slot_tag(7, 4096, 100, 10, 0));
        assert_ne!(t, slot_tag(7, 4096, 99, 11, 0));
        assert_ne!(t, slot_tag(7, 4096, 99, 10, 1));
    }

    #[test]
    fn the_stored_tag_depends_on_the_secret() {
        let (k1, k2) = (tag_key(&[1; 32]), tag_key(&[2; 32]));
        assert_ne!(k1, k2);
        let mut one_bit = [1; 32];
        one_bit[31] ^= 0x80;
        assert_ne!(k1, tag_key(&one_bit), "every byte of the secret counts");
        let t = keyed_slot_tag(k1, 7, 4096, 99, 10, 0);
        assert_ne!(t, keyed_slot_tag(k2, 7, 4096, 99, 10, 0));
        assert_ne!(t, slot_tag(7, 4096, 99, 10, 0), "not the handle's mix");
        assert_ne!(t, keyed_slot_tag(k1, 8, 4096, 99, 10, 0));
        assert_ne!(t, keyed_slot_tag(k1, 7, 4096, 99, 11, 0));
    }
}
