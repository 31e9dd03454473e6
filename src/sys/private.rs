//! Bytes of a segment made private to this process: a copy of a whole
//! file that is not ours ([`copy`], for the inspector), and a
//! copy-on-write view of one object's bytes ([`CowMap`], for a reader that
//! wants a tensor it may write).

use std::fs::File;
use std::os::fd::AsRawFd;

use memmap2::{MmapOptions, MmapRaw};

use super::listed::{page_size, populate, Listed};
use crate::error::{Error, Result};

/// A private, writable, copy-on-write mapping of `len` bytes of a segment:
/// it reads the segment's pages (no copy) until this process writes one,
/// and a write copies that page into memory only this process holds, so it
/// never reaches the segment, and is gone when the mapping is. Its pages
/// are mapped at creation (read faults, `MADV_POPULATE_READ`, on the
/// mapping while it is read-only; it is made writable after), so reading
/// it takes no fault.
///
/// It shows what the segment holds *now*: a byte the segment's writer
/// changes later shows through every page not yet written here. Its user
/// keeps the bytes from changing while it lives (a store reader holds the
/// slot: [`crate::store::PrivateView`]). Listed for fork like every
/// segment mapping: in a forked child it is inaccessible (reads fault).
#[derive(Debug)]
pub(crate) struct CowMap {
    /// None for zero bytes (nothing to map).
    map: Option<Listed<MmapRaw>>,
    /// Where the bytes start in the mapping (which starts on a page).
    skip: usize,
    len: usize,
}

// SAFETY: raw pointers only, to a mapping this value owns; what is written
// through it is this process's private copy, ordered by its user.
unsafe impl Send for CowMap {}
// SAFETY: as `Send`; `&CowMap` hands out pointers only.
unsafe impl Sync for CowMap {}

impl CowMap {
    /// Maps `offset..offset + len` of segment `name`'s `file` (`total`
    /// bytes long) privately, copy-on-write. The range must lie inside
    /// the segment (checked again here).
    pub(super) fn new(
        file: &File,
        name: &str,
        total: usize,
        offset: usize,
        len: usize,
    ) -> Result<CowMap> {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= total)
            .ok_or_else(|| {
                Error::CorruptObject(format!("{len} bytes at {offset}: past the segment"))
            })?;
        if len == 0 {
            return Ok(CowMap {
                map: None,
                skip: 0,
                len,
            });
        }
        let start = offset - offset % page_size();
        let os = |op: &'static str| {
            move |e: std::io::Error| Error::Os {
                op,
                name: name.to_owned(),
                source: e,
            }
        };
        // Read-only first, so that faulting the pages in maps the file's
        // pages instead of copying them (a populate of a writable private
        // mapping breaks copy-on-write page by page).
        let map = Listed::map(|| {
            // SAFETY: `file` is the segment's own open description (the
            // caller's), and a mapping outlives its descriptor; a private
            // mapping never writes the file.
            let ro = unsafe {
                MmapOptions::new()
                    .offset(start as u64)
                    .len(end - start)
                    .map_copy_read_only(file)
            }?;
            Ok(MmapRaw::from(ro))
        })
        .map_err(os("mmap"))?;
        // After the fork registry's lock is released (faulting a large
        // range in takes a while, and a fork would wait for it).
        // SAFETY: the mapping just made, whole; read faults change no byte.
        unsafe { populate(map.as_mut_ptr(), end - start) };
        // Writable now: a write faults once and copies its page, for this
        // mapping only.
        // SAFETY: mprotect of exactly the mapping made above, which this
        // value owns; no reference into it exists yet.
        let rw = unsafe {
            nix::libc::mprotect(
                map.as_mut_ptr().cast(),
                end - start,
                nix::libc::PROT_READ | nix::libc::PROT_WRITE,
            )
        };
        if rw != 0 {
            return Err(os("mprotect")(std::io::Error::last_os_error()));
        }
        Ok(CowMap {
            map: Some(map),
            skip: offset - start,
            len,
        })
    }

    /// The first byte (dangling, never read, for zero bytes).
    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        match &self.map {
            // In bounds: `skip + len` is the mapping's length.
            Some(m) => m.as_mut_ptr().wrapping_add(self.skip),
            None => std::ptr::NonNull::dangling().as_ptr(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

/// A copy of the first `len` bytes of `file` in memory no other process
/// holds (a memfd), to map where `file` itself must not be: its data
/// extents are copied with `pread` (holes stay holes), and whatever the
/// file's owner truncates meanwhile reads as zeros. Costs the memory of
/// the file's allocated pages, for as long as the copy is mapped.
pub(super) fn copy(file: &File, len: u64, name: &str) -> Result<File> {
    use std::os::unix::fs::FileExt;
    let os = |op: &'static str| {
        move |e: std::io::Error| Error::Os {
            op,
            name: name.to_owned(),
            source: e,
        }
    };
    // SAFETY: a plain syscall with a NUL-terminated name; the descriptor it
    // returns is ours alone and owned by the File made from it below.
    let fd = unsafe { nix::libc::memfd_create(c"pinshm-inspect".as_ptr(), nix::libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(os("memfd_create")(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just returned by memfd_create, and nothing else owns it.
    let copy = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    copy.set_len(len).map_err(os("ftruncate"))?;
    let src = file.as_raw_fd();
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    while at < len {
        // The next data extent (tmpfs answers SEEK_DATA/SEEK_HOLE; where a
        // filesystem cannot, all of it is data).
        // SAFETY: lseek on our own open descriptor; it reads no memory.
        let data = unsafe { nix::libc::lseek(src, at as i64, nix::libc::SEEK_DATA) };
        if data < 0 {
            match std::io::Error::last_os_error().raw_os_error() {
                Some(nix::libc::ENXIO) => break, // no data past `at`: holes, or truncated
                Some(nix::libc::EINVAL) => {}    // no SEEK_DATA: copy on
                _ => return Err(os("lseek")(std::io::Error::last_os_error())),
            }
        } else {
            at = (data as u64).max(at);
        }
        if at >= len {
            break;
        }
        // To the end of this extent: a hole's zeros are never written into
        // the copy (that would cost pages the file does not hold).
        // SAFETY: as above.
        let hole = unsafe { nix::libc::lseek(src, at as i64, nix::libc::SEEK_HOLE) };
        let extent_end = if hole > at as i64 { hole as u64 } else { len };
        let n = buf.len().min((extent_end.min(len) - at) as usize);
        let got = match file.read_at(&mut buf[..n], at) {
            Ok(0) => break, // truncated: the rest reads as zeros
            Ok(k) => k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(os("pread")(e)),
        };
        copy.write_all_at(&buf[..got], at).map_err(os("pwrite"))?;
        at += got as u64;
    }
    Ok(copy)
}
