//! Layer 3: objects on slots. [`ObjectStore`] (the one writer) and
//! [`StoreReader`] (each reader), with the reference's flag accounting,
//! zero-copy [`ReadGuard`]s and stale/torn detection.

use std::cell::Cell;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::ops::Deref;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Blocker, Error, Result};
use crate::layout::{self, reader_state, SegmentHeader};
use crate::ring::{HeaderPtr, ReaderPtr, Ring, SlotPtr};
use crate::sys::clock;
use crate::sys::segment::{self, Segment};

/// Whether to page-lock (CUDA host-register) the mapping.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PinMode {
    /// Never pin.
    Off,
    /// Pin where a CUDA driver is present; otherwise carry on unpinned.
    #[default]
    Auto,
    /// Pin or fail.
    Require,
}

/// How to create a store.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    capacity: usize,
    max_object_size: usize,
    n_readers: u32,
    name: Option<String>,
    prefault: bool,
    reserve: bool,
    pin: PinMode,
    reader_timeout: Option<std::time::Duration>,
}

impl StoreConfig {
    /// A ring of `capacity` bytes for objects up to `max_object_size` bytes,
    /// read by `n_readers` readers (1 to [`layout::MAX_READERS`]).
    pub fn new(capacity: usize, max_object_size: usize, n_readers: u32) -> Self {
        StoreConfig {
            capacity,
            max_object_size,
            n_readers,
            name: None,
            prefault: true,
            reserve: true,
            pin: PinMode::Auto,
            reader_timeout: None,
        }
    }

    /// The segment's name in /dev/shm (default: unique per process and call).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Whether to fault every page in at create (default true), so the first
    /// pass over the ring runs at the speed of later ones.
    pub fn prefault(mut self, yes: bool) -> Self {
        self.prefault = yes;
        self
    }

    /// Pinning policy (default [`PinMode::Auto`]).
    pub fn pin(mut self, mode: PinMode) -> Self {
        self.pin = mode;
        self
    }

    /// Whether to reserve every page of /dev/shm at create (default true),
    /// so a too-small /dev/shm fails at create instead of with SIGBUS later.
    /// Off only for sparse segments in tests.
    pub fn reserve(mut self, yes: bool) -> Self {
        self.reserve = yes;
        self
    }

    /// Stuck-reader policy (off by default): a reader that owes a read of
    /// the oldest object and has acknowledged nothing for longer than
    /// `timeout` is no longer waited for. Its live guards are still
    /// honoured: a slot under a guard is never reused.
    pub fn reader_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.reader_timeout = Some(timeout);
        self
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidConfig(m));
        if self.n_readers == 0 || self.n_readers > layout::MAX_READERS {
            return bad(format!(
                "n_readers must be 1..={}, got {}",
                layout::MAX_READERS,
                self.n_readers
            ));
        }
        if self.capacity == 0 || self.capacity % layout::SLOT_ALIGN != 0 {
            return bad(format!(
                "capacity must be a positive multiple of {}, got {}",
                layout::SLOT_ALIGN,
                self.capacity
            ));
        }
        let need = self
            .max_object_size
            .checked_add(layout::slot_prefix_len(self.n_readers) + layout::SLOT_ALIGN);
        if need.is_none_or(|n| n > self.capacity) {
            return bad(format!(
                "an object of max_object_size ({}) bytes plus its {}-byte slot header must fit in capacity ({})",
                self.max_object_size,
                layout::slot_prefix_len(self.n_readers),
                self.capacity
            ));
        }
        Ok(())
    }
}

/// How a reader attaches.
#[derive(Clone, Copy, Debug)]
pub struct ReaderOptions {
    index: Option<u32>,
    pin: PinMode,
    prefault: bool,
}

impl Default for ReaderOptions {
    fn default() -> Self {
        ReaderOptions {
            index: None,
            pin: PinMode::Auto,
            prefault: true,
        }
    }
}

impl ReaderOptions {
    /// Attach as this reader index (default: the first free one).
    pub fn index(mut self, i: u32) -> Self {
        self.index = Some(i);
        self
    }

    /// Pinning policy (default [`PinMode::Auto`]).
    pub fn pin(mut self, mode: PinMode) -> Self {
        self.pin = mode;
        self
    }

    /// Fault the mapping in at attach (default true).
    pub fn prefault(mut self, yes: bool) -> Self {
        self.prefault = yes;
        self
    }
}

/// Where an object lives: what travels from the writer to the readers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ObjectHandle {
    /// Offset of the slot in the data region.
    pub address: u64,
    /// The object's id, never reused within a segment's life.
    pub monotonic_id: u64,
    /// Epoch at put time (changes on create and `clear`).
    pub epoch: u64,
}

/// Everything a reader process needs to attach.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StoreHandle {
    /// Segment name (without the leading `/`).
    pub name: String,
    /// The segment's creation nonce.
    pub nonce: u64,
    /// Ring bytes.
    pub capacity: u64,
    /// Largest object.
    pub max_object_size: u64,
    /// Reader slots.
    pub n_readers: u32,
    /// Layout version of the writer.
    pub layout_version: u32,
}

/// Counters of the writer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Successful puts.
    pub puts: u64,
    /// `get_cached` / `touch` hits.
    pub hits: u64,
    /// Objects reclaimed.
    pub evictions: u64,
    /// Puts that failed with `Full`.
    pub full_errors: u64,
    /// Live objects (cleared ones still held by a guard included).
    pub objects: u64,
    /// Bytes between the ring's head and tail.
    pub bytes_in_use: u64,
    /// Largest object slot a put could take now.
    pub largest_free_block: u64,
    /// Dead readers found and released.
    pub dead_readers_reaped: u64,
    /// Stale handles met by readers (summed over the reader table).
    pub stale_reads: u64,
    /// The oldest object, if a reader still owes it a read or holds it:
    /// the slot and readers that block reclamation.
    pub oldest_unread: Option<Box<Blocker>>,
}

/// Validated, process-local copy of a segment's geometry. Nothing here is
/// read from shared memory again after attach.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub(crate) n_readers: u32,
    pub(crate) capacity: u64,
    pub(crate) max_object_size: u64,
    pub(crate) prefix_len: u64,
    base: *mut u8,
    data: *mut u8,
}

impl Geometry {
    fn new(base: *mut u8, n_readers: u32, capacity: u64, max_object_size: u64) -> Self {
        let header_len = layout::header_len(n_readers);
        Geometry {
            n_readers,
            capacity,
            max_object_size,
            prefix_len: layout::slot_prefix_len(n_readers) as u64,
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
        // bytes, which holds every entry; entries are 8-aligned (576 B each
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
        // so the prefix lies inside the data region (itself page aligned).
        Some(unsafe { SlotPtr::new(self.data.add(address as usize)) })
    }

    /// The payload of `size` bytes of the slot at `address`, if it fits.
    fn payload(&self, address: u64, size: u64) -> Option<*mut u8> {
        let start = address.checked_add(self.prefix_len)?;
        if start.checked_add(size)? > self.capacity {
            return None;
        }
        // SAFETY: start + size <= capacity: inside the data region.
        Some(unsafe { self.data.add(start as usize) })
    }
}

fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(clock::monotonic_ns());
    h.write_u32(std::process::id());
    h.finish()
}

fn next_epoch(e: u64) -> u64 {
    layout::slot_tag(e, 0x5eed, e, 0, 0).max(1)
}

/// Keys are the producer's own (content hashes, request ids), hashed only
/// in the writer's memory: a fast non-cryptographic hasher is enough, and
/// SipHash was a third of a small put's instructions.
type KeyHasher = foldhash::fast::RandomState;

/// What the writer remembers about a live slot.
#[derive(Debug)]
struct Entry {
    id: u64,
    refs: u32,
    /// `None` once cleared: the slot waits only for guards to go.
    key: Option<Arc<str>>,
    /// A copy into the slot still in flight: not published, not freeable.
    pending: Option<Arc<dyn PendingCopy>>,
    kind: u32,
    size: u64,
}

/// A copy into a reserved slot (a device-to-host DMA, say), seen by the
/// store. Implemented by the copy layer.
pub(crate) trait PendingCopy: Send + Sync + std::fmt::Debug {
    /// Whether the copy has finished (successfully or not).
    fn is_done(&self) -> bool;
    /// Blocks until the copy has finished; its outcome.
    fn wait(&self) -> Result<()>;
    /// Whether the caller dropped its token without finishing the put.
    fn abandoned(&self) -> bool;
}

/// A slot handed out by the ring, not yet published.
struct Reserved {
    pos: u64,
    address: u64,
    slot_len: u64,
    payload: *mut u8,
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
    geo: Geometry,
    ring: Ring<Entry>,
    index: HashMap<Arc<str>, ObjectHandle, KeyHasher>,
    /// Keys of puts whose copy is still in flight.
    pending_keys: std::collections::HashSet<Arc<str>, KeyHasher>,
    next_id: u64,
    epoch: u64,
    nonce: u64,
    stats: StoreStats,
    /// Unregistered before `seg` unmaps (fields drop in order).
    pinned: Option<crate::pin::Pinned>,
    reader_timeout_ns: Option<u64>,
    // Last: unmapped (and unlinked) after everything that points into it.
    seg: Segment,
}

// SAFETY: the raw pointers in `geo` point into `seg`'s mapping, which moves
// with the store; the writer is used from one thread at a time (&mut self).
unsafe impl Send for ObjectStore {}

impl ObjectStore {
    /// Creates the segment (exclusively) and an empty store in it.
    pub fn create(cfg: StoreConfig) -> Result<ObjectStore> {
        cfg.validate()?;
        let name = cfg.name.clone().unwrap_or_else(segment::unique_name);
        let header_len = layout::header_len(cfg.n_readers);
        let total = header_len
            .checked_add(cfg.capacity)
            .ok_or_else(|| Error::InvalidConfig("capacity overflows".into()))?;
        let seg = match Segment::create(&name, total, cfg.prefault, cfg.reserve) {
            Err(Error::AlreadyExists { .. }) if cfg.name.is_some() => {
                // A writer that died leaves its segment: replace it, unless
                // its writer still runs.
                remove_if_writer_dead(&name)?;
                Segment::create(&name, total, cfg.prefault, cfg.reserve)?
            }
            r => r?,
        };
        let geo = Geometry::new(
            seg.as_ptr(),
            cfg.n_readers,
            cfg.capacity as u64,
            cfg.max_object_size as u64,
        );
        let nonce = random_u64();
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
            hazards_per_reader: layout::HAZARDS_PER_READER as u32,
            reader_entry_len: size_of::<layout::ReaderEntry>() as u32,
            writer_pid: std::process::id(),
            writer_start_time: segment::own_start_time(),
            epoch,
            next_id: 1,
            ring_head: 0,
            ring_tail: 0,
            cleared_below: 0,
            reserved: [0; 18],
        };
        // The reader table is zero (VACANT) in a fresh object; stamp last.
        geo.header().init(&header);
        geo.header().stamp();
        let pinned = crate::pin::pin(seg.as_ptr(), seg.len(), cfg.pin)?;
        tracing::debug!(name = %name, capacity = cfg.capacity, n_readers = cfg.n_readers, "store created");
        Ok(ObjectStore {
            geo,
            ring: Ring::new(cfg.capacity as u64),
            index: HashMap::default(),
            pending_keys: Default::default(),
            next_id: 1,
            epoch,
            nonce,
            stats: StoreStats::default(),
            pinned,
            reader_timeout_ns: cfg.reader_timeout.map(|d| d.as_nanos() as u64),
            seg,
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
        self.put_kind(key, len, crate::codec::KIND_RAW, fill)
    }

    pub(crate) fn put_kind<F: FnOnce(&mut [u8])>(
        &mut self,
        key: &str,
        len: usize,
        kind: u32,
        fill: F,
    ) -> Result<ObjectHandle> {
        let r = self.reserve(key, len)?;
        // SAFETY: `r.payload` spans `len` bytes inside the data region (checked
        // by reserve) in a slot the ring just handed out: no live object and
        // no guard covers it, so nobody else writes it and no reader trusts
        // it until it is published.
        fill(unsafe { std::slice::from_raw_parts_mut(r.payload, len) });
        let id = self.commit(r, key, len as u64, kind, None);
        Ok(self
            .publish(id)
            .expect("a slot committed without a pending copy publishes"))
    }

    /// Reserves a slot for `len` payload bytes under `key`, starts `start`
    /// on its payload (a copy that finishes later) and records the slot as
    /// pending. Returns the id to finish it by. Nothing is published, and on
    /// an error nothing is recorded.
    pub(crate) fn begin_pending(
        &mut self,
        key: &str,
        len: usize,
        kind: u32,
        start: impl FnOnce(*mut u8) -> Result<Arc<dyn PendingCopy>>,
    ) -> Result<u64> {
        let r = self.reserve(key, len)?;
        let pending = start(r.payload)?;
        Ok(self.commit(r, key, len as u64, kind, Some(pending)))
    }

    /// Whether the pending put `id` has finished its copy.
    pub(crate) fn pending_done(&self, id: u64) -> bool {
        self.ring
            .find_by(id, |e| e.id)
            .and_then(|s| s.value.pending.as_ref())
            .is_none_or(|p| p.is_done())
    }

    /// Waits for the pending put `id` and publishes it.
    pub(crate) fn finish_pending(&mut self, id: u64) -> Result<ObjectHandle> {
        let span = self
            .ring
            .find_by_mut(id, |e| e.id)
            .ok_or_else(|| Error::InvalidConfig(format!("no pending put with id {id}")))?;
        let address = span.pos % self.geo.capacity;
        let outcome = match span.value.pending.take() {
            Some(p) => p.wait(),
            None => Ok(()),
        };
        if let Err(e) = outcome {
            // The slot was never published: forget its key, free it in turn.
            if let Some(k) = span.value.key.take() {
                self.pending_keys.remove(&k);
            }
            tracing::debug!(id, %e, "pending put failed");
            return Err(e);
        }
        self.publish(id).ok_or(Error::Stale {
            address,
            monotonic_id: id,
        })
    }

    /// Checks and hands out a slot for `len` bytes under `key`.
    fn reserve(&mut self, key: &str, len: usize) -> Result<Reserved> {
        if self.index.contains_key(key)
            || (!self.pending_keys.is_empty() && self.pending_keys.contains(key))
        {
            return Err(Error::DuplicateKey {
                key: key.to_owned(),
            });
        }
        if len as u64 > self.geo.max_object_size {
            tracing::debug!(key, len, max = self.geo.max_object_size, "object too large");
            return Err(Error::TooLarge {
                size: len as u64,
                max: self.geo.max_object_size,
            });
        }
        let slot_len = layout::slot_len(self.geo.n_readers, len) as u64;
        let pos = self.allocate(slot_len)?;
        let tail = self.ring.tail();
        if pos > tail && !self.ring.is_empty() && pos - tail < self.geo.capacity {
            // The end of this lap is skipped: leave a marker there so the
            // inspector can walk the ring without reading stale headers.
            if let Some(s) = self.geo.slot(tail % self.geo.capacity) {
                s.mark_skip(pos - tail);
            }
        }
        let address = self.ring.address(pos);
        let (slot, payload) = self.slot_and_payload(address, len as u64);
        slot.begin_write();
        Ok(Reserved {
            pos,
            address,
            slot_len,
            payload,
        })
    }

    /// Records a reserved slot in the ring under the next id.
    fn commit(
        &mut self,
        r: Reserved,
        key: &str,
        size: u64,
        kind: u32,
        pending: Option<Arc<dyn PendingCopy>>,
    ) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let key: Arc<str> = Arc::from(key);
        if pending.is_some() {
            self.pending_keys.insert(key.clone());
        }
        debug_assert_eq!(r.address, self.ring.address(r.pos));
        self.ring.commit(
            r.pos,
            r.slot_len,
            Entry {
                id,
                refs: 1,
                key: Some(key),
                pending,
                kind,
                size,
            },
        );
        self.publish_progress();
        id
    }

    /// Publishes committed slot `id` (its bytes are complete): readers may
    /// get it from now on. `None` if it was cleared meanwhile.
    fn publish(&mut self, id: u64) -> Option<ObjectHandle> {
        let epoch = self.epoch;
        let n_readers = self.geo.n_readers;
        let span = self.ring.find_by_mut(id, |e| e.id)?;
        let address = span.pos % self.geo.capacity;
        let e = &span.value;
        let key = e.key.clone()?;
        let slot = self
            .geo
            .slot(address)
            .expect("ring addresses are in bounds");
        slot.publish(
            id,
            layout::slot_tag(id, address, epoch, e.size, e.kind),
            e.size,
            layout::slot_len(n_readers, e.size as usize) as u64,
            e.kind,
            epoch,
            n_readers,
        );
        if !self.pending_keys.is_empty() {
            self.pending_keys.remove(&key);
        }
        let handle = ObjectHandle {
            address,
            monotonic_id: id,
            epoch,
        };
        self.index.insert(key, handle);
        self.stats.puts += 1;
        Some(handle)
    }

    /// Whether `key` is stored.
    pub fn is_cached(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// The handle of `key`, counting one more expected read per reader (the
    /// object then needs one more read from each reader before it can go).
    pub fn get_cached(&mut self, key: &str) -> Option<ObjectHandle> {
        let h = *self.index.get(key)?;
        let span = self
            .ring
            .find_by_mut(h.monotonic_id, |e| e.id)
            .expect("every indexed key has a live slot");
        span.value.refs = span.value.refs.saturating_add(1);
        let refs = span.value.refs;
        let (slot, _) = self.slot_and_payload(h.address, 0);
        slot.set_refs(refs);
        self.stats.hits += 1;
        Some(h)
    }

    /// As `get_cached`, without returning the handle; errors if `key` is absent.
    pub fn touch(&mut self, key: &str) -> Result<()> {
        self.get_cached(key)
            .map(|_| ())
            .ok_or_else(|| Error::KeyNotFound {
                key: key.to_owned(),
            })
    }

    /// Frees objects from the oldest end while every reader is done with
    /// them; returns how many were freed.
    pub fn free_unused(&mut self) -> usize {
        self.reclaim(None)
    }

    /// Forgets every object and starts a new epoch: handles from before are
    /// stale. Slots under a live guard are freed once the guard drops.
    pub fn clear(&mut self) {
        let geo = self.geo;
        for span in self.ring.iter_mut() {
            if span.value.key.take().is_some() {
                geo.slot(span.pos % geo.capacity)
                    .expect("ring slots are in bounds")
                    .invalidate();
            }
        }
        self.index.clear();
        self.pending_keys.clear();
        self.geo.header().set_cleared_below(self.next_id);
        self.epoch = next_epoch(self.epoch);
        self.geo.header().set_epoch(self.epoch);
        let freed = self.reclaim(None);
        tracing::debug!(freed, held = self.ring.len(), "store cleared");
        self.publish_progress();
    }

    /// What a reader process needs to attach.
    pub fn handle(&self) -> StoreHandle {
        StoreHandle {
            name: self.seg.name().to_owned(),
            nonce: self.nonce,
            capacity: self.geo.capacity,
            max_object_size: self.geo.max_object_size,
            n_readers: self.geo.n_readers,
            layout_version: layout::LAYOUT_VERSION,
        }
    }

    /// Segment name.
    pub fn name(&self) -> &str {
        self.seg.name()
    }

    /// The segment's creation nonce: tells stores apart.
    pub(crate) fn identity(&self) -> u64 {
        self.nonce
    }

    /// Whether the mapping is page-locked (CUDA host-registered) for DMA.
    pub fn is_pinned(&self) -> bool {
        self.pinned.is_some()
    }

    /// Counters and the ring's state, with what blocks reclamation.
    pub fn stats(&self) -> StoreStats {
        let oldest_unread = self.ring.front().and_then(|s| {
            let b = self.blocker(s.pos, &s.value);
            (!b.unread_by.is_empty() || !b.held_by.is_empty()).then(|| Box::new(b))
        });
        StoreStats {
            objects: self.ring.len() as u64,
            bytes_in_use: self.ring.used(),
            largest_free_block: self.ring.largest_free(),
            stale_reads: (0..self.geo.n_readers)
                .map(|i| self.geo.reader(i).stale_reads())
                .sum(),
            oldest_unread,
            ..self.stats.clone()
        }
    }

    /// Marks readers whose process is gone as left, so reclamation stops
    /// waiting for them; returns their indices.
    pub fn reap_dead_readers(&mut self) -> Vec<u32> {
        let mut reaped = Vec::new();
        for i in 0..self.geo.n_readers {
            let r = self.geo.reader(i);
            if r.state() != reader_state::ATTACHED {
                continue;
            }
            let (pid, start) = r.owner();
            if pid != 0
                && !segment::process_alive(pid, start)
                && r.transition(reader_state::ATTACHED, reader_state::LEFT)
            {
                tracing::warn!(
                    reader = i,
                    pid,
                    "reader process is gone; no longer waiting for its reads"
                );
                reaped.push(i);
            }
        }
        self.stats.dead_readers_reaped += reaped.len() as u64;
        reaped
    }

    // ---- internals ----

    fn slot_and_payload(&self, address: u64, len: u64) -> (SlotPtr, *mut u8) {
        let slot = self
            .geo
            .slot(address)
            .expect("ring addresses are in bounds");
        let payload = self
            .geo
            .payload(address, len)
            .expect("ring slots hold their payload");
        (slot, payload)
    }

    fn publish_progress(&self) {
        self.geo
            .header()
            .set_progress(self.next_id, self.ring.head(), self.ring.tail());
    }

    fn allocate(&mut self, slot_len: u64) -> Result<u64> {
        if let Some(pos) = self.ring.reserve(slot_len) {
            return Ok(pos);
        }
        self.reclaim(Some(slot_len));
        if let Some(pos) = self.ring.reserve(slot_len) {
            return Ok(pos);
        }
        if !self.reap_dead_readers().is_empty() {
            self.reclaim(Some(slot_len));
            if let Some(pos) = self.ring.reserve(slot_len) {
                return Ok(pos);
            }
        }
        self.stats.full_errors += 1;
        let blocker = self
            .ring
            .front()
            .map(|s| Box::new(self.blocker(s.pos, &s.value)));
        let err = Error::Full {
            requested: slot_len,
            free: self.ring.capacity() - self.ring.used(),
            capacity: self.ring.capacity(),
            blocker,
        };
        tracing::debug!(%err, "allocation failed");
        Err(err)
    }

    /// Frees from the oldest end until `need` bytes fit (or, with `None`,
    /// as far as possible); stops at the first object still in use.
    fn reclaim(&mut self, need: Option<u64>) -> usize {
        let mut freed = 0;
        while let Some(front) = self.ring.front() {
            if need.is_some_and(|n| self.ring.reserve(n).is_some()) {
                break;
            }
            let address = self.ring.address(front.pos);
            if !self.try_free(address, &front.value) {
                break;
            }
            let span = self.ring.pop_front().expect("front exists");
            if let Some(key) = span.value.key {
                self.index.remove(&key);
                if !self.pending_keys.is_empty() {
                    self.pending_keys.remove(&key);
                }
            }
            self.stats.evictions += 1;
            freed += 1;
        }
        if freed > 0 {
            tracing::debug!(freed, "reclaimed objects");
            self.publish_progress();
        }
        freed
    }

    /// Whether reader `i` still owes a read of `e`.
    fn owes(&self, i: u32, e: &Entry, slot: &SlotPtr) -> bool {
        let r = self.geo.reader(i);
        let counted = match r.state() {
            reader_state::VACANT => true,
            reader_state::ATTACHED => e.id >= r.counted_from(),
            _ => false,
        };
        counted && slot.reads_acquire(i) < e.refs && !self.stuck(i)
    }

    /// Whether reader `i` is past the stuck-reader timeout.
    fn stuck(&self, i: u32) -> bool {
        let Some(limit) = self.reader_timeout_ns else {
            return false;
        };
        let r = self.geo.reader(i);
        let last = r.last_ack_ns().max(r.attached_ns());
        let idle = clock::monotonic_ns().saturating_sub(last);
        if idle > limit {
            tracing::warn!(
                reader = i,
                idle_ms = idle / 1_000_000,
                "reader is stuck; no longer waiting for its reads"
            );
            true
        } else {
            false
        }
    }

    /// The reclaim protocol of crate::ring: on success the slot is invalid
    /// and no reader can be inside it.
    fn try_free(&self, address: u64, e: &Entry) -> bool {
        let slot = self
            .geo
            .slot(address)
            .expect("ring addresses are in bounds");
        if let Some(p) = &e.pending {
            // Never published, so no reader is in it; free it only once the
            // copy into it has stopped and nobody will finish the put.
            return p.is_done() && p.abandoned();
        }
        let live = e.key.is_some();
        if live {
            if (0..self.geo.n_readers).any(|i| self.owes(i, e, &slot)) {
                return false;
            }
            slot.invalidate();
        }
        if self.holders(e.id).next().is_some() {
            if live {
                slot.restore(e.id);
            }
            return false;
        }
        true
    }

    /// Readers (not left) with a guard on object `id`: after `invalidate`,
    /// the writer's half of the hazard protocol.
    fn holders(&self, id: u64) -> impl Iterator<Item = u32> + '_ {
        (0..self.geo.n_readers).filter(move |&i| {
            let r = self.geo.reader(i);
            r.state() != reader_state::LEFT && r.holds(id)
        })
    }

    fn blocker(&self, pos: u64, e: &Entry) -> Blocker {
        let address = self.ring.address(pos);
        let slot = self
            .geo
            .slot(address)
            .expect("ring addresses are in bounds");
        Blocker {
            address,
            monotonic_id: e.id,
            key: e.key.as_deref().map(str::to_owned),
            unread_by: (0..self.geo.n_readers)
                .filter(|&i| e.key.is_some() && self.owes(i, e, &slot))
                .collect(),
            held_by: self.holders(e.id).collect(),
        }
    }
}

impl Drop for ObjectStore {
    fn drop(&mut self) {
        self.geo.header().clear_writer();
        // A copy still running into a slot must finish before the mapping
        // goes (the DMA engine does not know about munmap).
        for span in self.ring.iter_mut() {
            if let Some(p) = span.value.pending.take() {
                if let Err(e) = p.wait() {
                    tracing::debug!(%e, "pending put failed while the store was dropped");
                }
            }
        }
    }
}

/// Removes segment `name` if it is a pinshm segment whose writer is dead.
fn remove_if_writer_dead(name: &str) -> Result<()> {
    let seg = match Segment::open(name, false) {
        Ok(s) => s,
        Err(Error::NotFound { .. }) => return Ok(()), // gone meanwhile
        Err(e) => return Err(e),
    };
    let geo = validate_header(&seg, name).map_err(|e| Error::InUse {
        name: name.to_owned(),
        detail: format!("it exists and is not a usable pinshm segment ({e}); remove /dev/shm/{name} if no process uses it"),
    })?;
    let (pid, start) = geo.header().writer();
    if pid != 0 && segment::process_alive(pid, start) {
        return Err(Error::InUse {
            name: name.to_owned(),
            detail: format!("its writer (pid {pid}) is alive"),
        });
    }
    tracing::warn!(name, pid, "replacing the segment of a writer that is gone");
    drop(seg);
    match Segment::unlink(name) {
        Ok(()) | Err(Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Opens and validates a segment against the expectations of a handle.
fn open_validated(sh: &StoreHandle, prefault: bool) -> Result<(Segment, Geometry)> {
    let seg = Segment::open(&sh.name, prefault)?;
    let geo = validate_header(&seg, &sh.name)?;
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
        "hazards_per_reader",
        layout::HAZARDS_PER_READER as u64,
        h.hazards_per_reader as u64,
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
    Ok(Geometry::new(
        seg.as_ptr(),
        h.n_readers,
        h.capacity,
        h.max_object_size,
    ))
}

/// One reader of a store, attached into a reader slot until dropped.
///
/// A `StoreReader` is `Send` but not `Sync`: one per thread (each thread of
/// a process attaches its own, as each takes one of `n_readers` slots).
#[derive(Debug)]
pub struct StoreReader {
    geo: Geometry,
    index: u32,
    me: ReaderPtr,
    counted_from: u64,
    /// Bit k set: hazard word k is in use by a live guard.
    hazards_used: Cell<u64>,
    /// Unregistered before `seg` unmaps (fields drop in order).
    pinned: Option<crate::pin::Pinned>,
    seg: Segment,
}

// SAFETY: the pointers point into `seg`, which moves with the reader; the
// reader's own state (Cell) is not shared, since StoreReader is not Sync.
unsafe impl Send for StoreReader {}

impl StoreReader {
    /// Attaches into the first free reader slot (pinning: `PinMode::Auto`).
    pub fn attach(sh: &StoreHandle) -> Result<StoreReader> {
        Self::attach_with(sh, ReaderOptions::default())
    }

    /// Attaches as reader `index` (a tensor-parallel rank, say).
    pub fn attach_as(sh: &StoreHandle, index: u32) -> Result<StoreReader> {
        Self::attach_with(sh, ReaderOptions::default().index(index))
    }

    /// Attaches with explicit options.
    pub fn attach_with(sh: &StoreHandle, opts: ReaderOptions) -> Result<StoreReader> {
        let (seg, geo) = open_validated(sh, opts.prefault)?;
        let (index, counted_from) = match opts.index {
            Some(index) => {
                if index >= geo.n_readers {
                    return Err(Error::ReaderIndexOutOfRange {
                        index,
                        n_readers: geo.n_readers,
                    });
                }
                let from = claim(&geo, index)?.ok_or_else(|| Error::ReaderSlotTaken {
                    index,
                    pid: geo.reader(index).owner().0,
                })?;
                (index, from)
            }
            None => {
                let mut found = None;
                for i in 0..geo.n_readers {
                    if let Some(from) = claim(&geo, i)? {
                        found = Some((i, from));
                        break;
                    }
                }
                found.ok_or(Error::NoReaderSlot {
                    n_readers: geo.n_readers,
                })?
            }
        };
        let me = geo.reader(index);
        let pinned = match crate::pin::pin(seg.as_ptr(), seg.len(), opts.pin) {
            Ok(p) => p,
            Err(e) => {
                // Give the slot back before failing: an entry that was never
                // attached stays expected (counted), one taken over stays left.
                me.set_state(if counted_from == 0 {
                    reader_state::VACANT
                } else {
                    reader_state::LEFT
                });
                return Err(e);
            }
        };
        tracing::debug!(name = %sh.name, index, counted_from, pinned = pinned.is_some(), "reader attached");
        Ok(StoreReader {
            geo,
            index,
            me,
            counted_from,
            hazards_used: Cell::new(0),
            pinned,
            seg,
        })
    }

    /// This reader's index in the reader table.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The segment's name.
    pub fn name(&self) -> &str {
        self.seg.name()
    }

    /// Whether this process's mapping is page-locked for DMA.
    pub fn is_pinned(&self) -> bool {
        self.pinned.is_some()
    }

    /// A zero-copy view of the object. Its read is acknowledged when the
    /// guard drops; until then the writer cannot reuse the slot.
    pub fn get(&self, h: ObjectHandle) -> Result<ReadGuard<'_>> {
        let slot = self.slot(h)?;
        let k = self.take_hazard()?;
        self.me.set_hazard(k, h.monotonic_id);
        match self.validate(h, &slot, slot.id_after_hazard()) {
            Ok((data, len, kind)) => Ok(ReadGuard {
                reader: self,
                slot,
                hazard: k,
                handle: h,
                data,
                len,
                kind,
            }),
            Err(e) => {
                self.release_hazard(k);
                Err(e)
            }
        }
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
        let slot = self.slot(h)?;
        let (data, len, _) = self.validate(h, &slot, slot.id_acquire())?;
        out.clear();
        out.reserve(len);
        // SAFETY: `data..data+len` lies in the data region (validate checked
        // it against the process-local capacity) and `out` has room for len
        // bytes. The writer may be rewriting these bytes (only if this read
        // is not counted); such a copy is detected below and discarded.
        unsafe {
            std::ptr::copy_nonoverlapping(data, out.as_mut_ptr(), len);
        }
        if slot.id_recheck() != h.monotonic_id {
            return Err(self.stale(h, "slot reused during the copy"));
        }
        // SAFETY: the first len bytes were initialised by the copy.
        unsafe { out.set_len(len) };
        // The bytes are whole; if the slot has gone since, there is nothing
        // left to acknowledge.
        let _ = self.acknowledge(h);
        Ok(())
    }

    /// Acknowledges one read of `h` without reading it.
    pub fn touch(&self, h: ObjectHandle) -> Result<()> {
        self.acknowledge(h)
    }

    // ---- internals ----

    fn stale(&self, h: ObjectHandle, why: &'static str) -> Error {
        tracing::debug!(
            reader = self.index,
            address = h.address,
            id = h.monotonic_id,
            why,
            "stale read"
        );
        self.me.count_stale();
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

    /// Whether the writer that created this segment still runs.
    pub fn writer_alive(&self) -> bool {
        let (pid, start) = self.geo.header().writer();
        pid != 0 && segment::process_alive(pid, start)
    }

    /// `Err(WriterGone)` if the writer has exited or died. Objects already
    /// published stay readable; nothing new will come.
    pub fn check_writer(&self) -> Result<()> {
        if self.writer_alive() {
            Ok(())
        } else {
            Err(Error::WriterGone {
                name: self.seg.name().to_owned(),
            })
        }
    }

    fn slot(&self, h: ObjectHandle) -> Result<SlotPtr> {
        if h.monotonic_id == 0 {
            return Err(self.stale(h, "id 0 is never used"));
        }
        self.geo
            .slot(h.address)
            .ok_or_else(|| self.stale(h, "address out of range or misaligned"))
    }

    /// Given the slot's id as just loaded, checks it, the tag and the size
    /// against the handle and the process-local bounds.
    fn validate(
        &self,
        h: ObjectHandle,
        slot: &SlotPtr,
        id: u64,
    ) -> Result<(*const u8, usize, u32)> {
        if id != h.monotonic_id {
            return Err(self.stale(h, "id mismatch"));
        }
        let (tag, size, kind) = slot.meta();
        if tag != layout::slot_tag(h.monotonic_id, h.address, h.epoch, size, kind) {
            return Err(self.stale(
                h,
                "tag mismatch (other epoch or segment, or a corrupted slot header)",
            ));
        }
        let data = self
            .geo
            .payload(h.address, size)
            .ok_or_else(|| self.stale(h, "size runs past the data region"))?;
        Ok((data, size as usize, kind))
    }

    fn take_hazard(&self) -> Result<usize> {
        let used = self.hazards_used.get();
        if used == u64::MAX {
            return Err(Error::TooManyGuards {
                limit: layout::HAZARDS_PER_READER,
            });
        }
        let k = (!used).trailing_zeros() as usize;
        self.hazards_used.set(used | 1 << k);
        Ok(k)
    }

    fn release_hazard(&self, k: usize) {
        self.me.clear_hazard(k);
        self.hazards_used.set(self.hazards_used.get() & !(1 << k));
    }

    /// Counts one read of `h`, under a hazard so the slot cannot be reused
    /// while the counter is written.
    fn acknowledge(&self, h: ObjectHandle) -> Result<()> {
        let slot = self.slot(h)?;
        let k = self.take_hazard()?;
        self.me.set_hazard(k, h.monotonic_id);
        let r = self
            .validate(h, &slot, slot.id_after_hazard())
            .map(|_| self.ack_held(&slot, h));
        self.release_hazard(k);
        r
    }

    /// Acknowledges a read of a slot this reader holds a hazard on.
    fn ack_held(&self, slot: &SlotPtr, h: ObjectHandle) {
        if h.monotonic_id >= self.counted_from && slot.acknowledge(self.index) {
            self.me.set_last_ack_ns(clock::monotonic_ns());
        }
    }
}

impl Drop for StoreReader {
    fn drop(&mut self) {
        // No guard can be alive (they borrow self): leave the table.
        self.me.clear_all_hazards();
        self.me.set_state(reader_state::LEFT);
        tracing::debug!(
            name = self.seg.name(),
            index = self.index,
            "reader detached"
        );
    }
}

/// Takes reader entry `i` if it is free (never used, left, or its process
/// died); returns the first id this reader is counted for.
fn claim(geo: &Geometry, i: u32) -> Result<Option<u64>> {
    let r = geo.reader(i);
    let pid = std::process::id();
    let start = segment::own_start_time();
    match r.state() {
        reader_state::VACANT if r.transition(reader_state::VACANT, reader_state::ATTACHED) => {
            // Counted from the start: the writer has been waiting for it.
            r.set_attached_ns(clock::monotonic_ns());
            r.set_owner(pid, start);
            r.bump_generation();
            return Ok(Some(0));
        }
        s @ (reader_state::LEFT | reader_state::ATTACHED) => {
            if s == reader_state::ATTACHED {
                let (p, st) = r.owner();
                if p == 0 || segment::process_alive(p, st) {
                    return Ok(None);
                }
            }
            if r.transition(s, reader_state::ATTACHING) {
                // Not counted while attaching; start counting from the next
                // put so nothing of the previous holder is inherited.
                r.clear_all_hazards();
                let from = geo.header().next_id();
                r.set_counted_from(from);
                r.set_attached_ns(clock::monotonic_ns());
                r.set_owner(pid, start);
                r.bump_generation();
                r.set_state(reader_state::ATTACHED);
                return Ok(Some(from));
            }
        }
        _ => {}
    }
    Ok(None)
}

/// A zero-copy view of an object in the ring. Dropping it acknowledges the
/// read; while it lives the slot cannot be reused.
///
/// A guard cannot outlive its reader:
///
/// ```compile_fail
/// use pinshm::{ObjectStore, StoreConfig, StoreReader};
/// let mut store = ObjectStore::create(StoreConfig::new(1 << 20, 1 << 16, 1)).unwrap();
/// let h = store.put("k", b"v").unwrap();
/// let guard = {
///     let reader = StoreReader::attach(&store.handle()).unwrap();
///     reader.get(h).unwrap()
/// };
/// ```
#[derive(Debug)]
pub struct ReadGuard<'r> {
    reader: &'r StoreReader,
    slot: SlotPtr,
    hazard: usize,
    handle: ObjectHandle,
    data: *const u8,
    len: usize,
    kind: u32,
}

impl ReadGuard<'_> {
    /// The handle this guard reads.
    pub fn handle(&self) -> ObjectHandle {
        self.handle
    }

    /// The object kind tag (0 = raw bytes).
    pub fn kind(&self) -> u32 {
        self.kind
    }
}

impl Deref for ReadGuard<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `data..data+len` was bounds-checked against the data region
        // at get; the reader's hazard on this id keeps the writer from
        // reusing the slot until the guard drops, and a published object's
        // bytes are never written again, so nobody writes them meanwhile.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }
}

impl AsRef<[u8]> for ReadGuard<'_> {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl Drop for ReadGuard<'_> {
    fn drop(&mut self) {
        self.reader.ack_held(&self.slot, self.handle);
        self.reader.release_hazard(self.hazard);
    }
}
