//! How a store is created and attached: [`StoreConfig`], [`Eviction`],
//! [`ReaderOptions`].

use crate::error::{Error, Result};
use crate::layout;
use crate::pin::{PinMode, PinSpec};

/// How to create a store.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub(crate) capacity: usize,
    pub(crate) max_object_size: usize,
    pub(crate) n_readers: u32,
    pub(crate) name: Option<String>,
    pub(crate) prefault: bool,
    pub(crate) reserve: bool,
    pub(crate) shm_headroom: u64,
    pub(crate) back_ahead: u64,
    pub(crate) pin: PinSpec,
    pub(crate) reader_timeout: Option<std::time::Duration>,
    pub(crate) aggregate_reads: bool,
    pub(crate) eviction: Eviction,
    pub(crate) cache: bool,
    pub(crate) key_index: usize,
}

/// Which reclaimable objects the writer's allocator lets go when it needs
/// room ([`StoreConfig::eviction`]). Objects still in use (unread, held,
/// protected) always stay where they are, and the allocator places new
/// objects around them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Eviction {
    /// Oldest first: every reclaimable object the allocator's sweep meets
    /// goes (the reference's order, minus its stall behind objects in use).
    Fifo,
    /// CLOCK (the default): an object hit
    /// ([`ObjectStore::get_cached`](crate::ObjectStore::get_cached)) since
    /// the sweep last passed it stays for one more lap, in place (no copy,
    /// its handles stay valid). On a Zipf trace of multimodal-sized objects
    /// it beat FIFO at equal capacity in every cell measured, by 1.3 to 6.2
    /// points of hit rate (docs/hit_rate.md). A reader's hit by key
    /// ([`StoreReader::lookup`](crate::StoreReader::lookup),
    /// [`get_key`](crate::StoreReader::get_key),
    /// [`lease_key`](crate::StoreReader::lease_key)) counts as one. Without
    /// hits it is FIFO.
    #[default]
    SecondChance,
}

impl StoreConfig {
    /// Slots start, and a ring's capacity is a multiple of, this many bytes.
    pub const SLOT_ALIGN: usize = layout::SLOT_ALIGN;
    /// The most readers a store takes.
    pub const MAX_READERS: u32 = layout::MAX_READERS;
    /// [`StoreConfig::back_ahead`]'s default: 16 MiB.
    pub const DEFAULT_BACK_AHEAD: u64 = 16 << 20;

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
            shm_headroom: 0,
            back_ahead: Self::DEFAULT_BACK_AHEAD,
            pin: PinSpec::default(),
            reader_timeout: None,
            aggregate_reads: false,
            eviction: Eviction::default(),
            cache: false,
            key_index: 0,
        }
    }

    /// What the allocator lets go when it needs room (default
    /// [`Eviction::SecondChance`]).
    pub fn eviction(mut self, policy: Eviction) -> Self {
        self.eviction = policy;
        self
    }

    /// Ring bytes one object of `payload` bytes takes with `n_readers`
    /// readers (its slot header, read counters and 64-byte alignment
    /// included): size a ring as a multiple of this.
    pub const fn slot_len(n_readers: u32, payload: usize) -> usize {
        layout::slot_len(n_readers, payload)
    }

    /// The largest `max_object_size` a ring of `capacity` bytes accepts
    /// with `n_readers` readers (0 when not even an empty object fits): what
    /// [`ObjectStore::create`](crate::ObjectStore::create) checks.
    pub const fn largest_object(capacity: usize, n_readers: u32) -> usize {
        capacity.saturating_sub(layout::slot_prefix_len(n_readers) + layout::SLOT_ALIGN)
    }

    /// The segment's name in /dev/shm (default: unique per process and call).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Whether to fault every page in at create (default true), so the first
    /// pass over the ring runs at the speed of later ones. Only a reserved
    /// segment is pre-faulted (see [`StoreConfig::reserve`]).
    pub fn prefault(mut self, yes: bool) -> Self {
        self.prefault = yes;
        self
    }

    /// Pinning policy (default [`PinMode::Auto`]). `Auto` pins only a
    /// reserved segment (see [`StoreConfig::reserve`]).
    pub fn pin(mut self, mode: PinMode) -> Self {
        self.pin.mode = mode;
        self
    }

    /// The CUDA device (ordinal) whose primary context registers the
    /// segment when it is pinned (default 0). The registration is portable:
    /// engines of every device copy from it at DMA speed; the calling
    /// thread's current CUDA context is left as it was.
    pub fn cuda_device(mut self, ordinal: usize) -> Self {
        self.pin.device = ordinal;
        self
    }

    /// Whether to reserve every page of /dev/shm at create (default true),
    /// so a too-small /dev/shm fails at create. Off: a sparse segment that
    /// costs the pages its objects touch, plus one step ahead
    /// ([`StoreConfig::back_ahead`]); no page is written before it is
    /// backed (`fallocate`), so a full /dev/shm is an [`Error::NoSpace`]
    /// from the put that needs the page, never a SIGBUS, and readers never
    /// fault on unbacked pages. `PinMode::Auto` does not pin a sparse
    /// segment (pinning would allocate every page).
    pub fn reserve(mut self, yes: bool) -> Self {
        self.reserve = yes;
        self
    }

    /// For a sparse store ([`StoreConfig::reserve`] off): back new pages
    /// only while /dev/shm keeps at least `bytes` free afterwards (default
    /// 0: until it is full). Below that the store stops growing and reuses
    /// the part of its ring it has, as on a full /dev/shm: a put lands in
    /// what is backed, evicting there, or fails with
    /// [`Error::NoSpace`](crate::Error::NoSpace) (whose `available` is the
    /// free space less the headroom). For a cache that shares /dev/shm
    /// with something that cannot fail, such as a message queue: the cache
    /// is the elastic user, the queue keeps what it needs.
    pub fn shm_headroom(mut self, bytes: u64) -> Self {
        self.shm_headroom = bytes;
        self
    }

    /// For a sparse store ([`StoreConfig::reserve`] off): how many bytes
    /// of pages a background thread keeps backed (`fallocate`) and mapped
    /// into the writer's page tables (`MADV_POPULATE_WRITE`) past the end
    /// of the writer's last put, during the ring's first lap (default
    /// [`StoreConfig::DEFAULT_BACK_AHEAD`]; rounded up to 64 KiB). A put
    /// into pages never written before then costs what a put into backed
    /// ones does, as long as the thread keeps up: it backs about a GB/s on
    /// a small VM, between puts (a put per engine step), at the lowest
    /// priority (nice 19: it never preempts the writer, and on a busy
    /// machine it falls behind). A put that outruns it backs the rest of
    /// its pages itself, as with 0 (off: each put backs the pages it
    /// needs, and pays their allocation and first-touch faults); the
    /// writer never waits for it. The thread starts at create (the first
    /// put finds its pages ready), ends once the whole ring is backed, and
    /// obeys [`StoreConfig::shm_headroom`] together with the writer: it
    /// never backs what the headroom leaves to others, and a full /dev/shm
    /// stops it (the put that needs the pages gets [`Error::NoSpace`],
    /// never SIGBUS). Memory: what the data touches plus at most this many
    /// bytes.
    pub fn back_ahead(mut self, bytes: u64) -> Self {
        self.back_ahead = bytes;
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

    /// Aggregate read accounting (off by default), as vLLM counts: one
    /// counter per object, and an object referenced k times is done after
    /// k × n_readers reads from any readers (readers that left are not
    /// counted). The default, one counter per reader, is stricter: each
    /// reader must read the object as often as it was referenced. Not with
    /// [`StoreConfig::key_index`] or [`StoreConfig::cache`]
    /// ([`ObjectStore::create`](crate::ObjectStore::create) refuses them
    /// with [`Error::InvalidConfig`]).
    pub fn aggregate_reads(mut self, yes: bool) -> Self {
        self.aggregate_reads = yes;
        self
    }

    /// A cache (off by default): objects owe no reads. Any object that no
    /// reader holds or leases may be reclaimed, read or not, under the
    /// eviction policy; [`get_cached`](crate::ObjectStore::get_cached)
    /// counts a hit and adds no read. For stores whose readers look up
    /// what they want by key ([`StoreConfig::key_index`]) rather than
    /// being sent every object, such as an encoder cache. Not with
    /// [`StoreConfig::aggregate_reads`].
    pub fn cache(mut self, yes: bool) -> Self {
        self.cache = yes;
        self
    }

    /// A shared key index with room for `max_keys` keys (default 0: none),
    /// so that readers find a key's object without the writer
    /// ([`StoreReader::lookup`](crate::StoreReader::lookup)). It costs 32
    /// bytes per entry, 43 to 85 per key (the table is a power of two at
    /// most three quarters full), after the data region, backed at
    /// create. Keys past `max_keys` stay stored but readers miss them
    /// (`StoreStats::unindexed` counts them); size it by the objects the
    /// ring holds (capacity / the smallest object). Not with
    /// [`StoreConfig::aggregate_reads`]: there a reader's hit by key would
    /// count as a read any reader owes (use [`StoreConfig::cache`] or
    /// per-reader accounting).
    pub fn key_index(mut self, max_keys: usize) -> Self {
        self.key_index = max_keys;
        self
    }

    /// Entries of the key index for [`StoreConfig::key_index`]'s keys:
    /// a power of two at most three quarters full, at least 16.
    pub(crate) fn index_entries(&self) -> u64 {
        if self.key_index == 0 {
            return 0;
        }
        let want = (self.key_index as u64)
            .saturating_mul(4)
            .div_ceil(3)
            .max(16);
        want.checked_next_power_of_two().unwrap_or(u64::MAX)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidConfig(m));
        if self.cache && self.aggregate_reads {
            return bad(
                "a cache owes no reads: cache and aggregate_reads exclude each other".into(),
            );
        }
        if self.key_index > 0 && self.aggregate_reads {
            // A hit by key (`get_key`) acknowledges a read, and in aggregate
            // mode any reader's read counts towards every reader's: one
            // reader's repeated hits would free an object the others still
            // owe reads of, and their `get` would be `Stale`.
            return bad(
                "key_index with aggregate_reads: a reader's hits by key would count as reads \
                 owed by other readers and free objects they have not read; for lookups by \
                 key use key_index with cache(true) (objects owe no reads), or per-reader \
                 accounting (aggregate_reads off)"
                    .into(),
            );
        }
        if self.index_entries() > layout::MAX_INDEX_ENTRIES {
            return bad(format!(
                "key_index of {} keys is over the most a table holds ({})",
                self.key_index,
                layout::MAX_INDEX_ENTRIES / 4 * 3
            ));
        }
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
        let room = layout::slot_prefix_len(self.n_readers) + layout::SLOT_ALIGN;
        if self.capacity < room
            || self.max_object_size > Self::largest_object(self.capacity, self.n_readers)
        {
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
    pub(crate) index: Option<u32>,
    pub(crate) pin: PinSpec,
    pub(crate) prefault: bool,
    pub(crate) read_only_views: bool,
}

impl Default for ReaderOptions {
    fn default() -> Self {
        ReaderOptions {
            index: None,
            pin: PinSpec::default(),
            prefault: true,
            read_only_views: false,
        }
    }
}

impl ReaderOptions {
    /// Attach as this reader index (default: the first free one).
    pub fn index(mut self, i: u32) -> Self {
        self.index = Some(i);
        self
    }

    /// Pinning policy (default [`PinMode::Auto`]). `Auto` pins only a
    /// segment whose pages are all allocated (its file's `st_blocks` cover
    /// its size: the writer reserved it), so a sparse test segment is not
    /// made whole by every reader.
    pub fn pin(mut self, mode: PinMode) -> Self {
        self.pin.mode = mode;
        self
    }

    /// The CUDA device (ordinal) whose primary context registers the
    /// mapping when it is pinned (default 0): a worker on GPU k passes k.
    /// The calling thread's current CUDA context is left as it was.
    pub fn cuda_device(mut self, ordinal: usize) -> Self {
        self.pin.device = ordinal;
        self
    }

    /// Hand out guards over a second, read-only mapping of the segment
    /// (default false): the same pages, so no copy, but a write through a
    /// view (an in-place op on a tensor that views a slot, say) faults
    /// (SIGSEGV) instead of silently changing bytes that other readers
    /// read. For zero-copy consumers that hand views to code they do not
    /// control. Device copies from such views work; with the `cuda`
    /// feature they run from the unregistered read-only range, so a
    /// pinned worker wants this off.
    pub fn read_only_views(mut self, yes: bool) -> Self {
        self.read_only_views = yes;
        self
    }

    /// Fault the mapping in at attach (default true). A sparse segment (a
    /// writer made with `reserve(false)`) is never pre-faulted by a reader:
    /// faulting its holes would allocate every page.
    pub fn prefault(mut self, yes: bool) -> Self {
        self.prefault = yes;
        self
    }
}
