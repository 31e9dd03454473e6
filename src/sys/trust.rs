//! Whose segments this process attaches to.
//!
//! `/dev/shm` is shared by every user of the host (and by containers run
//! with `--ipc=host`): a name is only a name, and whoever made the file
//! under it decides what a reader reads. So a segment opened by name is
//! used only if it is a regular file (a FIFO would block its opener for
//! ever; it is opened `O_NONBLOCK`, never through a symlink), owned by this
//! process's effective uid or by a uid it was told to trust
//! ([`TRUSTED_UIDS_ENV`]), and writable by no one else: not by others
//! ever, not by its group unless its owner is trusted on purpose (sharing
//! a store between two users goes through a group). Root is not exempt.
//!
//! Inspection and garbage collection look at anyone's segments (read-only,
//! saying whose they are): [`Trust::AnyOwner`].

use std::fs::File;
use std::os::unix::fs::{FileTypeExt, MetadataExt};

use crate::error::{Error, Result};

/// The environment variable naming the uids, besides this process's own,
/// whose segments it attaches to: `PINSHM_TRUSTED_UIDS=1000,1001`.
pub(crate) const TRUSTED_UIDS_ENV: &str = "PINSHM_TRUSTED_UIDS";

/// Whose segment an open accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Trust {
    /// This process's effective uid, or one of [`TRUSTED_UIDS_ENV`].
    Owner,
    /// Anyone's regular file (inspection, garbage collection).
    AnyOwner,
}

/// The owner and mode of a segment's file, as `fstat` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ownership {
    /// The owner's uid.
    pub uid: u32,
    /// The group's gid.
    pub gid: u32,
    /// Permission bits (`0o600`).
    pub mode: u32,
}

/// The uids [`TRUSTED_UIDS_ENV`] names (entries that are not numbers are
/// ignored, with a debug line).
pub(crate) fn trusted_uids() -> Vec<u32> {
    let Ok(text) = std::env::var(TRUSTED_UIDS_ENV) else {
        return Vec::new();
    };
    text.split(',')
        .filter(|s| !s.trim().is_empty())
        .filter_map(|s| match s.trim().parse::<u32>() {
            Ok(uid) => Some(uid),
            Err(_) => {
                tracing::debug!(entry = s, "{TRUSTED_UIDS_ENV}: not a uid, ignored");
                None
            }
        })
        .collect()
}

/// Checks the file just opened for segment `name` against `trust`; its
/// owner and mode. [`Error::Untrusted`] says why not, naming the owner and
/// the mode, and what to do.
pub(crate) fn check(file: &File, name: &str, trust: Trust) -> Result<Ownership> {
    let meta = file.metadata().map_err(|e| Error::Os {
        op: "fstat",
        name: name.to_owned(),
        source: e,
    })?;
    let own = Ownership {
        uid: meta.uid(),
        gid: meta.gid(),
        mode: meta.mode() & 0o7777,
    };
    let untrusted = |detail: String| Error::Untrusted {
        name: name.to_owned(),
        detail,
    };
    let kind = meta.file_type();
    if !kind.is_file() {
        let what = if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_dir() {
            "a directory"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "a device or other special file"
        };
        return Err(untrusted(format!(
            "it is {what} (owner uid {}), not a shared memory segment",
            own.uid
        )));
    }
    if trust == Trust::AnyOwner {
        return Ok(own);
    }
    let me = nix::unistd::geteuid().as_raw();
    let trusted = own.uid == me || trusted_uids().contains(&own.uid);
    if !trusted {
        return Err(untrusted(format!(
            "it belongs to uid {} (mode {:04o}), not to this process's user (uid {me}); \
             if that user's segments are to be read on purpose, set {TRUSTED_UIDS_ENV}={}",
            own.uid, own.mode, own.uid
        )));
    }
    let group_ok = own.uid != me; // a trusted other user shares through a group
    if own.mode & 0o002 != 0 || (own.mode & 0o020 != 0 && !group_ok) {
        return Err(untrusted(format!(
            "uid {} made it writable by {} (mode {:04o}): anyone could have changed it; \
             remove it if no process of yours uses it",
            own.uid,
            if own.mode & 0o002 != 0 {
                "everyone"
            } else {
                "its group"
            },
            own.mode
        )));
    }
    Ok(own)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn file_with_mode(mode: u32) -> (tempfile_path::Tmp, File) {
        let t = tempfile_path::Tmp::new();
        let f = File::create(&t.0).unwrap();
        std::fs::set_permissions(&t.0, std::fs::Permissions::from_mode(mode)).unwrap();
        (t, f)
    }

    mod tempfile_path {
        pub(super) struct Tmp(pub(super) std::path::PathBuf);
        impl Tmp {
            pub(super) fn new() -> Tmp {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let n = N.fetch_add(1, Ordering::Relaxed);
                Tmp(std::env::temp_dir().join(format!("pinshm-trust-{}-{n}", std::process::id())))
            }
        }
        impl Drop for Tmp {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
    }

    #[test]
    fn own_file_of_mode_0600_is_trusted_and_writable_by_others_is_not() {
        let (_t, f) = file_with_mode(0o600);
        let own = check(&f, "x", Trust::Owner).unwrap();
        assert_eq!(own.mode, 0o600);
        for mode in [0o666, 0o620, 0o602] {
            let (_t, f) = file_with_mode(mode);
            let e = check(&f, "x", Trust::Owner).unwrap_err().to_string();
            assert!(e.contains("writable by"), "{mode:o}: {e}");
            assert!(
                check(&f, "x", Trust::AnyOwner).is_ok(),
                "inspection still reads it"
            );
        }
    }

    #[test]
    fn a_directory_is_no_segment_for_anyone() {
        let dir = std::env::temp_dir();
        let f = File::open(&dir).unwrap();
        for trust in [Trust::Owner, Trust::AnyOwner] {
            let e = check(&f, "x", trust).unwrap_err().to_string();
            assert!(e.contains("a directory"), "{e}");
        }
    }
}
