//! One reader of a store: [`StoreReader`].

use std::cell::Cell;
use std::marker::PhantomData;

use super::attached::Attached;
use super::config::ReaderOptions;
use super::guard::{PrivateView, ReadGuard};
use super::handle::{ObjectHandle, StoreHandle};
use super::lease::Lease;
use super::mapping::Mapping;
use super::share::Share;
use super::signature;
use crate::atomics::{copy_racy, SlotPtr};
use crate::error::{Error, Result};
use crate::geometry::{validate_store, StoreGeometry};
use crate::layout::{self, reader_state, ObjectKind};
use crate::pin::Pinning;

use crate::sys::clock;
use crate::sys::fork;
use crate::sys::liveness;
use crate::sys::segment::Segment;

/// Shares of its attachment a reader prepays at once for its guards and
/// leases: a get takes one with no atomic, and one add in this many pays.
const SHARES_PREPAID: usize = 64;

mod checks;
use checks::Valid;

/// Opens and validates a segment against the expectations of a handle.
fn open_validated(sh: &StoreHandle, prefault: bool) -> Result<(Segment, StoreGeometry)> {
    let seg = Segment::open(&sh.name, prefault)?;
    let geo = validate_store(&seg, &sh.name)?;
    let bad = |field, want: u64, got: u64| Error::BadHeader {
        name: sh.name.clone(),
        field,
        detail: format!("the handle says {want}, the segment says {got}"),
    };
    if sh.layout_version != layout::LAYOUT_VERSION {
        return Err(bad(
            "layout_version",
            layout::LAYOUT_VERSION as u64,
            sh.layout_version as u64,
        ));
    }
    let nonce = geo.header().read().nonce;
    if nonce != sh.nonce {
        return Err(Error::SegmentMismatch {
            name: sh.name.clone(),
            expected: sh.nonce,
            found: nonce,
        });
    }
    if geo.capacity != sh.capacity {
        return Err(bad("capacity", sh.capacity, geo.capacity));
    }
    if geo.n_readers != sh.n_readers {
        return Err(bad("n_readers", sh.n_readers as u64, geo.n_readers as u64));
    }
    if geo.max_object_size != sh.max_object_size {
        return Err(bad(
            "max_object_size",
            sh.max_object_size,
            geo.max_object_size,
        ));
    }
    Ok((seg, geo))
}

/// One reader of a store, attached into a reader slot until it and every
/// guard it gave out are dropped.
///
/// A `StoreReader` is `Send` but not `Sync`: one per thread (each thread of
/// a process attaches its own, as each takes one of `n_readers` slots; its
/// one hazard word serialises its gets). Its guards are `Send` and `Sync`.
#[derive(Debug)]
pub struct StoreReader {
    /// The attachment, shared with every guard.
    at: Share<Attached>,
    /// Shares of `at` prepaid for guards and leases to come (one atomic
    /// add for [`SHARES_PREPAID`] of them), given back when the reader goes.
    spare: Cell<usize>,
    /// The segment's signing secret, copied at attach.
    secret: [u8; 32],
    /// The key of its slot tags ([`layout::tag_key`] of `secret`).
    tag_key: u64,
    /// The key of its key fingerprints, derived once at attach.
    fp_key: layout::FingerprintKey,
    /// A lower bound of the header's `backed` (which only grows): checks
    /// against it need no load of the shared word, a line the writer
    /// dirties; a check that fails it loads the word again.
    backed_seen: Cell<u64>,
    /// Not `Sync`: a get publishes the reader's one hazard word.
    _one_thread: PhantomData<Cell<()>>,
}

impl StoreReader {
    /// Attaches into the first free reader slot (pinning: `PinMode::Auto`).
    pub fn attach(sh: &StoreHandle) -> Result<StoreReader> {
        Self::attach_with(sh, ReaderOptions::default())
    }

    /// Attaches to segment `name` knowing nothing else (as vLLM's workers,
    /// which know the name and size only): the geometry comes from the
    /// segment's validated header.
    pub fn attach_by_name(name: &str) -> Result<StoreReader> {
        Self::attach(&StoreHandle::of(name)?)
    }

    /// Attaches as reader `index` (a tensor-parallel rank, say).
    pub fn attach_as(sh: &StoreHandle, index: u32) -> Result<StoreReader> {
        Self::attach_with(sh, ReaderOptions::default().index(index))
    }

    /// Attaches with explicit options.
    pub fn attach_with(sh: &StoreHandle, opts: ReaderOptions) -> Result<StoreReader> {
        let fork_gen = fork::register();
        // Mapped without pre-faulting: a sparse segment (a writer's choice)
        // stays sparse, since faulting a hole of a shared file allocates it.
        let (seg, geo) = open_validated(sh, false)?;
        // Pinned before an entry is taken, so a failure gives nothing back.
        let reserved = seg.is_reserved();
        let prefault = opts.prefault && reserved;
        let map = Mapping::new(seg, opts.pin, reserved, prefault, opts.read_only_views)?;
        let (index, word, counted_from) = match opts.index {
            Some(index) => {
                if index >= geo.n_readers {
                    return Err(Error::ReaderIndexOutOfRange {
                        index,
                        n_readers: geo.n_readers,
                    });
                }
                if !map.seg().try_lock(liveness::reader_slot(index))? {
                    return Err(Error::ReaderSlotTaken {
                        index,
                        pid: geo.reader(index).pid(),
                    });
                }
                let (word, from) = claim(&geo, index);
                (index, word, from)
            }
            None => {
                let mut found = None;
                for i in 0..geo.n_readers {
                    if map.seg().try_lock(liveness::reader_slot(i))? {
                        let (word, from) = claim(&geo, i);
                        found = Some((i, word, from));
                        break;
                    }
                }
                found.ok_or(Error::NoReaderSlot {
                    n_readers: geo.n_readers,
                })?
            }
        };
        tracing::debug!(name = %sh.name, index, counted_from, pinned = map.is_pinned(), "reader attached");
        let secret = geo.header().read().secret;
        Ok(StoreReader {
            spare: Cell::new(0),
            at: Share::new(Attached {
                geo,
                index,
                me: geo.reader(index),
                counted_from,
                word,
                fork_gen,
                map,
            }),
            secret,
            tag_key: layout::tag_key(&secret),
            fp_key: layout::FingerprintKey::new(&secret),
            backed_seen: Cell::new(geo.header().backed()),
            _one_thread: PhantomData,
        })
    }

    /// This reader's index in the reader table.
    pub fn index(&self) -> u32 {
        self.at.index
    }

    /// The segment's name.
    pub fn name(&self) -> &str {
        self.at.map.seg().name()
    }

    /// The segment's current epoch, which every handle issued since the
    /// last hard clear carries (a handle known only by address and id, as
    /// vLLM sends them, is rebuilt with it). 0, which no epoch is, in a
    /// forked child: the reader is the parent's, and the child's copy of
    /// the mapping is inaccessible (`crate::sys::fork`).
    pub fn epoch(&self) -> u64 {
        if !self.at.is_owner() {
            return 0;
        }
        self.at.geo.header().epoch()
    }

    /// This process's mapping of the data region, as (address of its
    /// first byte, length in bytes = the capacity), for registering it
    /// once with a transfer library (NIXL) that reads payloads out of it.
    /// A handle's payload lies inside it, at the offset its guard's first
    /// byte has from the address. The address stays valid while this
    /// reader, or anything it made, lives; pages past what the writer has
    /// backed are not to be read (read only what a guard or lease holds).
    /// `Forked` in a forked child.
    pub fn data_region(&self) -> Result<(usize, u64)> {
        self.at.check_owner()?;
        Ok((self.at.geo.data() as usize, self.at.geo.capacity))
    }

    /// Whether this process's mapping is page-locked for DMA.
    pub fn is_pinned(&self) -> bool {
        self.at.map.is_pinned()
    }

    /// How this process's mapping was pinned (bytes, registration calls,
    /// time taken while attaching), if it was.
    pub fn pinning(&self) -> Option<Pinning> {
        self.at.map.pinning()
    }

    /// A zero-copy view of the object. Its read is acknowledged when the
    /// guard drops; until then the writer cannot reuse the slot. A reader
    /// may hold any number of guards, on one object or many, for as long
    /// as it likes: each is one count in the slot, and the writer allocates
    /// around held objects.
    #[inline(always)]
    pub fn get(&self, h: ObjectHandle) -> Result<ReadGuard> {
        let (
            slot,
            Valid {
                data, len, kind, ..
            },
        ) = self.hold(h)?;
        Ok(self.guard(h, slot, data, len, kind))
    }

    /// The object as this process's private, writable copy that copies
    /// nothing until written ([`ReadGuard::into_private`]): a tensor a
    /// consumer may change in place without changing what anyone else
    /// reads. Holds the slot, as a guard does, until dropped.
    pub fn get_private(&self, h: ObjectHandle) -> Result<PrivateView> {
        self.get(h)?.into_private()
    }

    /// The least work the read protocol needs, for the bench's floor row
    /// (not an API: hidden, and it reads nothing): on the slot `g` holds,
    /// set the hazard (and its SeqCst fence), load the id, take a hold,
    /// clear the hazard, then give the hold back. None of `get`'s checks
    /// (bounds, backed extent, tag, size, kind, fork, entry), no guard, no
    /// acknowledgement: what `get` costs above this is what they cost.
    /// False if `g` is another reader's (nothing done).
    #[doc(hidden)]
    pub fn read_protocol_floor(&self, g: &ReadGuard) -> bool {
        // A forked child's mapping is inaccessible: do nothing there.
        if !Share::ptr_eq(&g.reader, &self.at) || !self.at.is_owner() {
            return false;
        }
        let (slot, id) = (g.slot, g.handle.monotonic_id);
        // The protocol of crate::atomics, as `hold` runs it; `g`'s own hold
        // keeps the slot whatever this finds.
        self.at.me.set_hazard(id);
        let ok = slot.id_acquire() == id;
        if ok {
            slot.hold(self.at.index, self.at.generation());
        }
        self.at.me.clear_hazard();
        if ok {
            slot.unhold(self.at.index);
        }
        ok
    }

    /// Keeps the object from being reclaimed, without reading it, until
    /// the [`Lease`] is released or dropped: a hold with no view and no
    /// read to acknowledge (a scheduler keeping what it has promised to
    /// its workers). As a guard's hold, a dead leaseholder's leases count
    /// for nothing.
    #[inline]
    pub fn lease(&self, h: ObjectHandle) -> Result<Lease> {
        let (slot, _) = self.hold(h)?;
        Ok(Lease::new(self.share(), slot, h))
    }

    /// The handle of `key`'s object, from the store's shared key index
    /// ([`StoreConfig::key_index`](crate::StoreConfig::key_index)), without
    /// the writer. `None` if the key is not stored (or not indexed, or its
    /// object was just reclaimed). Never another key's object: the slot the
    /// index names is checked (id, tag, and the key's fingerprint). The
    /// handle is as good as one sent by the writer: a later `get` of it is
    /// `Stale` if the object goes meanwhile; [`StoreReader::get_key`] and
    /// [`StoreReader::lease_key`] look up and hold in one step.
    ///
    /// A hit counts as a hit by key, as `get_key`'s does: under
    /// [`Eviction::SecondChance`](crate::store::Eviction::SecondChance) the object
    /// stays one more lap of the writer's sweep (a lookup, then a `get` of
    /// the handle, as vLLM-style code does, keeps what it found).
    pub fn lookup(&self, key: &str) -> Result<Option<ObjectHandle>> {
        // Before the hazard word is written: in a forked child it is the
        // parent's.
        self.at.check_owner()?;
        let Some((h, fp)) = self.probe(key)? else {
            return Ok(None);
        };
        let Ok(slot) = self.find_slot(h) else {
            return Ok(None);
        };
        // Checked under the hazard, as a hold is taken (the hold protocol
        // of crate::atomics), so that the touch below lands on this
        // object: once the hazard validates, the slot cannot be reused
        // until it is cleared, and the key fingerprint read after the id
        // is the object's own. A hit from before a reuse fails the check
        // and gives the newer object nothing.
        self.at.me.set_hazard(h.monotonic_id);
        let hit = self.check_slot(h, &slot, slot.id_acquire()).is_ok() && slot.key_fp() == fp;
        let entry = self.at.check_entry();
        if hit && entry.is_ok() {
            slot.touch();
        }
        self.at.me.clear_hazard();
        entry?;
        Ok(hit.then_some(h))
    }

    /// A zero-copy view of `key`'s object, found through the shared key
    /// index and held in one step (`None`: a miss, as [`StoreReader::lookup`]).
    #[inline(always)]
    pub fn get_key(&self, key: &str) -> Result<Option<ReadGuard>> {
        Ok(self
            .hold_key(key)?
            .map(|(h, slot, v)| self.guard(h, slot, v.data, v.len, v.kind)))
    }

    /// A [`Lease`] on `key`'s object, found through the shared key index
    /// and held in one step (`None`: a miss, as [`StoreReader::lookup`]).
    #[inline(always)]
    pub fn lease_key(&self, key: &str) -> Result<Option<Lease>> {
        Ok(self
            .hold_key(key)?
            .map(|(h, slot, _)| Lease::new(self.share(), slot, h)))
    }

    #[inline(always)]
    fn guard(
        &self,
        h: ObjectHandle,
        slot: SlotPtr,
        data: *const u8,
        len: usize,
        kind: ObjectKind,
    ) -> ReadGuard {
        ReadGuard {
            reader: self.share(),
            slot,
            handle: h,
            data: self.at.map.view_of(data),
            len,
            kind,
        }
    }

    /// A share of the attachment for a guard or a lease: one of those
    /// prepaid, prepaying [`SHARES_PREPAID`] more when none is left.
    #[inline]
    fn share(&self) -> Share<Attached> {
        let spare = match self.spare.get() {
            0 => {
                self.at.prepay(SHARES_PREPAID);
                SHARES_PREPAID
            }
            n => n,
        };
        self.spare.set(spare - 1);
        // SAFETY: `spare` shares were prepaid and not handed out (the
        // reader is not `Sync`: nothing else takes them meanwhile); this is
        // one of them, no longer counted in `spare`.
        unsafe { self.at.prepaid() }
    }

    /// Takes a hold on `h` (the hold protocol of crate::atomics): the slot
    /// stays until the hold is given back.
    #[inline(always)]
    fn hold(&self, h: ObjectHandle) -> Result<(SlotPtr, Valid)> {
        // Before the hazard word is written: in a forked child it is the
        // parent's.
        if !self.at.is_owner() {
            return Err(self.at.forked());
        }
        let slot = match self.find_slot(h) {
            Ok(slot) => slot,
            Err(why) => return Err(self.stale(h, why)),
        };
        let pre = self.expect(h, &slot);
        self.at.me.set_hazard(h.monotonic_id);
        let checked = self.check_held(h, &slot, slot.id_acquire(), pre);
        let entry_ours = self.at.entry_is_ours();
        if let (Ok(v), true) = (&checked, entry_ours) {
            // The hazard keeps the slot valid under this write (the hold
            // protocol of crate::atomics); the hold keeps it once the
            // hazard is cleared.
            slot.hold(self.at.index, self.at.generation());
            self.at.me.clear_hazard();
            return Ok((slot, *v));
        }
        self.at.me.clear_hazard();
        Err(self.hold_failed(h, checked.err(), entry_ours))
    }

    /// Why a hold was not taken (off the hot path).
    #[cold]
    #[inline(never)]
    fn hold_failed(&self, h: ObjectHandle, why: Option<&'static str>, entry_ours: bool) -> Error {
        match why {
            Some(why) => self.stale(h, why),
            None => {
                debug_assert!(!entry_ours);
                self.at.entry_lost()
            }
        }
    }

    /// Looks `key` up in the shared key index and takes a hold on what it
    /// names, if that is `key`'s object. A miss counts no stale read.
    #[inline(always)]
    fn hold_key(&self, key: &str) -> Result<Option<(ObjectHandle, SlotPtr, Valid)>> {
        self.at.check_owner()?;
        let Some((h, fp)) = self.probe(key)? else {
            return Ok(None);
        };
        let Ok(slot) = self.find_slot(h) else {
            return Ok(None);
        };
        let pre = self.expect(h, &slot);
        self.at.me.set_hazard(h.monotonic_id);
        // Under the validated hazard the slot cannot be reused, so the key
        // fingerprint read after the id is the object's own.
        let checked = self
            .check_held(h, &slot, slot.id_acquire(), pre)
            .ok()
            .filter(|_| slot.key_fp() == fp);
        let entry = self.at.check_entry();
        if checked.is_some() && entry.is_ok() {
            slot.hold(self.at.index, self.at.generation());
            slot.touch();
        }
        self.at.me.clear_hazard();
        entry?;
        Ok(checked.map(|v| (h, slot, v)))
    }

    /// The index entry for `key`: a handle to check, and the key's
    /// fingerprint to check it with.
    #[inline(always)]
    fn probe(&self, key: &str) -> Result<Option<(ObjectHandle, [u64; 2])>> {
        let index = self.at.geo.index().ok_or_else(|| Error::NoKeyIndex {
            name: self.at.map.seg().name().to_owned(),
        })?;
        let fp = self.fp_key.fingerprint(key);
        Ok(super::key_index::probe(&index, fp).map(|(id, address)| {
            (
                ObjectHandle {
                    address,
                    monotonic_id: id,
                    epoch: self.at.geo.header().epoch(),
                },
                fp,
            )
        }))
    }

    /// An owned copy of the object; its read is acknowledged before return.
    ///
    /// The copy is optimistic (seqlock): if the writer reuses the slot while
    /// it is being copied, which it can only do when this reader owes no
    /// read of the object, the copy is discarded and `Stale` returned.
    pub fn get_copy(&self, h: ObjectHandle) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.get_copy_into(h, &mut out)?;
        Ok(out)
    }

    /// As [`StoreReader::get_copy`], into `out` (cleared first, its capacity
    /// reused): no allocation, and no page faults on a buffer used before.
    pub fn get_copy_into(&self, h: ObjectHandle, out: &mut Vec<u8>) -> Result<()> {
        let start = self.begin_copy(h)?;
        self.finish_copy(h, start, out)
    }

    /// The first half of an optimistic copy (seqlock begin): the slot and
    /// what its validation found. A half of its own so that a test can
    /// reuse the slot between the check and the copy, deterministically.
    fn begin_copy(&self, h: ObjectHandle) -> Result<CopyStart> {
        self.at.check_attached()?;
        let slot = self.slot(h)?;
        let valid = self.validate_slot(h, &slot, slot.id_acquire())?;
        Ok(CopyStart { slot, valid })
    }

    /// The second half: the copy, the check after it, the acknowledgement.
    fn finish_copy(&self, h: ObjectHandle, start: CopyStart, out: &mut Vec<u8>) -> Result<()> {
        let CopyStart { slot, valid } = start;
        let Valid { data, len, .. } = valid;
        out.clear();
        out.reserve(len);
        // SAFETY: `data..data+len` lies in the data region (validate checked
        // it against the process-local capacity), mapped while `self` lives,
        // and `out` has room for len bytes that nothing else touches. The
        // writer may be rewriting the source (only if this read is not
        // counted): copy_racy reads it as atomics, and such a copy is
        // detected below and discarded.
        unsafe { copy_racy(data, out.as_mut_ptr(), len) };
        // Id and tag, not the id alone: a newer object's payload over the
        // freed header can spell the old id (see SlotPtr::identity_recheck).
        if slot.identity_recheck() != (h.monotonic_id, valid.tag) {
            return Err(self.stale(h, "slot reused during the copy"));
        }
        // SAFETY: the first len bytes were initialised by the copy.
        unsafe { out.set_len(len) };
        // The bytes are whole; if the slot has gone since, there is nothing
        // left to acknowledge.
        let _ = self.ack_read(h);
        Ok(())
    }

    /// Acknowledges one read of `h` without reading it (what dropping a
    /// guard of it does).
    pub fn acknowledge(&self, h: ObjectHandle) -> Result<()> {
        self.ack_read(h)
    }

    /// Checks that `h` names a live object of this segment (id, epoch,
    /// slot tag), acknowledging nothing (vLLM 0.33's reader `touch`).
    pub fn validate(&self, h: ObjectHandle) -> Result<()> {
        self.at.check_attached()?;
        let slot = self.slot(h)?;
        let valid = self.validate_slot(h, &slot, slot.id_acquire())?;
        // The tag and size were read after a load of the id: if the slot
        // changed meanwhile, they may not be the handle's. As after a copy,
        // the id and the tag must both be the ones checked.
        if slot.identity_recheck() != (h.monotonic_id, valid.tag) {
            return Err(self.stale(h, "slot reused during the check"));
        }
        Ok(())
    }

    /// Whether `signature` signs `key` at `h` with this segment's secret
    /// (see [`ObjectStore::signature`](crate::ObjectStore::signature)).
    pub fn verify(&self, key: &str, h: ObjectHandle, signature: &[u8]) -> bool {
        signature::verify(&self.secret, key, h.address, h.monotonic_id, signature)
    }

    // ---- internals ----

    #[cold]
    #[inline(never)]
    fn stale(&self, h: ObjectHandle, why: &'static str) -> Error {
        tracing::debug!(
            reader = self.at.index,
            address = h.address,
            id = h.monotonic_id,
            why,
            "stale read"
        );
        self.at.me.count_stale();
        // A stale handle from a writer that is gone will never become good:
        // say so (checked only on this error path).
        if let Err(gone) = self.check_writer() {
            return gone;
        }
        Error::Stale {
            address: h.address,
            monotonic_id: h.monotonic_id,
        }
    }

    /// The segment's reader table as the writer's reclaim counts it: the
    /// `(entry index, pid)` of every entry attached by a process that still
    /// runs (its entry's lock held), this reader's own included, in index
    /// order. For a coordinator (vLLM's encoder-cache scheduler) that waits
    /// until its workers read a segment; a snapshot, stale when it returns.
    pub fn live_readers(&self) -> Result<Vec<(u32, u32)>> {
        self.at.check_owner()?;
        let seg = self.at.map.seg();
        Ok((0..self.at.geo.n_readers)
            .filter_map(|i| {
                let r = self.at.geo.reader(i);
                let attached = r.state() == reader_state::ATTACHED;
                let live = i == self.at.index || seg.held_by_other(liveness::reader_slot(i));
                (attached && live).then(|| (i, r.pid()))
            })
            .collect())
    }

    /// Whether the writer that created this segment still runs: it has not
    /// closed the store, and the kernel reports its writer lock held (a
    /// check that cannot decide counts as alive). False in a forked child,
    /// which cannot tell (the reader is the parent's: attach anew).
    pub fn writer_alive(&self) -> bool {
        self.at.is_owner()
            && self.at.geo.header().writer_pid() != 0
            && self.at.map.seg().held_by_other(liveness::WRITER_SLOT)
    }

    /// `Err(WriterGone)` if the writer has exited or died. Objects already
    /// published stay readable; nothing new will come.
    pub fn check_writer(&self) -> Result<()> {
        self.at.check_owner()?;
        if self.writer_alive() {
            Ok(())
        } else {
            Err(Error::WriterGone {
                name: self.at.map.seg().name().to_owned(),
            })
        }
    }

    /// Counts one read of `h`, under the hazard so the slot cannot be
    /// reused while the counter is written.
    fn ack_read(&self, h: ObjectHandle) -> Result<()> {
        self.at.check_attached()?;
        let slot = self.slot(h)?;
        self.at.me.set_hazard(h.monotonic_id);
        let r = self
            .validate_slot(h, &slot, slot.id_acquire())
            .map(|_| self.at.ack_held(&slot, h));
        self.at.me.clear_hazard();
        r
    }
}

impl Drop for StoreReader {
    fn drop(&mut self) {
        // SAFETY: `spare` shares were prepaid and never handed out.
        unsafe { self.at.unprepay(self.spare.get()) };
        // `at`, our own share, goes next; the attachment with the last
        // share (this reader's or a guard's).
    }
}

/// What [`StoreReader::begin_copy`] validated, and in which slot.
struct CopyStart {
    slot: SlotPtr,
    valid: Valid,
}

/// Takes reader entry `i`, whose lock the caller holds: no live reader can
/// have it. Returns our state word and the first id we are counted for.
fn claim(geo: &StoreGeometry, i: u32) -> (u64, u64) {
    use reader_state::{next_generation, state, word, ATTACHED, ATTACHING, VACANT};
    let r = geo.reader(i);
    loop {
        let w = r.word();
        let next = next_generation(w);
        if state(w) == VACANT {
            // Never attached: counted from the start, since the writer has
            // been waiting for it.
            if r.transition(w, word(next, ATTACHED)) {
                r.set_attached_ns(clock::monotonic_ns());
                r.set_pid(std::process::id());
                return (word(next, ATTACHED), 0);
            }
        } else if r.transition(w, word(next, ATTACHING)) {
            // Left, dead, or corrupt: not counted while attaching; counted
            // from the next put so nothing of the last holder is inherited.
            r.clear_hazard();
            let from = geo.header().next_id();
            r.set_counted_from(from);
            r.set_attached_ns(clock::monotonic_ns());
            r.set_pid(std::process::id());
            r.set_word(word(next, ATTACHED));
            return (word(next, ATTACHED), from);
        }
        // The writer marked the dead last holder left meanwhile: again.
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Unlink;
    use crate::{ObjectStore, StoreConfig};

    /// The slot is freed and reused between the check
    /// at the start of a copy and the copy itself, by a newer object whose
    /// payload covers the old header and spells the old id, size, kind and
    /// unkeyed tag there. The check after the copy must refuse it.
    #[test]
    fn a_copy_of_a_slot_reused_under_a_forged_header_is_stale() {
        let name = format!("pinshm-unit-forgedcopy-{}", std::process::id());
        let _unlink = Unlink(name.clone());
        let capacity = 64 * 1024;
        let slot = |len| layout::slot_len(1, len);
        let mut w =
            ObjectStore::create(StoreConfig::new(capacity, capacity / 2, 1).name(&name)).unwrap();
        let r = StoreReader::attach(&w.handle()).unwrap();
        let p = w.put("p", &[1; 64]).unwrap();
        let a = w.put("a", &[2; 256]).unwrap();
        assert_eq!(a.address, p.address + slot(64) as u64);
        let used = slot(64) + slot(256);
        // The rest of the ring but a tail too short for b, unread.
        w.put("f0", &vec![3; capacity / 2]).unwrap();
        w.put("f1", &vec![3; capacity / 2 - used - 2 * slot(0) - 64])
            .unwrap();
        r.acknowledge(p).unwrap();
        r.acknowledge(a).unwrap();
        // The check passes: a is whole and in place.
        let start = r.begin_copy(a).unwrap();
        // Now b reuses p's and a's place, spelling a's header at a's address.
        let tag = layout::slot_tag(a.monotonic_id, a.address, a.epoch, 256, 0);
        let mut bytes = vec![4u8; used - slot(0)];
        let off = (a.address - p.address) as usize - slot(0);
        for (i, word) in [a.monotonic_id, tag, 256, slot(256) as u64, 1]
            .into_iter()
            .enumerate()
        {
            bytes[off + 8 * i..off + 8 * i + 8].copy_from_slice(&word.to_le_bytes());
        }
        let b = w.put("b", &bytes).unwrap();
        assert_eq!(b.address, p.address, "b took p's and a's place");
        let mut out = Vec::new();
        match r.finish_copy(a, start, &mut out) {
            Err(Error::Stale { .. }) => {}
            other => panic!(
                "a copy of b's bytes passed for a: {other:?}, {} bytes",
                out.len()
            ),
        }
    }
}
