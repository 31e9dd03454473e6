//! Which process a handle belongs to, across `fork`.
//!
//! A forked child inherits every mapping and every open file description of
//! its parent, and with them the parent's liveness locks (they belong to
//! the description, not the pid). A child that used or dropped an
//! inherited `StoreReader` or `ObjectStore` as its own would release the
//! parent's lock, clear the parent's hazard words or unlink the parent's
//! segment. So each handle records the fork generation it was made in, and
//! in any other generation it touches nothing shared.
//!
//! The generation is a counter that a `pthread_atfork` child handler bumps:
//! libc's `fork` (Rust's, Python's `os.fork`, multiprocessing's fork start
//! method) runs it in every child. Checking it is one relaxed load, where a
//! pid check would be a system call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

use nix::libc;

static GENERATION: AtomicU64 = AtomicU64::new(0);

extern "C" fn in_child() {
    // Async-signal-safe: one atomic add.
    GENERATION.fetch_add(1, Ordering::Relaxed);
}

/// This process's fork generation, registering the handler on first use
/// (call it before any handle exists, then compare with [`current`]).
pub fn register() -> u64 {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: `in_child` is an `extern "C" fn()` that lives forever and
        // only does an atomic add, which is safe in a forked child.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
        if rc != 0 {
            tracing::warn!(
                rc,
                "pthread_atfork failed: forked children are not told apart"
            );
        }
    });
    current()
}

/// The fork generation now: differs from [`register`]'s answer in a
/// process forked since.
pub fn current() -> u64 {
    GENERATION.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forked_child_sees_another_generation() {
        let g = register();
        assert_eq!(current(), g);
        // SAFETY: the child only reads an atomic and exits with _exit.
        match unsafe { nix::unistd::fork() }.unwrap() {
            nix::unistd::ForkResult::Child => {
                let code = if current() != g { 0 } else { 1 };
                // SAFETY: _exit ends the child at once, running nothing else.
                unsafe { libc::_exit(code) };
            }
            nix::unistd::ForkResult::Parent { child } => {
                let status = nix::sys::wait::waitpid(child, None).unwrap();
                assert_eq!(status, nix::sys::wait::WaitStatus::Exited(child, 0));
                assert_eq!(current(), g, "the parent's generation is unchanged");
            }
        }
    }
}
