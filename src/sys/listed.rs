//! Descriptors and mappings of segments, listed with `crate::sys::fork`
//! so that a forked child drops its copies at the fork ([`Listed`]), and
//! the page size they are made in.

use std::fs::File;
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, OwnedFd};

use std::sync::atomic::Ordering;

use memmap2::MmapRaw;

use crate::sys::fork;

/// A segment's descriptor or mapping, listed with `crate::sys::fork` (a
/// forked child's copy is dropped at the fork): opened or mapped, and
/// closed or unmapped, under the registry's lock, so a fork never sees it
/// half listed.
#[derive(Debug)]
pub(crate) struct Listed<T> {
    inner: ManuallyDrop<T>,
    token: fork::Token,
}

impl Listed<File> {
    pub(super) fn file(open: impl FnOnce() -> nix::Result<OwnedFd>) -> nix::Result<Listed<File>> {
        let mut held = fork::hold();
        let fd = open()?;
        let token = held.add_fd(fd.as_raw_fd());
        Ok(Listed {
            inner: ManuallyDrop::new(File::from(fd)),
            token,
        })
    }
}

impl Listed<MmapRaw> {
    pub(super) fn map(
        map: impl FnOnce() -> std::io::Result<MmapRaw>,
    ) -> std::io::Result<Listed<MmapRaw>> {
        let mut held = fork::hold();
        let m = map()?;
        let token = held.add_map(m.as_ptr(), m.len());
        Ok(Listed {
            inner: ManuallyDrop::new(m),
            token,
        })
    }
}

impl<T> std::ops::Deref for Listed<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<T> Drop for Listed<T> {
    fn drop(&mut self) {
        let mut held = fork::hold();
        // SAFETY: dropped exactly once, here; `inner` is not used after.
        unsafe { ManuallyDrop::drop(&mut self.inner) };
        held.forget(&self.token);
    }
}

/// The system's page size (4096 if unknown).
pub(crate) fn page_size() -> usize {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .unwrap_or(4096) as usize
}

/// Faults every page of `ptr..ptr + len` in (read faults, changing no
/// byte): `MADV_POPULATE_READ` (Linux 5.14); on older kernels one relaxed
/// atomic load per page.
///
/// # Safety
/// `ptr..ptr + len` is a live mapping of this process.
pub(crate) unsafe fn populate(ptr: *mut u8, len: usize) {
    // SAFETY: ptr..ptr+len is a live mapping (the caller's promise); the
    // advice only faults its pages in and changes no byte.
    let r = unsafe { nix::libc::madvise(ptr.cast(), len, nix::libc::MADV_POPULATE_READ) };
    if r == 0 {
        return;
    }
    for off in (0..len).step_by(page_size()) {
        // SAFETY: in bounds of the live mapping; other processes may
        // write these bytes, so the load is atomic (u8 needs no
        // alignment).
        let b = unsafe { &*(ptr.add(off) as *const std::sync::atomic::AtomicU8) };
        b.load(Ordering::Relaxed);
    }
}
