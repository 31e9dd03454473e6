//! The atomics over a mapped store segment: [`SlotPtr`], [`ReaderPtr`],
//! [`HeaderPtr`]. The only code that touches the atomics of a store
//! segment; **every memory ordering of the store is chosen here**, next to
//! the field it guards. Below both protocols: [`word`], the atomics and
//! futex that the store and the channel (`crate::channel::atomics`) are
//! written against, loom's under `--cfg pinshm_loom`; [`field`], the one place a
//! mapping's bytes become an atomic; and the header functions every segment
//! is written, stamped and read back with.
//!
//!
//! | field | written by | read by | protocol |
//! |---|---|---|---|
//! | `SlotHeader::id` | writer: 0 (Relaxed + Release fence) before reuse, the new id (Release) to publish, 0 (Relaxed + SeqCst fence) to reclaim, old id (Release) to back off | readers: Acquire (optimistic copy; after the hazard's SeqCst fence) | seqlock publish / validate; Dekker pair with `hazard` |
//! | `SlotHeader::tag` | writer: the keyed tag (Relaxed, before the id's Release) to publish, 0 (Relaxed, with the id's 0, before the SeqCst fence) to reclaim, the old tag (Relaxed, before the id's Release) to back off | readers: Relaxed after an id load (Acquire) at validation; Relaxed after the Acquire fence that ends an optimistic copy | with the id, the slot's identity: the id can be spelled by a newer object's payload over the freed header, the keyed tag cannot |
//! | `SlotHeader::refs` | writer (Release) on put / get_cached | readers (Acquire) before acknowledging | a reader acknowledges only while `reads < refs` |
//! | `reads[i]` | reader `i` only (Release fetch_update: its guards may drop on several threads), while it holds the slot; in aggregate mode `reads[0]` by every reader (Release fetch_add) | writer (Acquire) before reclaiming | the reader's reads of the payload happen before the writer's reuse |
//! | `holds[i]` (generation and count in one word) | reader `i`: +1 (Relaxed CAS) only under its validated hazard, −1 (Release RMW) when a guard or view goes; writer: 0 at publish (no live holder exists then) | writer (Acquire) after the hazard scan | a count of reader `i`'s current generation keeps the slot; another generation's word is a dead holder's leftover |
//! | `SlotHeader::key_fp` | writer (Relaxed, before the id's Release publish) | readers (Relaxed, under their hold or between two equal id loads) | part of the published object: a lookup by key checks it (v8) |
//! | `SlotHeader::touched` | readers (Relaxed) on a hit by key (`get_key`, `lease_key`: under the hold being taken; `lookup`: under its validated hazard, no hold), always before the hazard's Release clear; writer 0 at publish, swaps to 0 (Relaxed) in its sweep | writer | a hint for second-chance eviction; orders nothing. The hazard (Dekker pair above) keeps the slot from reuse while the mark is written, so it never lands on a newer object's slot: a writer that reuses the slot saw the hazard cleared (Release, after the mark), and its publish's 0 comes later in the word's order |
//! | the key index | see [`index`] | | seqlock over entries checked against their slots |
//! | `SegmentHeader::backed` | writer (Release), after the pages below it exist; it only grows | readers (Acquire) before touching a slot or payload past what they saw before: each `StoreReader` keeps the largest value it loaded and checks against that first | a reader touches only backed pages: its own earlier Acquire load of a value at least this large already ordered their allocation before its reads (C++20: happens-before is transitive through program order; AArch64: the `ldar` came first in the same thread) |
//! | `ReaderEntry::hazard` | reader (Release + SeqCst fence to set, Release to clear) | writer (Acquire, after its SeqCst fence) | Dekker through two SeqCst fences: one side sees the other; held only while a hold is taken. Every store to the word is Release, so whichever one the writer's load reads (a clear, or a later get's hazard), every hold taken before it is visible |
//! | `ReaderEntry::state` (generation and state in one word) | its holder (SeqCst CAS to attach, store to leave), writer marks a dead holder `LEFT` (SeqCst CAS of the whole word) | writer (SeqCst, after its fence); its holder on every get | a reader attaching while the writer reclaims is seen by one side; the CAS of the whole word fails if the entry was re-attached since it was read |
//!
//! Reclaiming slot S (writer): check every counted reader's `reads[i] >= refs`
//! (Acquire); store `id = 0` then a SeqCst fence; then, for every reader not
//! `LEFT`, load its hazard (Acquire) and its hold word in S (Acquire). A
//! hazard equal to the old id, or a hold count of the reader's current
//! generation, means a guard may be reading: store the old id back and stop.
//! (The scan a put makes loads the hazard and the hold word first and the
//! state word only when one of them may keep the slot: the state discards
//! leftovers of an ended attachment, which it may do as well after as
//! before, see `Judge::held_by_any`.)
//!
//! Taking a hold (reader `get`): store the id in the hazard word, then a
//! SeqCst fence, then load `id` (Acquire); a mismatch clears the hazard and
//! reports `Stale`. On a match, add one to `holds[i]` in S, then clear the
//! hazard (Release). The two SeqCst fences are ordered one way or the
//! other: if the reader's comes first, the writer's hazard load sees the
//! hazard, its Release clear, or a later get's Release hazard store, after
//! each of which the hold is visible to the writer's hold load (Acquire); if the writer's comes first, the reader's
//! load sees 0 (it backs off). A held slot is never reused, and a hold is
//! written only into a slot the hazard keeps valid, never into bytes that
//! became another object's payload. The writer's cost per reclaimed slot is
//! two loads per reader, whatever the number of holds. (Fences rather than
//! SeqCst accesses: the same cost on x86, and loom can check them; see
//! `loom_tests`.)
//!
//! Copying out without a hazard (`get_copy`): load `id` (Acquire) and the
//! tag, copy with [`copy_racy`] (relaxed byte-wise atomic loads, never a
//! racing plain read), Acquire fence, load `id` and the tag again; a change
//! of either means the slot was reused under the copy, which is then thrown
//! away (`Stale`): a torn read is never returned. This is crossbeam's
//! seqlock read, with one difference: the words re-checked may lie inside
//! the next object's payload (a newer object that starts before the freed
//! slot covers its header), so the id word may read as the old id again,
//! from payload bytes. Reclaiming zeroes the tag with the id before the
//! SeqCst fence, and every later write to the slot's bytes follows that
//! fence (and `begin_write`'s Release fence): a copy that saw any of them
//! synchronizes, through the reader's Acquire fence, with the zeroing, so
//! its re-check reads 0 or a later write at the tag, never the old tag
//! from before. A later write equal to the old tag is a payload that spells
//! a tag keyed by the segment's secret ([`crate::layout::keyed_slot_tag`]):
//! a 2^-64 accident, or a party that maps the segment and could write any
//! bytes it likes. (`validate` re-checks the same two words, after the
//! same fence.)

mod header;
mod index;
#[cfg(all(test, pinshm_loom))]
mod loom_tests;
mod reader;
mod slot;
pub(crate) mod word;

pub(crate) use header::HeaderPtr;
pub(crate) use index::IndexPtr;
pub(crate) use reader::ReaderPtr;
pub(crate) use slot::{SlotMeta, SlotPtr};

/// The atomic of type `A` at byte `off` from `base`, for the pointer types
/// below (the one place shared memory is turned into atomics).
///
/// # Safety
/// `base + off` is aligned for `A`, lies with `size_of::<A>()` bytes inside a
/// live mapping, and that mapping outlives `'a`.
#[inline]
pub(crate) unsafe fn field<'a, A: word::Word>(base: *mut u8, off: usize) -> &'a A {
    // SAFETY: the caller's contract, which is `Word::at`'s.
    unsafe { A::at(base.add(off)) }
}

// Every segment (store or channel) begins with `layout::Preamble`: its
// magic, stamped last, then its version and reader count. One way to write,
// stamp and read back a header, for both.

/// Writes a fresh header whole, with its magic (the first 8 bytes) zero;
/// [`stamp`] sets the magic last.
///
/// # Safety
/// `base` is page aligned, `size_of::<H>()` writable bytes from it are
/// mapped, and no other process trusts them yet (the magic is not stamped).
pub(crate) unsafe fn init_header<H: bytemuck::Pod>(base: *mut u8, header: &H) {
    let mut h = *header;
    bytemuck::bytes_of_mut(&mut h)[..8].fill(0);
    // SAFETY: the caller's contract: aligned, mapped, not yet shared.
    unsafe { std::ptr::write_volatile(base as *mut H, h) };
}

/// Stamps `magic` at `base` (Release): an opener that sees it (Acquire,
/// [`stamped_magic`]) sees the header [`init_header`] wrote.
///
/// # Safety
/// `base` is 8-aligned and 8 bytes from it are mapped.
pub(crate) unsafe fn stamp(base: *mut u8, magic: u64) {
    // SAFETY: the caller's contract; the magic is the u64 at offset 0.
    let w: &word::AtomicU64 = unsafe { field(base, 0) };
    w.store(magic, word::Ordering::Release);
}

/// The magic at `base` (Acquire: pairs with [`stamp`]).
///
/// # Safety
/// `base` is 8-aligned and 8 bytes from it are mapped.
pub(crate) unsafe fn stamped_magic(base: *mut u8) -> u64 {
    // SAFETY: as `stamp`.
    let w: &word::AtomicU64 = unsafe { field(base, 0) };
    w.load(word::Ordering::Acquire)
}

/// A copy of the whole header at `base`, for validation (its live words
/// may be mid-update; callers trust only the fields nobody writes after the
/// stamp, and check them first).
///
/// # Safety
/// `base` is aligned for `H` and `size_of::<H>()` bytes from it are mapped.
pub(crate) unsafe fn read_header<H: bytemuck::Pod>(base: *mut u8) -> H {
    // SAFETY: the caller's contract; `H` is Pod, so any bytes are a valid
    // value.
    unsafe { std::ptr::read_volatile(base as *const H) }
}

/// Copies `len` bytes that a writer may be overwriting at the same time
/// (the optimistic half of a seqlock read) as relaxed byte-wise atomic
/// loads (RFC 3301's "atomic memcpy"), never as a plain read the compiler
/// may assume stable. The caller re-checks the slot's id and tag after an
/// Acquire fence ([`SlotPtr::identity_recheck`]) and discards the bytes if
/// the slot was reused meanwhile.
///
/// Honest limits: the writer's side is plain writes (a `&mut [u8]` handed
/// to a `put_with` closure), so when writer and reader are threads of one
/// process this is still a mixed atomic/non-atomic race in Rust's model;
/// RFC 3301 wants both sides atomic. What this buys is that the reading
/// side holds no reference to racing bytes and the compiler cannot move or
/// elide the copy; across processes (the intended use) the model has no
/// say, and the hardware's is the seqlock's.
///
/// On x86-64 this is one `rep movsb`, opaque to the compiler, which copies
/// at memcpy speed (measured: within a few per cent of memcpy from 4 KiB to
/// 64 MiB); elsewhere, relaxed 8-byte atomic loads.
///
/// # Safety
/// 1. `src..src+len` is mapped and readable for the whole call (another
///    process may write it).
/// 2. `dst..dst+len` is valid for writes, and nothing else reads or writes
///    it during the call.
pub(crate) unsafe fn copy_racy(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller's contract; the block reads exactly src..src+len
    // and writes exactly dst..dst+len, touches no stack, and leaves the
    // direction flag clear as the ABI requires (it was clear on entry).
    unsafe {
        std::arch::asm!(
            "rep movsb",
            inout("rcx") len => _,
            inout("rsi") src => _,
            inout("rdi") dst => _,
            options(nostack, preserves_flags)
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
        let mut i = 0;
        while i < len && (src as usize + i) % 8 != 0 {
            // SAFETY: i < len: inside both ranges (caller's contract); an
            // AtomicU8 has no alignment requirement.
            unsafe { *dst.add(i) = (*(src.add(i) as *const AtomicU8)).load(Ordering::Relaxed) };
            i += 1;
        }
        while i + 8 <= len {
            // SAFETY: src + i is 8-aligned here and 8 bytes lie inside both
            // ranges; dst may be unaligned, hence write_unaligned.
            unsafe {
                let w = (*(src.add(i) as *const AtomicU64)).load(Ordering::Relaxed);
                std::ptr::write_unaligned(dst.add(i) as *mut u64, w);
            }
            i += 8;
        }
        while i < len {
            // SAFETY: as the first loop.
            unsafe { *dst.add(i) = (*(src.add(i) as *const AtomicU8)).load(Ordering::Relaxed) };
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "inline assembly")]
    fn racy_copy_copies_every_length_and_offset() {
        let src: Vec<u8> = (0..300u32).map(|i| (i * 7 + 3) as u8).collect();
        for off in 0..9 {
            for len in [0, 1, 7, 8, 9, 63, 64, 65, 200] {
                let mut dst = vec![0u8; len + 3];
                // SAFETY: off + len <= 209 < 300; dst has len + 3 bytes.
                unsafe { copy_racy(src.as_ptr().add(off), dst.as_mut_ptr().add(1), len) };
                assert_eq!(&dst[1..1 + len], &src[off..off + len]);
                assert_eq!((dst[0], dst[len + 1]), (0, 0), "nothing outside");
            }
        }
    }

    /// The slot protocol on heap memory, for Miri: pointer casts, alignment
    /// and the races between a guard and a reclaim.
    #[test]
    fn slot_protocol_on_heap_memory() {
        #[repr(C, align(64))]
        struct Mem([u64; 80]);
        #[derive(Clone, Copy)]
        struct P(*mut u8);
        // SAFETY: the pointees are boxes that outlive the thread.
        unsafe impl Send for P {}
        let mut slot_mem = Box::new(Mem([0; 80]));
        let mut reader_mem = Box::new(Mem([0; 80]));
        let (sp, rp) = (
            P(slot_mem.0.as_mut_ptr().cast()),
            P(reader_mem.0.as_mut_ptr().cast()),
        );
        // SAFETY: 640 bytes, 64-aligned: room for a slot prefix of 2 readers
        // and for a whole reader entry (64 bytes).
        let slot = unsafe { SlotPtr::new(sp.0, 2) };
        slot.begin_write();
        slot.publish(
            7,
            99,
            10,
            192,
            0,
            SlotMeta {
                refs: 1,
                key_fp: [0, 0],
            },
        );
        assert_eq!(slot.id_acquire(), 7);
        assert_eq!(slot.meta(), (99, 10, 0));
        assert!(slot.acknowledge(0));
        assert!(!slot.acknowledge(0), "one reference, one read");
        assert_eq!(slot.reads_acquire(0), 1);
        assert_eq!(slot.reads_acquire(1), 0);
        let reader = std::thread::spawn(move || {
            // SAFETY: as above; the boxes outlive the thread (joined below).
            let (slot, me) = unsafe { (SlotPtr::new({ sp }.0, 2), ReaderPtr::new({ rp }.0)) };
            me.set_hazard(7);
            let ok = slot.id_acquire() == 7;
            if ok {
                slot.hold(1, 5);
                me.clear_hazard();
                assert_eq!(slot.meta().1, 10);
                slot.unhold(1);
            } else {
                me.clear_hazard();
            }
            ok
        });
        // SAFETY: as above.
        let me = unsafe { ReaderPtr::new(rp.0) };
        let tag = slot.invalidate();
        if me.has_hazard_on(7) || slot.held_by(1, 5) {
            slot.restore(7, tag);
        }
        let _ = reader.join().unwrap();
        assert!(!slot.held_by(1, 5), "every hold was given back");
        slot.hold(0, 3);
        slot.hold(0, 3);
        assert_eq!(slot.holds_relaxed(0, 3), 2);
        assert!(
            !slot.held_by(0, 4),
            "another generation's word holds nothing"
        );
        slot.hold(0, 4);
        assert_eq!(
            slot.holds_relaxed(0, 4),
            1,
            "a dead holder's word is replaced"
        );
        slot.unhold(0);
        slot.unhold(0);
        assert_eq!(slot.holds_relaxed(0, 4), 0, "never below zero");
        slot.set_refs(2);
        assert!(slot.acknowledge(1));
        assert_eq!(slot.snapshot().refs, 2);
        drop((slot_mem, reader_mem));
    }
}
