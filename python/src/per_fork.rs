//! State per fork generation: a forked child's first use makes a fresh
//! value and leaks the parent's without touching it (a mutex in it may
//! have been held, at the `os.fork()`, by a thread that is not in the
//! child; a count in it counts threads that are not there).

use std::sync::atomic::{AtomicPtr, Ordering};

/// A value per fork generation of the process, made by `make` on first
/// use in each; the values are leaked (never freed), so a reference to
/// one is `'static`, and one taken before a fork stays the parent's.
pub(crate) struct PerFork<T: 'static> {
    here: AtomicPtr<(u64, T)>,
    make: fn() -> T,
}

impl<T: Send + Sync + 'static> PerFork<T> {
    pub(crate) const fn new(make: fn() -> T) -> PerFork<T> {
        PerFork {
            here: AtomicPtr::new(std::ptr::null_mut()),
            make,
        }
    }

    /// This fork generation's value.
    pub(crate) fn get(&self) -> &'static T {
        let generation = pinshm::testing::fork_generation();
        loop {
            let now = self.here.load(Ordering::Acquire);
            // SAFETY: a non-null `here` is a `Box` turned raw and never
            // freed (below), so it is valid, and shared only, for 'static.
            if let Some((g, t)) = unsafe { now.as_ref() } {
                if *g == generation {
                    return t;
                }
            }
            let fresh = Box::into_raw(Box::new((generation, (self.make)())));
            match self
                .here
                .compare_exchange(now, fresh, Ordering::AcqRel, Ordering::Acquire)
            {
                // The old one (the parent's) is leaked on purpose.
                // SAFETY: published just now; never freed from here on.
                Ok(_) => return unsafe { &(*fresh).1 },
                // SAFETY: another thread swapped first: `fresh` came from
                // `Box::into_raw` above and nobody else has seen it.
                Err(_) => drop(unsafe { Box::from_raw(fresh) }),
            }
        }
    }
}
