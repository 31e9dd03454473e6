//! Which process a handle belongs to, across `fork`, and what a forked child
//! must not keep of its parent's segments.
//!
//! A forked child inherits every mapping and every open file description of
//! its parent, and with them the parent's liveness locks (they belong to
//! the description, not the pid). Two things follow, and this module
//! answers both:
//!
//! - **Handles.** A child that used or dropped an inherited `StoreReader`
//!   or `ObjectStore` as its own would release the parent's lock, clear the
//!   parent's hazard words or unlink the parent's segment. So each handle
//!   records the fork generation it was made in, and in any other
//!   generation it touches nothing shared. The generation is a counter that
//!   the `pthread_atfork` child handler bumps: libc's `fork` (Rust's,
//!   Python's `os.fork`, multiprocessing's fork start method) runs it in
//!   every child. Checking it is one relaxed load, where a pid check would
//!   be a system call.
//! - **Liveness and bytes.** A lock dies only when the *last* reference to
//!   its open file description goes, and a child's inherited descriptor and
//!   inherited mapping are such references: a child that does nothing with
//!   pinshm would keep a killed parent alive in everyone's eyes, and a
//!   guard, view or array it inherited would go on reading a slot the
//!   writer has since reused. So every segment registers its descriptor and
//!   its mappings here ([`hold`]), and the child handler drops the child's
//!   references to all of them before the child runs a line of its own:
//!   each descriptor is replaced (`dup3`, same number) by one on
//!   `/dev/null`, and each mapping by an inaccessible anonymous one at the
//!   same address (`mmap(MAP_FIXED, PROT_NONE)`). The address range stays
//!   reserved, so an inherited pointer faults (SIGSEGV) instead of reading
//!   whatever the child maps there later; the handle's own drop still
//!   unmaps and closes exactly what it owns.
//!
//! The registry is a spin lock and a list. The prepare handler takes the
//! lock, so no fork happens while a segment is half registered (opened but
//! not yet listed, or unmapped but still listed); the parent handler
//! releases it, the child handler releases it after clearing the list.
//! Every section under the lock is a few system calls, none of which
//! waits for another process.

use std::cell::UnsafeCell;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Once;

use nix::libc;

static GENERATION: AtomicU64 = AtomicU64::new(0);

/// What a segment handle owns that a child must not keep.
#[derive(Clone, Copy, Debug)]
enum Inherited {
    /// A descriptor of a segment's open file description.
    Fd(RawFd),
    /// A mapping of a segment: `len` bytes at `addr`.
    Map { addr: usize, len: usize },
}

struct Registry {
    locked: AtomicBool,
    /// Only touched with `locked` held.
    entries: UnsafeCell<Vec<(u64, Inherited)>>,
    /// Only touched with `locked` held.
    next: UnsafeCell<u64>,
}

// SAFETY: `entries` and `next` are only reached through a `Held`, which
// exists only while `locked` is held (or, in the fork handlers, while the
// prepare handler's hold is still in force).
unsafe impl Sync for Registry {}

static REGISTRY: Registry = Registry {
    locked: AtomicBool::new(false),
    entries: UnsafeCell::new(Vec::new()),
    next: UnsafeCell::new(0),
};

fn lock() {
    while REGISTRY
        .locked
        .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        std::hint::spin_loop();
        // SAFETY: a plain system call, async-signal-safe (the prepare
        // handler spins here too).
        unsafe { libc::sched_yield() };
    }
}

fn unlock() {
    REGISTRY.locked.store(false, Ordering::Release);
}

extern "C" fn before_fork() {
    lock();
}

extern "C" fn in_parent() {
    unlock();
}

extern "C" fn in_child() {
    // Async-signal-safe: atomics and raw system calls, no allocation (the
    // list is cleared in place, its elements are `Copy`).
    GENERATION.fetch_add(1, Ordering::Relaxed);
    // SAFETY: the prepare handler took the lock in the thread that forked,
    // which is this one; no other thread exists in the child.
    let entries = unsafe { &mut *REGISTRY.entries.get() };
    // Opened here, not once for the process: code that closes descriptors
    // it does not own (a daemonising library, `os.closerange`) could have
    // closed a kept one, and its number be another file's by now.
    let spare = if entries.iter().any(|(_, w)| matches!(w, Inherited::Fd(_))) {
        open_spare()
    } else {
        -1
    };
    for &(_, what) in entries.iter() {
        match what {
            Inherited::Fd(fd) if spare >= 0 => {
                // SAFETY: `fd` is open (its handle closes it only under the
                // lock, after removing it from the list); dup3 atomically
                // makes that number refer to the spare description instead,
                // so the handle's later close still closes its own number.
                unsafe { libc::dup3(spare, fd, libc::O_CLOEXEC) };
            }
            Inherited::Fd(_) => {}
            Inherited::Map { addr, len } => {
                // SAFETY: addr..addr+len is a mapping of ours (its handle
                // unmaps it only under the lock, after removing it); the new
                // anonymous mapping replaces it in place, so nothing else of
                // the child's is touched, and nothing reads it: PROT_NONE.
                unsafe {
                    libc::mmap(
                        addr as *mut libc::c_void,
                        len,
                        libc::PROT_NONE,
                        libc::MAP_PRIVATE
                            | libc::MAP_ANONYMOUS
                            | libc::MAP_FIXED
                            | libc::MAP_NORESERVE,
                        -1,
                        0,
                    )
                };
            }
        }
    }
    entries.clear();
    if spare >= 0 {
        // SAFETY: our own descriptor, opened above and used by nothing else.
        unsafe { libc::close(spare) };
    }
    unlock();
}

/// A descriptor that refers to no segment: `/dev/null`, or an empty memfd
/// where there is none; -1 if neither can be had (the child then keeps its
/// copies of the parent's descriptors, and with them its locks). Called in
/// the child handler: `open` is async-signal-safe, `memfd_create` a plain
/// system call.
fn open_spare() -> RawFd {
    // SAFETY: a NUL-terminated path and plain flags.
    let fd = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd >= 0 {
        return fd;
    }
    // SAFETY: a NUL-terminated name and plain flags.
    unsafe { libc::memfd_create(c"pinshm-forked".as_ptr(), libc::MFD_CLOEXEC) }
}

/// This process's fork generation, registering the handlers on first use
/// (call it before any handle exists, then compare with [`current`]).
pub(crate) fn register() -> u64 {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: the handlers are `extern "C" fn()`s that live forever and
        // only use atomics and raw system calls, which is safe in a forked
        // child.
        let rc =
            unsafe { libc::pthread_atfork(Some(before_fork), Some(in_parent), Some(in_child)) };
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
#[inline]
pub(crate) fn current() -> u64 {
    GENERATION.load(Ordering::Relaxed)
}

/// A registration: what [`Held::forget`] takes back.
#[derive(Debug)]
pub(crate) struct Token(u64);

/// The registry, locked: no fork happens while it lives. Open, map, unmap
/// and close a segment's descriptor and mappings while holding it, so a
/// child never inherits one that is not listed.
pub(crate) struct Held(());

/// Locks the registry (registering the fork handlers first), with room
/// for one more entry: nothing allocates under the lock (an allocator's own
/// fork handler may take its lock after ours is taken).
pub(crate) fn hold() -> Held {
    register();
    loop {
        lock();
        // SAFETY: the lock is held.
        let entries = unsafe { &mut *REGISTRY.entries.get() };
        if entries.len() < entries.capacity() {
            return Held(());
        }
        let want = entries.capacity() * 2 + 8;
        unlock();
        let mut bigger = Vec::with_capacity(want);
        lock();
        // SAFETY: the lock is held.
        let entries = unsafe { &mut *REGISTRY.entries.get() };
        if entries.capacity() < want {
            bigger.extend_from_slice(entries);
            std::mem::swap(entries, &mut bigger);
        }
        unlock();
        drop(bigger); // the old list (or the unused new one), unlocked
    }
}

impl Held {
    /// Lists `what`; at most one per hold (`hold` made room for one).
    fn add(&mut self, what: Inherited) -> Token {
        // SAFETY: `self` proves the lock is held.
        let (entries, next) = unsafe { (&mut *REGISTRY.entries.get(), &mut *REGISTRY.next.get()) };
        debug_assert!(entries.len() < entries.capacity(), "hold() made room");
        *next += 1;
        entries.push((*next, what));
        Token(*next)
    }

    /// Lists descriptor `fd`: a forked child's copy of it is replaced.
    pub(crate) fn add_fd(&mut self, fd: RawFd) -> Token {
        self.add(Inherited::Fd(fd))
    }

    /// Lists the mapping `ptr..ptr + len`: a forked child's copy of it is
    /// made inaccessible.
    pub(crate) fn add_map(&mut self, ptr: *const u8, len: usize) -> Token {
        self.add(Inherited::Map {
            addr: ptr as usize,
            len,
        })
    }

    /// Takes a registration back (before its descriptor closes or its
    /// mapping goes, under the same hold). A no-op in a forked child, whose
    /// list starts empty.
    pub(crate) fn forget(&mut self, token: &Token) {
        // SAFETY: `self` proves the lock is held.
        let entries = unsafe { &mut *REGISTRY.entries.get() };
        if let Some(i) = entries.iter().position(|&(id, _)| id == token.0) {
            entries.swap_remove(i);
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        unlock();
    }
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
