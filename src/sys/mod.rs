//! The operating system: POSIX shared memory, process liveness
//! (open-file-description locks), clocks and futexes; the only code that
//! calls nix and memmap2. Only the plain-data modules (dtype, layout,
//! error) sit below it.

pub(crate) mod clock;
pub(crate) mod fork;
pub(crate) mod futex;
pub(crate) mod listed;
pub(crate) mod liveness;
pub(crate) mod peek;
pub(crate) mod private;
pub(crate) mod segment;
pub(crate) mod trust;

/// Refuses a segment of `total` bytes that this machine could never back:
/// larger than both /dev/shm's size and its memory (`what` names the
/// arguments that made it, for the message). Where neither can be read,
/// anything goes (the kernel says no later).
pub(crate) fn check_segment_size(total: u64, what: &str) -> crate::error::Result<()> {
    let shm = nix::sys::statvfs::statvfs("/dev/shm")
        .map(|s| s.blocks() * s.fragment_size())
        .unwrap_or(0);
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .unwrap_or(0) as u64;
    // SAFETY: sysconf with a constant name reads no memory of ours.
    let pages = unsafe { nix::libc::sysconf(nix::libc::_SC_PHYS_PAGES) }.max(0) as u64;
    let limit = shm.max(pages.saturating_mul(page));
    if limit == 0 || total <= limit {
        return Ok(());
    }
    Err(crate::error::Error::InvalidConfig(format!(
        "{what} makes a segment of {total} bytes, more than this machine could ever back \
         ({limit} bytes: /dev/shm holds {shm}, memory {}); use at most {limit}",
        pages.saturating_mul(page)
    )))
}

/// Free bytes in /dev/shm, for error messages (0 if unknown).
pub(crate) fn shm_free_bytes() -> u64 {
    nix::sys::statvfs::statvfs("/dev/shm")
        .map(|s| s.blocks_available() * s.fragment_size())
        .unwrap_or(0)
}
