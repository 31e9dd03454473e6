//! Segments this process did not make, looked at without mapping them.
//!
//! A mapping of a file someone else can truncate is a SIGBUS waiting for
//! its owner: a squatter who pre-creates a store's name and keeps
//! switching its size between 1 MiB and 0 kills whoever maps it and reads.
//! So a file is checked for owner and mode before anything else
//! ([`trust::check`]), and then read with `pread` ([`Peek`]), which reads
//! zeros past the end, or copied into memory no one else holds before it is
//! mapped (`Segment::open_read_only`, for the inspector). Replacing a dead writer's
//! segment ([`remove_if_abandoned`]), garbage collection and inspection all
//! go through here.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};

use nix::fcntl::OFlag;

use crate::error::{Error, Result};
use crate::sys::listed::Listed;
use crate::sys::liveness;
use crate::sys::segment::{open_any_size, still_named, sys_err, Segment};
use crate::sys::trust::{self, Trust};

/// Removes segment `name` if its file is one `trust` accepts, `recognise`
/// accepts it and nobody holds its writer lock; `Ok` also when it went (or
/// was replaced) meanwhile, so the caller creates again. The file is never
/// mapped ([`Peek`]).
pub(crate) fn remove_if_abandoned(
    name: &str,
    trust: Trust,
    recognise: &impl Fn(&Peek) -> std::result::Result<String, String>,
) -> Result<()> {
    let in_use = |detail: String| Error::InUse {
        name: name.to_owned(),
        detail,
    };
    let untrusted = |detail: String| Error::Untrusted {
        name: name.to_owned(),
        detail: format!(
            "{detail}; a file of someone else's at the name is neither mapped nor replaced: \
             remove /dev/shm/{name}, or use another name"
        ),
    };
    // Opened to write (its writer lock is taken below); a file this user
    // may not open so is another user's, and said to be.
    let seg = match Peek::open(name, true, Trust::AnyOwner) {
        Ok(s) => s,
        Err(Error::NotFound { .. }) => return Ok(()), // gone meanwhile
        Err(Error::Os { source, .. }) if source.raw_os_error() == Some(nix::libc::EACCES) => {
            let who = Peek::open(name, false, Trust::AnyOwner)
                .and_then(|p| p.ownership())
                .map(|o| format!("uid {} (mode {:04o})", o.uid, o.mode))
                .unwrap_or_else(|_| "another user".to_owned());
            return Err(untrusted(format!(
                "it belongs to {who}, and this process may not open it to write"
            )));
        }
        Err(e) => return Err(e),
    };
    // Owner and mode before a byte of it is read.
    match trust::check(&seg.file, name, trust) {
        Err(Error::Untrusted { detail, .. }) => return Err(untrusted(detail)),
        Err(e) => return Err(e),
        Ok(_) => {}
    }
    // Empty: its creator is still sizing it (a live one, or it would not
    // be empty for long); not ours to remove.
    if seg.len() == 0 {
        return Err(in_use(format!(
            "it is being created (empty); if nobody is, remove /dev/shm/{name}"
        )));
    }
    let label = recognise(&seg).map_err(|why| {
        in_use(format!(
            "it exists and is not {why}; remove /dev/shm/{name} if no process uses it"
        ))
    })?;
    // Taking the dead writer's lock ourselves both proves that no writer
    // holds it and keeps out anyone else replacing the same segment.
    if !seg.try_lock(liveness::WRITER_SLOT)? {
        return Err(in_use(format!(
            "its writer{label} is alive: it holds the writer lock"
        )));
    }
    if !still_named(&seg.name, &seg.file) {
        return Ok(()); // replaced (or removed) meanwhile: create again
    }
    tracing::warn!(
        name,
        label,
        "replacing the segment of a writer that is gone"
    );
    // Unlinked while we hold its lock: nobody else can be unlinking a newer
    // segment of the name on the strength of this one's death.
    let r = match Segment::unlink(name) {
        Ok(()) | Err(Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(e),
    };
    drop(seg);
    r
}

/// An open segment file that is looked at, never mapped: its first bytes
/// are copied out with `pread`, so a file whose owner truncates it
/// meanwhile (another user's, at a name this process wants) reads as
/// zeros past its end instead of raising SIGBUS in this process.
#[derive(Debug)]
pub(crate) struct Peek {
    name: String,
    file: Listed<File>,
    len: u64,
}

impl Peek {
    /// Opens `name` (read-write with `write`: to take its writer lock) if
    /// `trust` accepts its file ([`trust::check`], before anything is read).
    /// Its size may be 0 (a file being sized, or truncated).
    pub(crate) fn open(name: &str, write: bool, trust: Trust) -> Result<Peek> {
        let flags = if write {
            OFlag::O_RDWR
        } else {
            OFlag::O_RDONLY
        };
        let (pname, file, len) = open_any_size(name, flags, trust)?;
        Ok(Peek {
            name: pname,
            file,
            len: len as u64,
        })
    }

    /// The file's size when it was opened.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Up to `n` bytes from `offset` (fewer where the file is shorter now):
    /// `pread`, never a mapping.
    pub(crate) fn read(&self, offset: u64, n: usize) -> Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let mut buf = vec![0u8; n];
        let mut got = 0;
        while got < n {
            match self.file.read_at(&mut buf[got..], offset + got as u64) {
                Ok(0) => break,
                Ok(k) => got += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(Error::Os {
                        op: "pread",
                        name: self.name[1..].to_owned(),
                        source: e,
                    })
                }
            }
        }
        buf.truncate(got);
        Ok(buf)
    }

    /// The first word (0 where the file is shorter now).
    pub(crate) fn magic(&self) -> u64 {
        match self.read(0, 8) {
            Ok(b) if b.len() == 8 => {
                u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
            }
            _ => 0,
        }
    }

    /// The (device, inode) of the file.
    pub(crate) fn identity(&self) -> Option<(u64, u64)> {
        let st = nix::sys::stat::fstat(self.file.as_raw_fd()).ok()?;
        Some((st.st_dev, st.st_ino))
    }

    /// Whose the file is.
    pub(crate) fn ownership(&self) -> Result<trust::Ownership> {
        trust::check(&self.file, &self.name[1..], Trust::AnyOwner)
    }

    /// Bytes of /dev/shm the file holds (allocated blocks).
    pub(crate) fn allocated(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        self.file
            .metadata()
            .map(|m| m.blocks().saturating_mul(512))
            .unwrap_or(0)
    }

    /// Takes liveness lock `slot` (needs [`Peek::open`] with `write`).
    pub(crate) fn try_lock(&self, slot: u32) -> Result<bool> {
        liveness::try_lock(self.file.as_fd(), slot)
            .map_err(|e| sys_err("fcntl(F_OFD_SETLK)", &self.name[1..], e))
    }

    /// Whether another handle (a live process) holds liveness lock `slot`;
    /// "cannot tell" is "alive".
    pub(crate) fn held_by_other(&self, slot: u32) -> bool {
        liveness::held_by_other(self.file.as_fd(), slot)
    }
}

impl Segment {
    /// Creates `name` as [`Segment::create`] does; with `replace`, a
    /// segment of that name whose writer is gone is replaced first. "Gone"
    /// is decided by the writer's liveness lock (`liveness::WRITER_SLOT`),
    /// and `recognise` must accept the old segment as one of ours (it
    /// returns how to name its writer in messages, e.g. " (pid 12)", or
    /// what it is not). Several
    /// processes may replace the same dead segment at once: exactly one
    /// creates the name anew, the others get `InUse`. Only a segment of
    /// this process's user (or a trusted one's, see [`trust`]) is replaced,
    /// and it is looked at without mapping it ([`Peek`]): a file someone
    /// else made under the name (a squatter's) is [`Error::Untrusted`],
    /// naming its owner and mode, whatever its size does meanwhile.
    pub(crate) fn create_replacing(
        name: &str,
        len: usize,
        prefault: bool,
        reserve_pages: bool,
        replace: bool,
        recognise: impl Fn(&Peek) -> std::result::Result<String, String>,
    ) -> Result<Segment> {
        let mut tries = 0;
        loop {
            match Segment::create(name, len, prefault, reserve_pages) {
                Err(Error::AlreadyExists { .. }) if replace && tries < 8 => {
                    tries += 1;
                    remove_if_abandoned(name, Trust::Owner, &recognise)?;
                }
                r => return r,
            }
        }
    }
}
