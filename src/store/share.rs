//! [`Share`]: a counted share of a reader's attachment, as `Arc`, that
//! its reader can take in bulk: one atomic add pays for many guards, so a
//! `get` makes a guard with no atomic of its own on the count (a guard's
//! drop still gives its share back with one).
//!
//! Process-local memory, so `std`'s atomics, as `Arc`'s. The orderings are
//! `Arc`'s: adding is Relaxed (a new share is made from one the caller
//! holds, so the value cannot go meanwhile); giving back is Release, and
//! whoever gives the last one back takes an Acquire fence before dropping
//! the value, so every use through any share happens before the drop.

use std::ops::Deref;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicUsize, Ordering};

/// Most shares at once, as `Arc`'s limit: past it a leak loop (shares
/// forgotten with `mem::forget`) aborts instead of wrapping the count.
const MAX_SHARES: usize = isize::MAX as usize;

/// A counted share of a `T` on the heap (see the module's doc).
pub(super) struct Share<T> {
    ptr: NonNull<Inner<T>>,
}

struct Inner<T> {
    shares: AtomicUsize,
    value: T,
}

// SAFETY: as `Arc<T>`: a share hands out `&T` on any thread and the last
// one drops `T` on whichever thread gives it back.
unsafe impl<T: Send + Sync> Send for Share<T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Sync for Share<T> {}

impl<T> Share<T> {
    /// The first share of `value`.
    pub(super) fn new(value: T) -> Share<T> {
        let inner = Box::new(Inner {
            shares: AtomicUsize::new(1),
            value,
        });
        Share {
            ptr: NonNull::from(Box::leak(inner)),
        }
    }

    #[inline]
    fn inner(&self) -> &Inner<T> {
        // SAFETY: this share keeps the allocation alive (the count is at
        // least one while it lives).
        unsafe { self.ptr.as_ref() }
    }

    /// Adds `n` shares at once, owned by the caller until it makes them
    /// into [`Share`]s ([`Share::prepaid`]) or gives them back
    /// ([`Share::unprepay`]).
    #[inline]
    pub(super) fn prepay(&self, n: usize) {
        let old = self.inner().shares.fetch_add(n, Ordering::Relaxed);
        if old > MAX_SHARES - n {
            std::process::abort();
        }
    }

    /// One of the shares the caller [prepaid](Share::prepay).
    ///
    /// # Safety
    /// 1. The caller prepaid a share on this value that it has neither
    ///    made into a `Share` nor given back: this one becomes that share.
    #[inline]
    pub(super) unsafe fn prepaid(&self) -> Share<T> {
        Share { ptr: self.ptr }
    }

    /// Gives back `n` prepaid shares that were never made into `Share`s.
    ///
    /// # Safety
    /// 1. The caller prepaid at least `n` shares on this value that it has
    ///    neither made into `Share`s nor given back.
    pub(super) unsafe fn unprepay(&self, n: usize) {
        // `self` is one more share, so this never gives back the last: no
        // drop to synchronise with here (Release: as any give-back).
        self.inner().shares.fetch_sub(n, Ordering::Release);
    }

    /// Whether both are shares of one value.
    pub(super) fn ptr_eq(a: &Share<T>, b: &Share<T>) -> bool {
        a.ptr == b.ptr
    }
}

impl<T> Clone for Share<T> {
    fn clone(&self) -> Share<T> {
        self.prepay(1);
        // SAFETY: the share just prepaid, made into this one.
        unsafe { self.prepaid() }
    }
}

impl<T> Deref for Share<T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        &self.inner().value
    }
}

impl<T> Drop for Share<T> {
    #[inline(always)]
    fn drop(&mut self) {
        if self.inner().shares.fetch_sub(1, Ordering::Release) != 1 {
            return;
        }
        self.drop_last();
    }
}

impl<T> Share<T> {
    /// What the last share's drop does, out of the line of every drop.
    #[cold]
    #[inline(never)]
    fn drop_last(&mut self) {
        // The last share: every use through the others happened before
        // their Release give-backs, which this Acquire fence pairs with.
        fence(Ordering::Acquire);
        // SAFETY: the allocation came from `Box::leak` in `new`, and no
        // share is left to reach it.
        drop(unsafe { Box::from_raw(self.ptr.as_ptr()) });
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Share<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&**self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    struct Counted(Arc<AtomicUsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn the_value_goes_with_the_last_share_prepaid_or_cloned_on_any_thread() {
        let drops = Arc::new(AtomicUsize::new(0));
        let first = Share::new(Counted(Arc::clone(&drops)));
        first.prepay(3);
        // SAFETY: three prepaid: two made into shares, one given back.
        let (a, b) = unsafe { (first.prepaid(), first.prepaid()) };
        // SAFETY: the third.
        unsafe { first.unprepay(1) };
        let c = a.clone();
        assert!(Share::ptr_eq(&a, &c));
        let t = std::thread::spawn(move || {
            drop(b);
            drop(c);
        });
        drop(first);
        t.join().unwrap();
        assert_eq!(drops.load(Ordering::Relaxed), 0, "a is still a share");
        drop(a);
        assert_eq!(drops.load(Ordering::Relaxed), 1);
    }
}
