//! Named POSIX shared memory.
//!
//! A [`Segment`] is a mapping of one `/dev/shm` object plus its own open
//! file description, which carries the liveness locks of
//! [`crate::sys::liveness`]; the creator owns the name and unlinks it when
//! dropped.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::mman::{shm_open, shm_unlink};
use nix::sys::stat::Mode;

use crate::error::{Error, Result};
use crate::sys::listed::{page_size, populate, Listed};
use crate::sys::private::CowMap;
use crate::sys::shm_free_bytes;
use crate::sys::trust::{self, Trust};
use crate::sys::{fork, liveness};

/// A mapped shared-memory object.
#[derive(Debug)]
pub(crate) struct Segment {
    name: String,
    map: Listed<MmapRaw>,
    /// Our own open file description: its liveness locks live as long as
    /// this (and die with the process; a forked child drops its copy at
    /// once, see `crate::sys::fork`).
    file: Listed<File>,
    /// Whether dropping this handle unlinks the name (the creator's, until
    /// `unlink_now`).
    owner: AtomicBool,
    /// The fork generation of the creator: a forked child's copy never
    /// unlinks its parent's name.
    fork_gen: u64,
}

// SAFETY: the mapping is shared memory reached only through raw pointers and
// atomics; moving the handle between threads changes nothing about it.
unsafe impl Send for Segment {}
// SAFETY: `Segment` hands out raw pointers only; synchronisation is the
// caller's protocol (crate::ring), not a property of this handle.
unsafe impl Sync for Segment {}

/// Checks a user-given segment name and turns it into the POSIX form
/// (`/name`).
pub(crate) fn posix_name(name: &str) -> Result<String> {
    let bare = name.strip_prefix('/').unwrap_or(name);
    if bare.is_empty() || bare.len() > 250 || bare.contains('/') || bare.contains('\0') {
        return Err(Error::InvalidName {
            name: name.to_owned(),
        });
    }
    Ok(format!("/{bare}"))
}

/// A name no other live segment has: pid, a process-wide counter, time,
/// and random bits (pids repeat across PID namespaces sharing /dev/shm).
pub(crate) fn unique_name() -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(t ^ n);
    format!(
        "pinshm-{}-{n}-{:x}-{:08x}",
        std::process::id(),
        t & 0xffff_ffff,
        h.finish() as u32
    )
}

pub(super) fn sys_err(op: &'static str, name: &str, errno: Errno) -> Error {
    tracing::debug!(op, name, %errno, "shared memory call failed");
    Error::Os {
        op,
        name: name.to_owned(),
        source: std::io::Error::from(errno),
    }
}

impl Segment {
    /// Creates `name` exclusively with `len` bytes, reserves the memory
    /// (so a too-small /dev/shm fails here, not with SIGBUS later) and maps
    /// it, pre-faulting every page when `prefault` is set.
    pub(super) fn create(
        name: &str,
        len: usize,
        prefault: bool,
        reserve_pages: bool,
    ) -> Result<Segment> {
        let pname = posix_name(name)?;
        let file = Listed::file(|| {
            shm_open(
                pname.as_str(),
                OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
                Mode::S_IRUSR | Mode::S_IWUSR,
            )
        })
        .map_err(|e| match e {
            Errno::EEXIST => Error::AlreadyExists {
                name: name.to_owned(),
            },
            e => sys_err("shm_open", name, e),
        })?;
        // From here on the name exists: remove it again on any failure.
        let cleanup = |e: Error| {
            let _ = shm_unlink(pname.as_str());
            e
        };
        reserve(&file, len, name, reserve_pages).map_err(cleanup)?;
        let map = map(&file, len, prefault, name).map_err(cleanup)?;
        Ok(Segment {
            name: pname,
            map,
            file,
            owner: AtomicBool::new(true),
            fork_gen: fork::register(),
        })
    }

    /// Opens an existing segment of this user's (see [`trust`]) and maps
    /// all of it.
    pub(crate) fn open(name: &str, prefault: bool) -> Result<Segment> {
        Self::open_as(name, prefault, Trust::Owner)
    }

    /// Opens an existing segment whose file `trust` accepts; maps all of it.
    pub(crate) fn open_as(name: &str, prefault: bool, trust: Trust) -> Result<Segment> {
        let (pname, file, len) = open_file(name, OFlag::O_RDWR, trust)?;
        let map = map(&file, len, prefault, name)?;
        Ok(Segment {
            name: pname,
            map,
            file,
            owner: AtomicBool::new(false),
            fork_gen: fork::register(),
        })
    }

    /// Opens an existing segment read-only (loads only), if `trust`
    /// accepts its file.
    ///
    /// A file that is not this process's user's (nor a trusted one's) is
    /// never mapped: its owner could truncate it under the mapping (SIGBUS
    /// at the next read). The mapping is then of a private copy of it
    /// ([`super::private::copy`]), and only the locks are the file's.
    pub(crate) fn open_read_only(name: &str, trust: Trust) -> Result<Segment> {
        let (pname, file, len) = open_file(name, OFlag::O_RDONLY, trust)?;
        let copy = match trust::check(&file, name, Trust::Owner) {
            Ok(_) => None,
            Err(_) => Some(super::private::copy(&file, len as u64, name)?),
        };
        let source: &File = copy.as_ref().unwrap_or(&file);
        let map =
            Listed::map(|| MmapOptions::new().len(len).map_raw_read_only(source)).map_err(|e| {
                Error::Os {
                    op: "mmap",
                    name: name.to_owned(),
                    source: e,
                }
            })?;
        Ok(Segment {
            name: pname,
            map,
            file,
            owner: AtomicBool::new(false),
            fork_gen: fork::register(),
        })
    }

    /// A private copy-on-write mapping of `offset..offset + len` of the
    /// segment ([`CowMap`]); the range must lie inside it.
    pub(crate) fn map_cow(&self, offset: usize, len: usize) -> Result<CowMap> {
        CowMap::new(&self.file, &self.name, self.len(), offset, len)
    }

    /// Whose the segment's file is ([`trust::check`] of anyone's).
    pub(crate) fn ownership(&self) -> Result<trust::Ownership> {
        trust::check(&self.file, &self.name, Trust::AnyOwner)
    }

    /// A second mapping of the whole segment, read-only (the same pages):
    /// payload views handed out through it fault on a write instead of
    /// changing bytes other processes read.
    pub(crate) fn map_read_only(&self) -> Result<ReadOnlyMap> {
        Listed::map(|| {
            MmapOptions::new()
                .len(self.len())
                .map_raw_read_only(&*self.file)
        })
        .map(ReadOnlyMap)
        .map_err(|e| Error::Os {
            op: "mmap",
            name: self.name().to_owned(),
            source: e,
        })
    }

    /// Whether every page of the segment's file is allocated (its creator
    /// reserved it with `posix_fallocate`, or it has since been written
    /// throughout): `st_blocks` covers `st_size`. A sparse segment says
    /// false. Answers false where it cannot tell.
    pub(crate) fn is_reserved(&self) -> bool {
        use std::os::unix::fs::MetadataExt;
        self.file
            .metadata()
            .map(|m| m.blocks().saturating_mul(512) >= m.size())
            .unwrap_or(false)
    }

    /// Faults every page of the mapping in now (what `MAP_POPULATE` does at
    /// map time: read faults, as for any shared mapping), for a mapping made
    /// without it. `MADV_POPULATE_READ` (Linux 5.14); on older kernels one
    /// relaxed atomic load per page.
    pub(crate) fn prefault(&self) {
        // SAFETY: our own live mapping, whole.
        unsafe { populate(self.as_ptr(), self.len()) };
    }

    /// Allocates the pages of `offset..offset + len` of the file
    /// (`fallocate`, mode 0: on tmpfs this takes the pages from /dev/shm
    /// now, or fails with `ENOSPC`), so writing them later can never raise
    /// SIGBUS. Pages already allocated are left as they are.
    pub(crate) fn back(&self, offset: u64, len: u64) -> Result<()> {
        self.allocate_pages(offset, len).map(|_| ())
    }

    /// As [`Segment::back`]; `Ok(false)` where the filesystem has no
    /// `fallocate` (nothing was allocated: writes fault pages in).
    pub(crate) fn allocate_pages(&self, offset: u64, len: u64) -> Result<bool> {
        if len == 0 {
            return Ok(true);
        }
        let fd = self.file.as_raw_fd();
        loop {
            // SAFETY: a plain syscall on our own open file description; it
            // reads no memory of ours.
            let r = unsafe { nix::libc::fallocate(fd, 0, offset as i64, len as i64) };
            if r == 0 {
                return Ok(true);
            }
            match Errno::last() {
                Errno::EINTR => continue,
                Errno::ENOSPC => {
                    let err = Error::NoSpace {
                        name: self.name().to_owned(),
                        requested: len,
                        available: shm_free_bytes(),
                    };
                    tracing::debug!(%err, offset, "backing pages failed");
                    return Err(err);
                }
                // Filesystems without fallocate: writes fault pages in as
                // before (only the early failure is lost).
                Errno::EOPNOTSUPP | Errno::ENOSYS => return Ok(false),
                e => return Err(sys_err("fallocate", self.name(), e)),
            }
        }
    }

    /// Maps the whole pages of `offset..offset + len` into this process's
    /// page tables, writable, so that a first write costs no fault:
    /// `MADV_POPULATE_WRITE` (Linux 5.14), else read faults (a read fault
    /// maps a shared tmpfs page writable too). Changes no byte. Only for
    /// pages already allocated ([`Segment::allocate_pages`]): the
    /// fallback's loads on a hole of a full /dev/shm would raise SIGBUS.
    pub(crate) fn map_pages(&self, offset: u64, len: u64) {
        let page = page_size() as u64;
        let start = offset.next_multiple_of(page);
        let end = offset.saturating_add(len).min(self.len() as u64) / page * page;
        if end <= start {
            return;
        }
        // SAFETY: start..end lies inside our live mapping (clamped to its
        // length, page aligned); the advice only fills page tables for
        // pages that exist and changes no byte.
        let p = unsafe { self.as_ptr().add(start as usize) };
        let n = (end - start) as usize;
        // SAFETY: as above.
        let r = unsafe { nix::libc::madvise(p.cast(), n, nix::libc::MADV_POPULATE_WRITE) };
        if r != 0 && Errno::last() == Errno::EINVAL {
            // Before Linux 5.14: read faults.
            // SAFETY: p..p+n is inside our live mapping.
            unsafe { populate(p, n) };
        }
    }

    /// Start of the mapping (page aligned).
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Bytes mapped.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// The name without its leading `/`.
    pub(crate) fn name(&self) -> &str {
        &self.name[1..]
    }

    /// Unlinks the name now if this handle created it (and not again at
    /// drop); the mapping stays valid.
    pub(crate) fn unlink_now(&self) {
        if fork::current() != self.fork_gen {
            return; // a forked child's copy: the name is the parent's
        }
        if self.owner.swap(false, Ordering::Relaxed) && self.is_still_named() {
            if let Err(e) = shm_unlink(self.name.as_str()) {
                tracing::debug!(name = %self.name, %e, "shm_unlink failed");
            }
        }
    }

    /// Whether the name still refers to this segment's file (not to a newer
    /// segment that replaced it, nor to nothing).
    pub(crate) fn is_still_named(&self) -> bool {
        still_named(&self.name, &self.file)
    }

    /// Takes liveness lock `slot` for this segment handle; `Ok(false)` if a
    /// live holder has it.
    pub(crate) fn try_lock(&self, slot: u32) -> Result<bool> {
        liveness::try_lock(self.file.as_fd(), slot)
            .map_err(|e| sys_err("fcntl(F_OFD_SETLK)", self.name(), e))
    }

    /// Gives liveness lock `slot` back (closing the segment does too).
    pub(crate) fn unlock(&self, slot: u32) {
        if let Err(e) = liveness::unlock(self.file.as_fd(), slot) {
            tracing::debug!(name = self.name(), slot, %e, "unlock failed; it goes at close");
        }
    }

    /// Whether another handle (a live process) holds liveness lock `slot`.
    /// Fails closed: "cannot tell" is "alive".
    pub(crate) fn held_by_other(&self, slot: u32) -> bool {
        liveness::held_by_other(self.file.as_fd(), slot)
    }
}

impl Segment {
    /// Removes a segment's name from /dev/shm (mappings stay valid).
    pub(crate) fn unlink(name: &str) -> Result<()> {
        let pname = posix_name(name)?;
        shm_unlink(pname.as_str()).map_err(|e| match e {
            Errno::ENOENT => Error::NotFound {
                name: name.to_owned(),
            },
            e => sys_err("shm_unlink", name, e),
        })
    }
}

/// 64 random bits, for segment nonces (not for secrets: see the store's
/// signing key, which comes from the OS's generator).
pub(crate) fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(crate::sys::clock::monotonic_ns());
    h.write_u32(std::process::id());
    h.finish()
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.owner.load(Ordering::Relaxed) && fork::current() == self.fork_gen {
            if let Err(e) = shm_unlink(self.name.as_str()) {
                // Never panic in drop: someone else may have removed it.
                tracing::debug!(name = %self.name, %e, "shm_unlink on drop failed");
            }
        }
    }
}

/// Opens `name` with `flags` (never blocking, never through a symlink:
/// glibc's shm_open adds `O_NOFOLLOW`) and checks its file against `trust`;
/// its POSIX name, file and (non-zero) size.
pub(super) fn open_file(
    name: &str,
    flags: OFlag,
    trust: Trust,
) -> Result<(String, Listed<File>, usize)> {
    let (pname, file, len) = open_any_size(name, flags, trust)?;
    if len == 0 {
        return Err(Error::BadHeader {
            name: name.to_owned(),
            field: "size",
            detail: "the segment is empty (its creator has not sized it yet, or it is not a pinshm segment)".into(),
        });
    }
    Ok((pname, file, len))
}

/// [`open_file`], of any size (0 included).
pub(super) fn open_any_size(
    name: &str,
    flags: OFlag,
    trust: Trust,
) -> Result<(String, Listed<File>, usize)> {
    let pname = posix_name(name)?;
    let flags = flags | OFlag::O_NONBLOCK | OFlag::O_NOFOLLOW;
    let file =
        Listed::file(|| shm_open(pname.as_str(), flags, Mode::empty())).map_err(|e| match e {
            Errno::ENOENT => Error::NotFound {
                name: name.to_owned(),
            },
            e => sys_err("shm_open", name, e),
        })?;
    trust::check(&file, name, trust)?;
    let len = file
        .metadata()
        .map_err(|e| Error::Os {
            op: "fstat",
            name: name.to_owned(),
            source: e,
        })?
        .len() as usize;
    Ok((pname, file, len))
}

/// Whether POSIX name `pname` still refers to `file`.
pub(super) fn still_named(pname: &str, file: &File) -> bool {
    let path = format!("/dev/shm{pname}");
    match (
        nix::sys::stat::stat(path.as_str()),
        nix::sys::stat::fstat(file.as_raw_fd()),
    ) {
        (Ok(a), Ok(b)) => (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino),
        _ => false,
    }
}

/// A read-only mapping of a whole segment ([`Segment::map_read_only`]),
/// unmapped on drop.
#[derive(Debug)]
pub(crate) struct ReadOnlyMap(Listed<MmapRaw>);

// SAFETY: as `Segment`: raw pointers only, to memory only read through it.
unsafe impl Send for ReadOnlyMap {}
// SAFETY: as `Send`.
unsafe impl Sync for ReadOnlyMap {}

impl ReadOnlyMap {
    /// Start of the mapping (page aligned).
    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.0.as_ptr()
    }
}

/// Which chunks of a sparse segment its writer has backed
/// ([`Segment::back`]), kept in the writer's memory: a write into a chunk
/// not yet backed backs it first, one `fallocate` per run of new chunks.
/// A reserved segment starts fully backed.
///
/// A store's backing is a prefix ([`Backing::prefix`]): a write backs
/// everything below it too, so one number says what is backed and the
/// writer publishes it for readers (`SegmentHeader::backed`), who refuse an
/// address past it before touching a byte (a read fault on a hole would
/// allocate a page, or raise SIGBUS on a full /dev/shm). That costs a store
/// nothing: its allocator fills the ring from the start on the first lap.
/// A channel's is not: its slots are as large as its largest message, and
/// a small message touches the start of its slot only.
#[derive(Debug)]
pub(crate) struct Backing {
    /// Bit i: chunk i (of [`Backing::CHUNK`] bytes) is backed.
    bits: Vec<u64>,
    len: u64,
    /// Chunks not backed yet: once none are (a reserved segment from the
    /// start, a sparse one after its first lap), `ensure` has nothing to
    /// look at.
    unbacked: u64,
    /// Whether every write backs all below it too ([`Backing::prefix`]).
    contiguous: bool,
    /// Chunks `0..leading` are all backed.
    leading: u64,
    /// Free bytes of /dev/shm that backing must leave ([`Backing::headroom`]).
    headroom: u64,
}

impl Backing {
    /// Bytes per chunk: small enough that a sparse segment costs about what
    /// its data touches, large enough that a stream of small writes makes
    /// few syscalls.
    pub(crate) const CHUNK: u64 = 64 << 10;

    /// The chunks of a `len`-byte segment, all backed or none.
    pub(crate) fn new(len: u64, backed: bool) -> Backing {
        let chunks = len.div_ceil(Self::CHUNK);
        let word = if backed { u64::MAX } else { 0 };
        Backing {
            bits: vec![word; chunks.div_ceil(64) as usize],
            len,
            unbacked: if backed { 0 } else { chunks },
            contiguous: false,
            leading: if backed { chunks } else { 0 },
            headroom: 0,
        }
    }

    /// As [`Backing::new`], backed as a prefix: a write backs every byte
    /// below it as well, so what is backed is always `0..backed()`.
    pub(crate) fn prefix(len: u64, backed: bool) -> Backing {
        Backing {
            contiguous: true,
            ..Backing::new(len, backed)
        }
    }

    /// Backs new pages only while /dev/shm keeps `bytes` free afterwards
    /// (else `NoSpace`, as when it is full): one `statvfs` per run of new
    /// chunks, none once everything is backed.
    pub(crate) fn headroom(mut self, bytes: u64) -> Backing {
        self.headroom = bytes;
        self
    }

    /// Bytes from the start of the file that are all backed.
    pub(crate) fn backed(&self) -> u64 {
        (self.leading * Self::CHUNK).min(self.len)
    }

    /// Records that `0..upto` is backed (by someone else: a background
    /// backer that allocated those pages itself). For a prefix backing;
    /// only whole chunks count, and the last, partial one once `upto`
    /// reaches the end.
    pub(crate) fn mark_prefix(&mut self, upto: u64) {
        let chunks = self.len.div_ceil(Self::CHUNK);
        let whole = if upto >= self.len {
            chunks
        } else {
            upto / Self::CHUNK
        };
        while self.leading < whole {
            if !self.is_backed(self.leading) {
                self.bits[(self.leading / 64) as usize] |= 1 << (self.leading % 64);
                self.unbacked -= 1;
            }
            self.leading += 1;
        }
    }

    fn is_backed(&self, chunk: u64) -> bool {
        self.bits[(chunk / 64) as usize] & (1 << (chunk % 64)) != 0
    }

    /// Backs whatever of `offset..offset + len` is not yet backed. On an
    /// error nothing is marked, so a later call tries again (once space
    /// is free).
    pub(crate) fn ensure(&mut self, seg: &Segment, offset: u64, len: u64) -> Result<()> {
        if len == 0 || self.unbacked == 0 {
            return Ok(());
        }
        let end = offset.saturating_add(len).min(self.len);
        // A prefix: everything below `leading` is backed, so start there
        // (not at 0: a large sparse ring has many chunks to skip).
        let offset = if self.contiguous {
            if end <= self.backed() {
                return Ok(());
            }
            self.leading * Self::CHUNK
        } else {
            offset
        };
        let (first, last) = (offset / Self::CHUNK, (end - 1) / Self::CHUNK);
        let mut c = first;
        while c <= last {
            if self.is_backed(c) {
                c += 1;
                continue;
            }
            let run_start = c;
            while c <= last && !self.is_backed(c) {
                c += 1;
            }
            let from = run_start * Self::CHUNK;
            let to = (c * Self::CHUNK).min(self.len);
            check_headroom(seg, to - from, self.headroom)?;
            seg.back(from, to - from)?;
            for k in run_start..c {
                self.bits[(k / 64) as usize] |= 1 << (k % 64);
            }
            self.unbacked -= c - run_start;
        }
        while self.leading * Self::CHUNK < self.len && self.is_backed(self.leading) {
            self.leading += 1;
        }
        Ok(())
    }
}

/// `Ok` if backing `bytes` more of `seg` leaves /dev/shm at least
/// `headroom` bytes free (always, for a headroom of 0: the kernel's
/// `ENOSPC` decides then); else the `NoSpace` error to report. One
/// `statvfs`.
pub(crate) fn check_headroom(seg: &Segment, bytes: u64, headroom: u64) -> Result<()> {
    if headroom == 0 {
        return Ok(());
    }
    let free = shm_free_bytes();
    if free < bytes.saturating_add(headroom) {
        let err = Error::NoSpace {
            name: seg.name().to_owned(),
            requested: bytes,
            available: free.saturating_sub(headroom),
        };
        tracing::debug!(%err, headroom, "not backing: /dev/shm is under the headroom");
        return Err(err);
    }
    Ok(())
}

fn reserve(file: &File, len: usize, name: &str, reserve_pages: bool) -> Result<()> {
    file.set_len(len as u64).map_err(|e| Error::Os {
        op: "ftruncate",
        name: name.to_owned(),
        source: e,
    })?;
    if !reserve_pages {
        return Ok(());
    }
    // posix_fallocate makes tmpfs hand out every page now, so running out of
    // /dev/shm is an error at create instead of a SIGBUS on some later write.
    match nix::fcntl::posix_fallocate(std::os::fd::AsRawFd::as_raw_fd(file), 0, len as i64) {
        Ok(()) => Ok(()),
        Err(Errno::ENOSPC) => Err(Error::NoSpace {
            name: name.to_owned(),
            requested: len as u64,
            available: shm_free_bytes(),
        }),
        // Filesystems without fallocate: the mapping still works, only the
        // early failure is lost.
        Err(Errno::EOPNOTSUPP) | Err(Errno::EINVAL) => Ok(()),
        Err(e) => Err(sys_err("posix_fallocate", name, e)),
    }
}

fn map(file: &File, len: usize, prefault: bool, name: &str) -> Result<Listed<MmapRaw>> {
    let map = Listed::map(|| MmapOptions::new().len(len).map_raw(file)).map_err(|e| Error::Os {
        op: "mmap",
        name: name.to_owned(),
        source: e,
    })?;
    if prefault {
        // After the registry's lock is released (faulting a large segment
        // in takes a while, and a fork would wait for it): the same read
        // faults `MAP_POPULATE` makes.
        // SAFETY: the mapping just made, whole.
        unsafe { populate(map.as_mut_ptr(), len) };
    }
    Ok(map)
}

#[cfg(test)]
#[path = "segment_tests.rs"]
mod tests;
