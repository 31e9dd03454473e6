//! Process liveness the kernel guarantees: open-file-description locks.
//!
//! Each live party of a segment (the writer, each attached reader) holds an
//! `F_OFD_SETLK` write lock on one byte of the segment file, at
//! [`LOCK_BASE`] + its slot. Such a lock belongs to the open file
//! description, not to a pid: the kernel drops it when the last descriptor
//! of that description closes, which a process that dies (even by SIGKILL)
//! always does. Nobody polls `/proc`, a recycled pid means nothing, and it
//! works across PID namespaces (containers sharing `/dev/shm`): the lock is
//! on the tmpfs inode both of them map.
//!
//! Asking ([`held_by_other`]) is one `F_OFD_GETLK` on a descriptor the asker
//! already has open, so it needs no new file descriptor and works when the
//! asker's descriptor table is full. It fails closed: only the kernel's
//! explicit "unlocked" answer means gone; an error means alive.
//!
//! A description never conflicts with its own locks, so a process cannot ask
//! about a lock through the descriptor that holds it (it would always read
//! "unlocked"); each `Segment` opens its own description, so the writer and
//! a reader in one process still see each other.

use std::os::fd::{AsRawFd, BorrowedFd};

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg};
use nix::libc;

/// First lock byte: far beyond any data (locks need no backing bytes), so
/// lock ranges never mean anything about the mapping's contents.
pub(crate) const LOCK_BASE: i64 = 1 << 62;

/// The writer's lock slot.
pub(crate) const WRITER_SLOT: u32 = 0;

/// Reader `i`'s lock slot.
pub(crate) const fn reader_slot(i: u32) -> u32 {
    1 + i
}

fn flock(kind: libc::c_int, slot: u32) -> libc::flock {
    // SAFETY: `flock` is a plain C struct; all-zero is a valid value (and
    // l_pid must be 0 for OFD locks).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = LOCK_BASE + slot as i64;
    fl.l_len = 1;
    fl
}

/// Takes the lock of `slot` for this open file description. `Ok(false)`: a
/// different description (a live process) holds it.
pub(crate) fn try_lock(fd: BorrowedFd<'_>, slot: u32) -> nix::Result<bool> {
    let fl = flock(libc::F_WRLCK, slot);
    match fcntl(fd.as_raw_fd(), FcntlArg::F_OFD_SETLK(&fl)) {
        Ok(_) => Ok(true),
        Err(Errno::EAGAIN) | Err(Errno::EACCES) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Gives up the lock of `slot` (closing the descriptor does it too).
pub(crate) fn unlock(fd: BorrowedFd<'_>, slot: u32) -> nix::Result<()> {
    let fl = flock(libc::F_UNLCK, slot);
    fcntl(fd.as_raw_fd(), FcntlArg::F_OFD_SETLK(&fl)).map(drop)
}

/// Whether another open file description holds the lock of `slot`: whether
/// its holder is alive. Fails closed: anything but the kernel's "unlocked"
/// counts as held.
pub(crate) fn held_by_other(fd: BorrowedFd<'_>, slot: u32) -> bool {
    // Asking about a read lock works through a read-only descriptor too (the
    // inspector's) and conflicts with the holders' write locks.
    let mut fl = flock(libc::F_RDLCK, slot);
    match fcntl(fd.as_raw_fd(), FcntlArg::F_OFD_GETLK(&mut fl)) {
        Ok(_) => fl.l_type != libc::F_UNLCK as libc::c_short,
        Err(e) => {
            tracing::debug!(%e, slot, "F_OFD_GETLK failed; counting the holder as alive");
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::OpenOptions;
    use std::os::fd::AsFd;

    fn temp_file(tag: &str) -> (std::path::PathBuf, std::fs::File) {
        let path =
            std::env::temp_dir().join(format!("pinshm-liveness-{tag}-{}", std::process::id()));
        let f = OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        (path, f)
    }

    #[test]
    fn a_lock_is_seen_by_another_description_until_it_closes() {
        let (path, a) = temp_file("seen");
        let b = OpenOptions::new().read(true).open(&path).unwrap();
        let c = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(!held_by_other(b.as_fd(), 3));
        assert!(try_lock(a.as_fd(), 3).unwrap());
        // Its own description never conflicts; others do, read-only ones too.
        assert!(!held_by_other(a.as_fd(), 3));
        assert!(held_by_other(b.as_fd(), 3));
        assert!(
            !try_lock(c.as_fd(), 3).unwrap(),
            "a second taker is refused"
        );
        assert!(!held_by_other(b.as_fd(), 4), "slots are independent");
        drop(a);
        assert!(!held_by_other(b.as_fd(), 3), "closing releases the lock");
        assert!(try_lock(c.as_fd(), 3).unwrap());
        unlock(c.as_fd(), 3).unwrap();
        assert!(!held_by_other(b.as_fd(), 3));
    }
}
