//! The one writer of a store: [`ObjectStore`].

use std::sync::Arc;

use super::config::StoreConfig;
use super::handle::{ObjectHandle, StoreHandle};
use super::stats::StoreStats;
use crate::error::{Error, Result};
use crate::geometry::{validate_store_bytes, StoreGeometry};
use crate::layout::{self, ObjectKind, SegmentHeader};
use crate::pin::Pinning;
use crate::ring::{Plan, Ring};

use super::ahead::Ahead;
use super::key_index::SharedIndex;
use super::keys::{Entry, Keys, PendingCopy};
use super::reclaim::{NoRoom, Space};
use crate::atomics::{SlotMeta, SlotPtr};
use crate::sys::fork;
use crate::sys::liveness;
use crate::sys::segment::{self, Backing, Segment};

use super::mapping::Mapping;
use super::signature::{self, Signature};

pub(super) fn next_epoch(e: u64) -> u64 {
    layout::slot_tag(e, 0x5eed, e, 0, 0).max(1)
}

/// A slot handed out by the ring, not yet published.
pub(super) struct Reserved {
    plan: Plan,
    slot_len: u64,
    pub(super) payload: *mut u8,
}

/// The one writer of a store. Creates the segment and unlinks it on drop.
///
/// ```
/// use pinshm::{ObjectStore, StoreConfig, StoreReader};
/// let mut store = ObjectStore::create(StoreConfig::new(1 << 20, 1 << 16, 1))?;
/// let h = store.put("greeting", b"hello")?;
/// let reader = StoreReader::attach(&store.handle())?;
/// assert_eq!(&*reader.get(h)?, b"hello");
/// # Ok::<(), pinshm::Error>(())
/// ```
#[derive(Debug)]
pub struct ObjectStore {
    /// The data region: its bounds, the allocator, what may be reclaimed
    /// (`reclaim.rs`).
    pub(super) space: Space,
    /// Every stored key, and those whose put is still in flight.
    pub(super) keys: Keys,
    pub(super) next_id: u64,
    pub(super) epoch: u64,
    nonce: u64,
    pub(super) stats: StoreStats,
    /// The key of handle signatures (also in the segment, for readers).
    secret: [u8; 32],
    /// The key of slot tags, from `secret` ([`layout::tag_key`]).
    tag_key: u64,
    /// The fork generation this store was made in (see `sys::fork`): in a
    /// forked child it changes nothing shared.
    fork_gen: u64,
    /// The segment (its writer lock held through it), shared with copies
    /// in flight: unmapped when the last of them is done.
    map: Arc<Mapping>,
}

// SAFETY: the raw pointers in `geo` point into the mapping `map` keeps
// alive, which moves with the store; the writer is used from one thread at
// a time (&mut self).
unsafe impl Send for ObjectStore {}

impl ObjectStore {
    /// Creates the segment (exclusively) and an empty store in it.
    pub fn create(cfg: StoreConfig) -> Result<ObjectStore> {
        cfg.validate()?;
        let fork_gen = fork::register();
        let name = cfg.name.clone().unwrap_or_else(segment::unique_name);
        let header_len = layout::header_len(cfg.n_readers);
        let index_entries = cfg.index_entries();
        let total = header_len
            .checked_add(cfg.capacity)
            .and_then(|t| t.checked_add(layout::index_len(index_entries) as usize))
            .ok_or_else(|| Error::InvalidConfig(format!("capacity {} overflows", cfg.capacity)))?;
        crate::sys::check_segment_size(total as u64, &format!("capacity {}", cfg.capacity))?;
        // No overflow: below `total`.
        let index_at = layout::index_offset(cfg.n_readers, cfg.capacity as u64);
        // Not pre-faulted twice: a segment that will be pinned is faulted
        // in by the registration (Mapping::new pre-faults it otherwise).
        // Only a reserved segment is pre-faulted: faulting a hole of a
        // sparse one would allocate it (and, past /dev/shm's size, fault).
        let want_prefault = cfg.prefault && cfg.reserve;
        let prefault = super::mapping::prefault_at_map(want_prefault, cfg.pin);
        // A writer that died leaves its segment: replaced, unless its
        // writer still runs.
        let seg = Segment::create_replacing(
            &name,
            total,
            prefault,
            cfg.reserve,
            cfg.name.is_some(),
            |old| {
                old.read(0, size_of::<SegmentHeader>())
                    .and_then(|bytes| validate_store_bytes(&bytes, old.len(), &name))
                    .map(|h| format!(" (pid {})", h.writer_pid))
                    .map_err(|e| format!("a usable pinshm segment ({e})"))
            },
        )?;
        // A sparse segment's header is backed before it is written (an
        // error here, never SIGBUS).
        let mut backing = Backing::prefix(total as u64, cfg.reserve);
        backing.ensure(&seg, 0, header_len as u64)?;
        // So is its key index, whole (readers probe any entry of it).
        if !cfg.reserve {
            seg.back(index_at, layout::index_len(index_entries))?;
        }
        // The headroom is for the data: a store always gets its header.
        let backing = backing.headroom(cfg.shm_headroom);
        // The lock before the stamp: whoever sees the magic sees a writer
        // whose death the kernel will report.
        if !seg.try_lock(liveness::WRITER_SLOT)? {
            return Err(Error::InUse {
                name: name.clone(),
                detail: "another process holds its writer lock".into(),
            });
        }
        let flags = if cfg.aggregate_reads {
            layout::flags::AGGREGATE_READS
        } else {
            0
        } | if cfg.cache { layout::flags::CACHE } else { 0 };
        let geo = StoreGeometry::new(
            seg.as_ptr(),
            cfg.n_readers,
            cfg.capacity as u64,
            cfg.max_object_size as u64,
            flags,
            index_entries,
        );
        let secret = signature::new_secret()?;
        let nonce = segment::random_u64();
        let epoch = next_epoch(nonce);
        let header = SegmentHeader {
            magic: layout::MAGIC,
            layout_version: layout::LAYOUT_VERSION,
            n_readers: cfg.n_readers,
            header_len: header_len as u64,
            capacity: cfg.capacity as u64,
            max_object_size: cfg.max_object_size as u64,
            nonce,
            slot_prefix_len: layout::slot_prefix_len(cfg.n_readers) as u32,
            reserved1: 0,
            reader_entry_len: size_of::<layout::ReaderEntry>() as u32,
            writer_pid: std::process::id(),
            reserved0: 0,
            epoch,
            next_id: 1,
            cursor: 0,
            high_water: 0,
            cleared_below: 0,
            flags,
            secret,
            backed: backing.backed().saturating_sub(header_len as u64),
            index_entries,
            index_seq: 0,
            reserved: [0; 10],
        };
        // The reader table is zero (VACANT) in a fresh object; stamp last.
        geo.header().init(&header);
        geo.header().stamp();
        // The writer knows whether it reserved the pages.
        let reserved = cfg.reserve;
        let map = Mapping::new(seg, cfg.pin, reserved, want_prefault && !prefault, false)?;
        tracing::debug!(name = %name, capacity = cfg.capacity, n_readers = cfg.n_readers, "store created");
        let mut space = Space::new(
            geo,
            Ring::new(cfg.capacity as u64),
            backing,
            cfg.eviction,
            cfg.reader_timeout.map(|d| d.as_nanos() as u64),
        );
        if !cfg.reserve && cfg.back_ahead > 0 {
            space.ahead = Ahead::start(
                &map,
                space.backing.backed(),
                header_len as u64,
                (header_len + cfg.capacity) as u64,
                cfg.back_ahead,
                cfg.shm_headroom,
            );
        }
        Ok(ObjectStore {
            space,
            keys: Keys {
                shared: geo.index().map(SharedIndex::new),
                ..Keys::default()
            },
            next_id: 1,
            epoch,
            nonce,
            stats: StoreStats::default(),
            secret,
            tag_key: layout::tag_key(&secret),
            fork_gen,
            map,
        })
    }

    /// Stores `bytes` under `key`: one reference, one expected read per reader.
    pub fn put(&mut self, key: &str, bytes: &[u8]) -> Result<ObjectHandle> {
        self.put_with(key, bytes.len(), |slot| slot.copy_from_slice(bytes))
    }

    /// Stores an object of `len` bytes written in place by `fill`. If `fill`
    /// panics nothing is published and the store stays consistent.
    pub fn put_with<F: FnOnce(&mut [u8])>(
        &mut self,
        key: &str,
        len: usize,
        fill: F,
    ) -> Result<ObjectHandle> {
        self.put_kind(key, len, ObjectKind::Raw, fill)
    }

    pub(crate) fn put_kind<F: FnOnce(&mut [u8])>(
        &mut self,
        key: &str,
        len: usize,
        kind: ObjectKind,
        fill: F,
    ) -> Result<ObjectHandle> {
        let r = self.reserve(key, len)?;
        // SAFETY: `r.payload` spans `len` bytes inside the data region (checked
        // by reserve) in a slot the ring just handed out: no live object and
        // no guard covers it, so nobody else writes it, and no reader trusts
        // it until it is published. (A reader's optimistic get_copy of the
        // object that was here may still be copying it: that copy reads
        // through copy_racy, never a reference, and is discarded.)
        fill(unsafe { std::slice::from_raw_parts_mut(r.payload, len) });
        let pos = r.plan.pos;
        let id = self.commit(r, key, len as u64, kind, None);
        Ok(self
            .publish_slot(id, pos)
            .expect("a slot committed without a pending copy publishes"))
    }

    /// Checks and hands out a slot for `len` bytes under `key`.
    pub(super) fn reserve(&mut self, key: &str, len: usize) -> Result<Reserved> {
        self.check_owner()?;
        if self.keys.index.contains_key(key) {
            return Err(Error::DuplicateKey {
                key: key.to_owned(),
                pending: false,
            });
        }
        if !self.keys.pending.is_empty() && !self.release_given_up(key) {
            return Err(Error::DuplicateKey {
                key: key.to_owned(),
                pending: true,
            });
        }
        if len as u64 > self.space.geo.max_object_size {
            tracing::debug!(
                key,
                len,
                max = self.space.geo.max_object_size,
                "object too large"
            );
            return Err(Error::TooLarge {
                size: len as u64,
                max: self.space.geo.max_object_size,
            });
        }
        let slot_len = layout::slot_len(self.space.geo.n_readers, len) as u64;
        // Pages never written before are backed by the allocation, before
        // it frees anything: a full /dev/shm is an error, never a SIGBUS in
        // the fill below, and never an eviction for a span not taken.
        let data_at = layout::header_len(self.space.geo.n_readers) as u64;
        let plan = match self.space.allocate(
            slot_len,
            self.space.geo.capacity,
            data_at,
            &mut self.keys,
            &mut self.stats,
            self.map.seg(),
        ) {
            Ok(plan) => plan,
            Err(NoRoom::Full(e)) => return Err(e),
            Err(NoRoom::Unbacked(e)) => {
                // /dev/shm is full: the store carries on in the part of the
                // ring it already has (below the high-water mark, all
                // backed), as a smaller cache, and tries the rest again on
                // later puts.
                let backed = self.space.ring.high_water();
                let Ok(plan) = self.space.allocate(
                    slot_len,
                    backed,
                    data_at,
                    &mut self.keys,
                    &mut self.stats,
                    self.map.seg(),
                ) else {
                    return Err(e);
                };
                self.stats.nospace_fallbacks += 1;
                plan
            }
        };
        let (slot, payload) = self.slot_and_payload(plan.pos, len as u64);
        // Being written: id 0, and the span marked for the inspector's walk.
        slot.mark_skip(slot_len);
        Ok(Reserved {
            plan,
            slot_len,
            payload,
        })
    }

    /// Records a reserved slot in the ring under the next id.
    pub(super) fn commit(
        &mut self,
        r: Reserved,
        key: &str,
        size: u64,
        kind: ObjectKind,
        pending: Option<Arc<dyn PendingCopy>>,
    ) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let fp = match self.keys.shared {
            Some(_) => layout::key_fingerprint(&self.secret, key),
            None => [0, 0],
        };
        let key: Arc<str> = Arc::from(key);
        if pending.is_some() {
            self.keys.pending.insert(key.clone(), id);
        }
        let run_end = self.space.ring.commit(
            &r.plan,
            r.slot_len,
            id,
            Entry {
                id,
                refs: if self.space.geo.cache { 0 } else { 1 },
                key: Some(key),
                pending,
                kind,
                size,
                fp,
                protected: false,
                invalid: false,
                hit: false,
                held_seen: std::cell::Cell::new(false),
            },
        );
        // A run starts at a span's end or at 0, so only the rest of the free
        // run after the new slot may need a marker.
        self.space.mark_free_run(r.plan.pos + r.slot_len, run_end);
        self.publish_progress();
        id
    }

    /// Publishes committed slot `id` at `pos` (its bytes are complete):
    /// readers may get it from now on. `None` if it was cleared meanwhile.
    pub(super) fn publish_slot(&mut self, id: u64, pos: u64) -> Option<ObjectHandle> {
        let epoch = self.epoch;
        let span = self.space.ring.find(id).filter(|s| s.pos == pos)?;
        let address = span.pos;
        let e = &span.value;
        let key = e.key.clone()?;
        let slot = self.slot_at(address);
        slot.publish(
            id,
            layout::keyed_slot_tag(self.tag_key, id, address, epoch, e.size, e.kind as u32),
            e.size,
            span.len,
            e.kind as u32,
            SlotMeta {
                refs: e.refs,
                key_fp: e.fp,
            },
        );
        let fp = e.fp;
        if !self.keys.pending.is_empty() {
            self.keys.pending.remove(&key);
        }
        if let Some(shared) = &mut self.keys.shared {
            if !shared.insert(fp, id, address) {
                self.stats.unindexed += 1;
            }
        }
        let handle = ObjectHandle {
            address,
            monotonic_id: id,
            epoch,
        };
        self.keys.index.insert(key, handle);
        self.stats.puts += 1;
        self.space.published();
        Some(handle)
    }

    /// Whether `key` is stored.
    pub fn is_cached(&self, key: &str) -> bool {
        self.keys.index.contains_key(key)
    }

    /// Whether a put of `key` is in flight: reserved (or its copy started)
    /// and not yet published, nor given up (a [`Reservation`](crate::store::Reservation)
    /// aborted or dropped, a [`PendingPut`](crate::store::PendingPut) dropped, a
    /// copy that failed). A pending key is not cached (`is_cached`,
    /// `get_cached` and readers miss it), and a put of it fails with
    /// [`Error::DuplicateKey`] until it is published or given up.
    pub fn is_pending(&self, key: &str) -> bool {
        match self.keys.pending.get(key) {
            Some(&id) => !self.given_up(id),
            None => false,
        }
    }

    /// The handle of `key`, counting nothing (vLLM's `key_index[key]`).
    pub fn lookup(&self, key: &str) -> Option<ObjectHandle> {
        self.keys.index.get(key).copied()
    }

    /// Every stored key with its handle, in no particular order.
    pub fn keys(&self) -> impl ExactSizeIterator<Item = (&str, ObjectHandle)> + '_ {
        self.keys.index.iter().map(|(k, h)| (&**k, *h))
    }

    /// How many keys are stored.
    pub fn len(&self) -> usize {
        self.keys.index.len()
    }

    /// Whether no key is stored.
    pub fn is_empty(&self) -> bool {
        self.keys.index.is_empty()
    }

    /// The bytes of `h` as the writer sees them (vLLM's writer-side `get`),
    /// counting no read. A handle from before a soft [`clear`](Self::clear)
    /// reads until its slot is reused, as a reader's would; anything that
    /// is not a published object of this store is [`Error::Stale`].
    pub fn peek(&self, h: ObjectHandle) -> Result<&[u8]> {
        self.check_owner()?;
        let stale = || Error::Stale {
            address: h.address,
            monotonic_id: h.monotonic_id,
        };
        if h.epoch != self.epoch {
            return Err(stale());
        }
        let span = self.space.ring.find(h.monotonic_id).ok_or_else(stale)?;
        let e = &span.value;
        if span.pos != h.address || e.pending.is_some() || e.invalid {
            return Err(stale());
        }
        let (_, payload) = self.slot_and_payload(h.address, e.size);
        // SAFETY: the slot is live in this writer's ring and published (found
        // above, no copy pending, not invalidated), so its `size` bytes are
        // written and stay so while `&self` is borrowed: only this writer
        // rewrites or reclaims slots, through `&mut self`, and readers never
        // write a payload. The mapping lives as long as `self`.
        Ok(unsafe { std::slice::from_raw_parts(payload, e.size as usize) })
    }

    /// The handle of `key`, counting one more expected read per reader (the
    /// object then needs one more read from each reader before it can go;
    /// in a [cache](crate::StoreConfig::cache), a hit only).
    /// Ends a [`protect`](Self::protect) of the key.
    pub fn get_cached(&mut self, key: &str) -> Option<ObjectHandle> {
        if !self.is_owner() {
            return None;
        }
        let h = *self.keys.index.get(key)?;
        let span = self
            .space
            .ring
            .find_mut(h.monotonic_id)
            .expect("every indexed key has a live slot");
        span.value.protected = false;
        span.value.hit = true;
        if !self.space.geo.cache {
            span.value.refs = span.value.refs.saturating_add(1);
            let refs = span.value.refs;
            let (slot, _) = self.slot_and_payload(h.address, 0);
            slot.set_refs(refs);
        }
        self.stats.hits += 1;
        Some(h)
    }

    /// One more reference to `key` (each reader owes one more read; in a
    /// cache, a hit only): as
    /// `get_cached`, without returning the handle; errors if `key` is absent.
    pub fn add_reference(&mut self, key: &str) -> Result<()> {
        self.get_cached(key)
            .map(|_| ())
            .ok_or_else(|| Error::KeyNotFound {
                key: key.to_owned(),
            })
    }

    /// Frees every object that every reader is done with (and nobody holds
    /// or protects), oldest first, around those still in use; returns how
    /// many were freed.
    pub fn free_unused(&mut self) -> usize {
        if !self.is_owner() {
            return 0;
        }
        let freed = self.space.reclaim_all(&mut self.keys, &mut self.stats);
        self.publish_progress();
        freed
    }

    /// Marks readers whose process is gone as left, so reclamation stops
    /// waiting for them (and ignores their holds); returns their indices.
    /// A put that finds no room does this by itself.
    pub fn reap_dead_readers(&mut self) -> Vec<u32> {
        if !self.is_owner() {
            return Vec::new();
        }
        self.space
            .reap_dead_readers(self.map.seg(), &mut self.stats)
    }

    /// The signature of `key`'s handle (vLLM 0.33's `get_signature`): an
    /// HMAC-SHA256 a reader checks with [`StoreReader::verify`](crate::StoreReader::verify).
    /// `None` if `key` is not stored.
    pub fn signature(&self, key: &str) -> Option<Signature> {
        let h = self.keys.index.get(key)?;
        Some(signature::sign(
            &self.secret,
            key,
            h.address,
            h.monotonic_id,
        ))
    }

    /// Whether `signature` signs `key` at `h`, and `key` still maps to `h`.
    pub fn verify(&self, key: &str, h: ObjectHandle, signature: &[u8]) -> bool {
        self.keys.index.get(key) == Some(&h)
            && signature::verify(&self.secret, key, h.address, h.monotonic_id, signature)
    }

    /// What a reader process needs to attach.
    pub fn handle(&self) -> StoreHandle {
        StoreHandle {
            name: self.map.seg().name().to_owned(),
            nonce: self.nonce,
            capacity: self.space.geo.capacity,
            max_object_size: self.space.geo.max_object_size,
            n_readers: self.space.geo.n_readers,
            layout_version: layout::LAYOUT_VERSION,
        }
    }

    /// Segment name.
    pub fn name(&self) -> &str {
        self.map.seg().name()
    }

    /// Removes the segment's name from /dev/shm now, and keeps serving:
    /// readers already attached read on, new attaches by name fail.
    /// Nothing of the store is left once every process that maps it is
    /// gone, however each ends (a SIGKILL of all of them included), with no
    /// reaper. For a writer that knows its readers are all attached. Again
    /// does nothing; `Error::Forked` in a forked child.
    pub fn unlink(&self) -> Result<()> {
        self.check_owner()?;
        self.map.seg().unlink_now();
        Ok(())
    }

    /// The writer's mapping of the data region, as (address of its first
    /// byte, length in bytes = the capacity), for registering it once with
    /// a transfer library (NIXL) that writes payloads into reserved slots:
    /// a reservation's bytes lie inside it. Only the bytes of a reservation
    /// this writer holds may be written, and only until it is committed or
    /// aborted. The address stays valid while the store lives. `Forked` in
    /// a forked child.
    pub fn data_region(&self) -> Result<(usize, u64)> {
        self.check_owner()?;
        Ok((self.space.geo.data() as usize, self.space.geo.capacity))
    }

    /// The mapping, for copies in flight to hold.
    pub(crate) fn mapping(&self) -> crate::copy::KeepAlive {
        self.map.clone()
    }

    /// The segment's creation nonce: tells stores apart.
    pub(crate) fn identity(&self) -> u64 {
        self.nonce
    }

    /// Whether the mapping is page-locked (CUDA host-registered) for DMA.
    pub fn is_pinned(&self) -> bool {
        self.map.is_pinned()
    }

    /// How the mapping was pinned (bytes, registration calls, time taken
    /// while creating), if it was.
    pub fn pinning(&self) -> Option<Pinning> {
        self.map.pinning()
    }

    /// Counters and the ring's state, with what blocks reclamation. In a
    /// forked child, this process's counters only: what is read from shared
    /// memory (`stale_reads`, `oldest_unread`) is the parent's.
    pub fn stats(&self) -> StoreStats {
        let shared = self.is_owner();
        let oldest_unread = shared
            .then(|| self.space.oldest_blocker().map(Box::new))
            .flatten();
        StoreStats {
            objects: self.space.ring.len() as u64,
            bytes_in_use: self.space.ring.used(),
            largest_free_block: self.space.ring.largest_free(),
            // Read from shared memory: saturate, never overflow.
            stale_reads: (0..self.space.geo.n_readers)
                .filter(|_| shared)
                .map(|i| self.space.geo.reader(i).stale_reads())
                .fold(0u64, u64::saturating_add),
            oldest_unread,
            indexed: self.keys.shared.as_ref().map_or(0, SharedIndex::len),
            ..self.stats.clone()
        }
    }

    // ---- internals ----

    /// Whether this is the process that made the store (not a forked child
    /// of it, whose changes would corrupt its parent's ring).
    pub(super) fn is_owner(&self) -> bool {
        fork::current() == self.fork_gen
    }

    pub(super) fn check_owner(&self) -> Result<()> {
        if self.is_owner() {
            Ok(())
        } else {
            Err(Error::Forked {
                name: self.map.seg().name().to_owned(),
            })
        }
    }

    /// The slot at a ring address (the ring hands out only in-bounds ones).
    pub(super) fn slot_at(&self, address: u64) -> SlotPtr {
        self.space
            .geo
            .slot(address)
            .expect("ring addresses are in bounds")
    }

    fn slot_and_payload(&self, address: u64, len: u64) -> (SlotPtr, *mut u8) {
        let slot = self.slot_at(address);
        let payload = self
            .space
            .geo
            .payload(address, len)
            .expect("ring slots hold their payload");
        (slot, payload)
    }

    pub(super) fn publish_progress(&self) {
        self.space.geo.header().set_progress(
            self.next_id,
            self.space.ring.cursor(),
            self.space.ring.high_water(),
        );
    }
}

impl Drop for ObjectStore {
    fn drop(&mut self) {
        if !self.is_owner() {
            // A forked child's copy: the segment, its name and its lock are
            // the parent's. Only our mapping goes.
            return;
        }
        // Readers see the store closed; the name goes now, not when the
        // last copy in flight lets go of the mapping (a new writer may take
        // the name meanwhile, and must not lose it to our unmap).
        self.space.geo.header().clear_writer();
        self.map.seg().unlink_now();
        self.map.seg().unlock(liveness::WRITER_SLOT);
        // Copies still in flight into slots keep the mapping alive by
        // themselves (the engine holds it), so nothing here waits for them.
    }
}
