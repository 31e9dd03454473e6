//! Layer 0: the operating system. POSIX shared memory, process liveness
//! (open-file-description locks), clocks and futexes; the only code that calls nix
//! and memmap2.

pub(crate) mod clock;
pub(crate) mod fork;
pub(crate) mod futex;
pub(crate) mod liveness;
pub(crate) mod segment;
