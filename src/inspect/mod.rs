//! Read-only inspection of a live (or abandoned) segment: header, reader
//! table, live slots, and what happened to an `address:id` from a `Stale`
//! error. Used by the `pinshm-inspect` binary. Maps the segment read-only:
//! an inspector can never disturb the store.

mod gc;

use std::fmt::{self, Write as _};

use crate::error::Result;
use crate::geometry::validate_store;
use crate::layout::{self, reader_state};
use crate::sys::clock;
use crate::sys::liveness;
use crate::sys::segment::Segment;
use crate::sys::trust::Trust;

pub use gc::{gc, remove_if_abandoned_file, Abandoned};

/// One reader table entry.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReaderInfo {
    /// Index in the table.
    pub index: u32,
    /// `vacant`, `attaching`, `attached` or `left`.
    pub state: &'static str,
    /// Pid of the holder (0: none yet).
    pub pid: u32,
    /// Whether a live process holds the entry's lock (the kernel's word;
    /// "cannot tell" shows as alive).
    pub alive: bool,
    /// Milliseconds since its last acknowledged read (`None`: none yet).
    pub last_ack_ms_ago: Option<u64>,
    /// Objects with a smaller id are not counted for it.
    pub counted_from: u64,
    /// Stale handles it met.
    pub stale_reads: u64,
    /// Guards and views it holds now.
    pub guards: usize,
    /// How many times a reader attached into this entry.
    pub generation: u64,
}

/// One slot of the ring.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SlotInfo {
    /// Address in the data region.
    pub address: u64,
    /// Monotonic id (0: free, skipped or being written).
    pub monotonic_id: u64,
    /// Payload bytes.
    pub size: u64,
    /// The object's kind as stored (0 raw, 1 tensor, 2 item); see
    /// [`SlotInfo::kind_name`].
    pub kind: u32,
    /// Writer references.
    pub refs: u32,
    /// Reads each reader still owes (refs − acknowledged, at least 0). In
    /// aggregate mode one number: the reads owed by all readers together.
    pub reads_owed: Vec<u32>,
    /// Guards and views each reader holds on it now (its current attach
    /// generation only: a dead reader's leftovers count for nothing).
    pub holds: Vec<u32>,
}

/// Everything the inspector read.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Snapshot {
    /// Segment name.
    pub name: String,
    /// Layout version.
    pub layout_version: u32,
    /// Current epoch.
    pub epoch: u64,
    /// Ring bytes.
    pub capacity: u64,
    /// Largest object.
    pub max_object_size: u64,
    /// Whether the store is a cache (`StoreConfig::cache`): its objects
    /// owe no reads, and any that nobody holds or leases may be evicted.
    pub cache: bool,
    /// Whether reads are counted in aggregate (vLLM's mode: refs ×
    /// readers reads from anyone) rather than per reader.
    pub aggregate_reads: bool,
    /// Writer pid (0 after a clean exit).
    pub writer_pid: u32,
    /// The file's owner (uid) and permission bits: whose segment it is.
    pub owner_uid: u32,
    /// Permission bits of the file (`0o600`).
    pub mode: u32,
    /// Whether the writer still runs (holds its lock, has not closed).
    pub writer_alive: bool,
    /// The id the next put will get.
    pub next_id: u64,
    /// Ids below this were dropped by `clear`.
    pub cleared_below: u64,
    /// The allocator's cursor and high-water mark (data-region positions).
    pub ring: (u64, u64),
    /// The reader table.
    pub readers: Vec<ReaderInfo>,
    /// Slots from the oldest to the newest, published or not.
    pub slots: Vec<SlotInfo>,
}

/// Reads segment `name` (read-only).
pub fn inspect(name: &str) -> Result<Snapshot> {
    let seg = Segment::open_read_only(name, Trust::AnyOwner)?;
    let geo = validate_store(&seg, name)?;
    let hp = geo.header();
    let h = hp.read();
    let writer_pid = hp.writer_pid();
    let now = clock::monotonic_ns();
    let readers = (0..geo.n_readers)
        .map(|i| {
            let r = geo.reader(i);
            let pid = r.pid();
            let last = r.last_ack_ns();
            ReaderInfo {
                index: i,
                state: match r.state() {
                    reader_state::VACANT => "vacant",
                    reader_state::ATTACHING => "attaching",
                    reader_state::ATTACHED => "attached",
                    reader_state::LEFT => "left",
                    _ => "corrupt",
                },
                pid,
                alive: seg.held_by_other(liveness::reader_slot(i)),
                last_ack_ms_ago: (last != 0).then(|| now.saturating_sub(last) / 1_000_000),
                counted_from: r.counted_from(),
                stale_reads: r.stale_reads(),
                // Summed from the slots' hold words below.
                guards: 0,
                generation: r.generation(),
            }
        })
        .collect::<Vec<ReaderInfo>>();
    let mut readers = readers;
    let (cursor, high) = hp.ring_extent();
    let cap = geo.capacity;
    let mut slots = Vec::new();
    // Below the high-water mark the region is slots and marked gaps: walk
    // it from the start. Bounded over values a corrupt segment may hold:
    // the step count is capped (at most one slot per 64 bytes) and no
    // arithmetic on them can overflow; a bad length ends the walk.
    // Nor past what the writer backed: a read of a hole would allocate a
    // page (SIGBUS on a full /dev/shm), whatever the high-water mark says.
    let end = high.min(cap).min(hp.backed());
    let max_steps = (cap / layout::SLOT_ALIGN as u64).min(1 << 20) + 2;
    let mut pos = 0u64;
    let mut steps = 0;
    while pos < end && steps < max_steps {
        steps += 1;
        let address = pos;
        let Some(slot) = geo.slot(address) else {
            break;
        };
        let s = slot.snapshot();
        if s.slot_len == 0
            || s.slot_len % layout::SLOT_ALIGN as u64 != 0
            || s.slot_len > cap - address
        {
            break;
        }
        let holds: Vec<u32> = readers
            .iter()
            .map(|r| {
                if s.id == 0 {
                    0
                } else {
                    slot.holds_relaxed(r.index, r.generation)
                }
            })
            .collect();
        for (r, &n) in readers.iter_mut().zip(&holds) {
            r.guards += n as usize;
        }
        if s.id != 0 || s.size != 0 {
            let reads_owed = if geo.aggregate {
                vec![s
                    .refs
                    .saturating_mul(geo.n_readers)
                    .saturating_sub(slot.reads_relaxed(0))]
            } else {
                (0..geo.n_readers)
                    .map(|i| s.refs.saturating_sub(slot.reads_relaxed(i)))
                    .collect()
            };
            slots.push(SlotInfo {
                address,
                monotonic_id: s.id,
                size: s.size,
                kind: s.kind,
                refs: s.refs,
                reads_owed,
                holds,
            });
        }
        pos = pos.saturating_add(s.slot_len);
    }
    // Oldest first: ids grow with age.
    slots.sort_by_key(|s| s.monotonic_id);
    let own = seg.ownership()?;
    Ok(Snapshot {
        owner_uid: own.uid,
        mode: own.mode,
        name: name.to_owned(),
        layout_version: h.layout_version,
        epoch: hp.epoch(),
        capacity: cap,
        max_object_size: geo.max_object_size,
        aggregate_reads: geo.aggregate,
        cache: geo.cache,
        writer_pid,
        writer_alive: writer_pid != 0 && seg.held_by_other(liveness::WRITER_SLOT),
        next_id: hp.next_id(),
        cleared_below: hp.cleared_below(),
        ring: (cursor, high),
        readers,
        slots,
    })
}

impl SlotInfo {
    /// The object's kind by name: `raw`, `tensor`, `item`, or `unknown`
    /// for a code this build does not know.
    pub fn kind_name(&self) -> &'static str {
        match layout::ObjectKind::from_code(self.kind) {
            Some(layout::ObjectKind::Raw) => "raw",
            Some(layout::ObjectKind::Tensor) => "tensor",
            Some(layout::ObjectKind::Item) => "item",
            None => "unknown",
        }
    }
}

/// `n` and the noun, singular or plural.
fn count(n: impl Into<u64>, one: &str, many: &str) -> String {
    let n = n.into();
    format!("{n} {}", if n == 1 { one } else { many })
}

impl Snapshot {
    /// What kind of store this is, in words (the glossary's names).
    pub fn store_kind(&self) -> &'static str {
        if self.cache {
            "cache: objects owe no reads; any that nobody holds or leases may be evicted"
        } else if self.aggregate_reads {
            "store, reads counted in aggregate: an object may be reclaimed once refs x readers reads are acknowledged, from anyone"
        } else {
            "store, reads counted per reader: an object may be reclaimed once every counted reader has read it as often as it was put"
        }
    }

    /// Reader entries held by a live process, and entries free for the
    /// next attach (vacant, left, or held by a process that died: the
    /// kernel released its lock).
    pub fn reader_entries(&self) -> (usize, usize) {
        let used = self.readers.iter().filter(|r| r.alive).count();
        (used, self.readers.len() - used)
    }

    /// The oldest live object that a live reader still holds or owes
    /// reads of, and why: the first object the writer's sweep must
    /// allocate around. A reader that is not attached and alive blocks
    /// nothing (the writer stops counting it), nor does an object older
    /// than the reader's `counted_from`.
    pub fn oldest_blocker(&self) -> Option<(&SlotInfo, String)> {
        let live = |r: &&ReaderInfo| r.state == "attached" && r.alive;
        self.slots
            .iter()
            .filter(|s| s.monotonic_id != 0)
            .find_map(|s| {
                let mut why = Vec::new();
                for r in self.readers.iter().filter(live) {
                    let held = s.holds.get(r.index as usize).copied().unwrap_or(0);
                    if held > 0 {
                        why.push(format!(
                            "reader {} has {}",
                            r.index,
                            count(held, "hold", "holds")
                        ));
                    }
                    let owed = s.reads_owed.get(r.index as usize).copied().unwrap_or(0);
                    if !self.aggregate_reads && owed > 0 && s.monotonic_id >= r.counted_from {
                        why.push(format!(
                            "reader {} owes {}",
                            r.index,
                            count(owed, "read", "reads")
                        ));
                    }
                }
                if self.aggregate_reads && s.reads_owed.first().is_some_and(|&n| n > 0) {
                    why.push(format!(
                        "{} owed by the readers together",
                        count(s.reads_owed[0], "read", "reads")
                    ));
                }
                (!why.is_empty()).then(|| (s, why.join(", ")))
            })
    }

    /// What happened to the object `address:id` of a `Stale` error.
    pub fn explain(&self, address: u64, id: u64) -> String {
        let live: Vec<&SlotInfo> = self.slots.iter().filter(|s| s.monotonic_id != 0).collect();
        let oldest = live.iter().map(|s| s.monotonic_id).min();
        if id == 0 {
            return "id 0 is never given to an object: the handle is not from a put".into();
        }
        if let Some(s) = live.iter().find(|s| s.monotonic_id == id) {
            if s.address == address {
                return format!(
                    "live: {} bytes at {address}, reads owed {:?}; if a reader got Stale for it, its handle carries another epoch (made before a clear or by an earlier writer of this name)",
                    s.size, s.reads_owed
                );
            }
            return format!(
                "id {id} is live at address {}, not {address}: the handle is corrupt",
                s.address
            );
        }
        if id >= self.next_id {
            return format!(
                "never existed here: this segment has handed out ids up to {}; the handle comes from another segment or an earlier writer of this name",
                self.next_id.saturating_sub(1)
            );
        }
        if address % layout::SLOT_ALIGN as u64 != 0 || address >= self.capacity {
            return format!(
                "address {address} is not a slot address in a {}-byte ring: the handle is corrupt",
                self.capacity
            );
        }
        if id < self.cleared_below {
            return format!(
                "dropped by clear(): every id below {} was cleared",
                self.cleared_below
            );
        }
        let mut why = String::from(if self.cache {
            "evicted: the cache reclaimed it when nobody held or leased it, to make room"
        } else if self.aggregate_reads {
            "reclaimed: the readers together had read it as often as it was referenced"
        } else {
            "reclaimed: every counted reader had read it as often as it was referenced"
        });
        if let Some(s) = live.iter().find(|s| s.address == address) {
            let _ = write!(why, "; its slot now holds id {}", s.monotonic_id);
        } else if let Some(o) = oldest {
            let _ = write!(why, "; the oldest live object is id {o}");
        }
        why.push_str(
            ". A reader that needs it must be sent a handle from a fresh put or get_cached",
        );
        why
    }
}

impl fmt::Display for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "segment   /dev/shm/{}", self.name)?;
        writeln!(
            f,
            "owner     uid {}, mode {:04o}",
            self.owner_uid, self.mode
        )?;
        writeln!(f, "kind      {}", self.store_kind())?;
        writeln!(f, "layout    version {}", self.layout_version)?;
        writeln!(f, "epoch     {:#018x}", self.epoch)?;
        writeln!(
            f,
            "capacity  {} bytes, objects up to {} bytes",
            self.capacity, self.max_object_size
        )?;
        writeln!(
            f,
            "writer    pid {} ({})",
            self.writer_pid,
            if self.writer_alive {
                "alive"
            } else if self.writer_pid == 0 {
                "exited"
            } else {
                "dead"
            }
        )?;
        writeln!(
            f,
            "ids       next {}, cleared below {}",
            self.next_id, self.cleared_below
        )?;
        let in_use: u64 = self
            .slots
            .iter()
            .filter(|s| s.monotonic_id != 0)
            .map(|s| s.size)
            .sum();
        let live = self.slots.iter().filter(|s| s.monotonic_id != 0).count() as u64;
        writeln!(
            f,
            "data      {} in {}; allocator cursor {}, high-water {}",
            count(in_use, "payload byte", "payload bytes"),
            count(live, "live object", "live objects"),
            self.ring.0,
            self.ring.1,
        )?;
        match self.oldest_blocker() {
            Some((s, why)) => writeln!(
                f,
                "blocker   oldest in use: id {} at {} ({} bytes): {why}",
                s.monotonic_id, s.address, s.size
            )?,
            None => writeln!(f, "blocker   none: every live object may be reclaimed")?,
        }
        let (used, free) = self.reader_entries();
        writeln!(
            f,
            "entries   {used} of {} held by live readers, {free} free",
            count(self.readers.len() as u64, "reader entry", "reader entries")
        )?;
        writeln!(f, "\nreaders")?;
        writeln!(
            f,
            "  {:>5} {:>9} {:>8} {:>6} {:>12} {:>12} {:>6} {:>6}",
            "index", "state", "pid", "alive", "last ack", "counted from", "stale", "holds"
        )?;
        for r in &self.readers {
            let ack = r
                .last_ack_ms_ago
                .map_or("never".to_string(), |ms| format!("{ms} ms ago"));
            writeln!(
                f,
                "  {:>5} {:>9} {:>8} {:>6} {:>12} {:>12} {:>6} {:>6}",
                r.index, r.state, r.pid, r.alive, ack, r.counted_from, r.stale_reads, r.guards
            )?;
        }
        writeln!(
            f,
            "\n{}, oldest first",
            count(self.slots.len() as u64, "slot", "slots")
        )?;
        writeln!(
            f,
            "  {:>12} {:>10} {:>12} {:>7} {:>5}  {}, holds per reader",
            "address",
            "id",
            "size",
            "kind",
            "refs",
            if self.aggregate_reads {
                "reads owed (all readers)"
            } else {
                "reads owed per reader"
            }
        )?;
        for s in &self.slots {
            writeln!(
                f,
                "  {:>12} {:>10} {:>12} {:>7} {:>5}  {:?} {:?}",
                s.address,
                s.monotonic_id,
                s.size,
                s.kind_name(),
                s.refs,
                s.reads_owed,
                s.holds
            )?;
        }
        Ok(())
    }
}
