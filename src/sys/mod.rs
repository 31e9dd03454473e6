//! The operating system: POSIX shared memory, process liveness
//! (open-file-description locks), clocks and futexes; the only code that
//! calls nix and memmap2. Only the plain-data modules (dtype, layout,
//! error) sit below it.

pub(crate) mod clock;
pub(crate) mod fork;
pub(crate) mod futex;
pub(crate) mod liveness;
pub(crate) mod peek;
pub(crate) mod segment;
pub(crate) mod trust;

/// Free bytes in /dev/shm, for error messages (0 if unknown).
pub(crate) fn shm_free_bytes() -> u64 {
    nix::sys::statvfs::statvfs("/dev/shm")
        .map(|s| s.blocks_available() * s.fragment_size())
        .unwrap_or(0)
}
