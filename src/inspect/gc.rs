//! What dead writers left in /dev/shm, found and removed (`pinshm gc`,
//! `python -m pinshm gc`), as iceoryx2's stale-resource cleanup does.
//!
//! A pinshm segment is one whose first word is a store's or a channel's
//! magic ([`layout::MAGIC`], `layout::channel::MAGIC`): its
//! creator takes the writer's liveness lock before it stamps the magic
//! (stores and channels alike), so a stamped segment whose writer lock
//! nobody holds has a writer that is gone: it died, or exited without
//! removing the name. Only such segments are listed, and each removal is
//! made while holding that lock (taken here, which proves nobody else
//! holds it), after checking that the name still names the segment looked
//! at. A segment whose writer lives, one being created (not stamped yet),
//! and every file that is not a pinshm segment are left alone; "cannot
//! tell" counts as alive.
//!
//! Readers that still map a removed segment keep reading what it holds:
//! removing a name frees the memory only once the last mapping goes.

use std::os::unix::fs::MetadataExt;

use crate::error::{Error, Result};
use crate::geometry::validate_store_bytes;
use crate::layout;
use crate::sys::liveness;
use crate::sys::peek::{remove_if_abandoned, Peek};
use crate::sys::trust::Trust;

/// A segment whose writer is gone.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Abandoned {
    /// Its name, as in /dev/shm/NAME.
    pub name: String,
    /// `store` or `channel`.
    pub kind: &'static str,
    /// Bytes of /dev/shm it holds (allocated blocks, not its nominal size).
    pub bytes: u64,
    /// The dead writer's pid, where the segment records it (stores).
    pub writer_pid: Option<u32>,
    /// Whose file it is (its owner's uid).
    pub owner_uid: u32,
    /// Whether this call removed it (false for a dry run, or when it was
    /// replaced or removed by someone else meanwhile).
    pub removed: bool,
}

/// Lists (`dry_run`) or removes the segments in /dev/shm whose name starts
/// with `prefix` (every one for `""`) and whose writer is gone.
pub fn gc(prefix: &str, dry_run: bool) -> Result<Vec<Abandoned>> {
    let dir = std::fs::read_dir("/dev/shm").map_err(|e| Error::Os {
        op: "read_dir",
        name: "/dev/shm".into(),
        source: e,
    })?;
    let mut names: Vec<String> = dir
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix))
        .collect();
    names.sort();
    let mut out = Vec::new();
    for name in names {
        match examine(&name, dry_run) {
            Ok(Some(a)) => out.push(a),
            Ok(None) => {}
            // Gone meanwhile, or not ours to open (another user's): skip.
            Err(e) => tracing::debug!(name, %e, "gc: left alone"),
        }
    }
    Ok(out)
}

/// `Some` if `name` is a pinshm segment whose writer is gone (removed
/// unless `dry_run`).
fn examine(name: &str, dry_run: bool) -> Result<Option<Abandoned>> {
    let path = format!("/dev/shm/{name}");
    // Read with pread, never through a mapping: a read fault on a hole of
    // a sparse file would allocate a page (SIGBUS on a full /dev/shm), and
    // anyone's file may be truncated under a mapping by its owner (SIGBUS
    // again); pread reads zeros past the end and in holes. Never blocking
    // (a FIFO), never through a symlink; anyone's file.
    let seg = Peek::open(name, false, Trust::AnyOwner)?;
    let owner_uid = seg.ownership()?.uid;
    let magic = seg.magic();
    if !is_magic(magic) {
        return Ok(None);
    }
    let bytes = seg.allocated();
    if seg.held_by_other(liveness::WRITER_SLOT) {
        return Ok(None); // its writer lives (or we cannot tell)
    }
    let (kind, writer_pid) = if magic == layout::channel::MAGIC {
        ("channel", None)
    } else {
        let header = seg
            .read(0, size_of::<layout::SegmentHeader>())
            .and_then(|b| validate_store_bytes(&b, seg.len(), name));
        match header {
            Ok(h) => ("store", Some(h.writer_pid)),
            // Stamped by a writer of another layout version: still ours.
            Err(_) => ("store", None),
        }
    };
    drop(seg);
    let mut a = Abandoned {
        name: name.to_owned(),
        kind,
        bytes,
        writer_pid,
        owner_uid,
        removed: false,
    };
    if !dry_run {
        let before = inode(&path);
        // Takes the writer lock itself (so the writer is gone, and nobody
        // else removes it at once), checks the name, unlinks.
        remove_if_abandoned(name, Trust::AnyOwner, &|s: &Peek| {
            if is_magic(s.magic()) {
                Ok(String::new())
            } else {
                Err("a pinshm segment".to_owned())
            }
        })?;
        a.removed = before.is_some() && inode(&path) != before;
    }
    Ok(Some(a))
}

fn is_magic(word: u64) -> bool {
    word == layout::MAGIC || word == layout::channel::MAGIC
}

/// Removes segment `name` if the name still names the file (`dev`,
/// `ino`) and no live writer holds it; whether that file left the name.
///
/// What a process's reaper runs, after that process died, for each segment
/// it made: never another segment of the same name (another engine's live
/// store made after the death), never one whose writer lives.
pub fn remove_if_abandoned_file(name: &str, dev: u64, ino: u64) -> Result<bool> {
    let path = format!("/dev/shm/{name}");
    let same = || {
        std::fs::symlink_metadata(&path)
            .map(|m| (m.dev(), m.ino()) == (dev, ino))
            .unwrap_or(false)
    };
    if !same() {
        return Ok(false);
    }
    remove_if_abandoned(name, Trust::Owner, &|s: &Peek| {
        if s.identity() == Some((dev, ino)) {
            Ok(String::new())
        } else {
            Err("the segment this process made".to_owned())
        }
    })?;
    Ok(!same())
}

fn inode(path: &str) -> Option<u64> {
    std::fs::metadata(path).ok().map(|m| m.ino())
}
