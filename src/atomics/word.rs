//! The atomics and the futex that the shared-memory code of the store and
//! of the channel is written against: std's and the kernel's, or, when
//! built with `--cfg pinshm_loom`, loom's. This is the one way loom runs the
//! shipped code of both protocols. Loom's atomics cannot be laid over
//! mapped bytes, so under loom each word of the memory is given a loom
//! atomic from a side table, keyed by address and made on first use from
//! the bytes there; a futex is a loom mutex and condvar, keyed by its word.
//! The code under test is the same `SlotPtr` / `ReaderPtr` / `ChannelPtr`
//! code that ships, offsets included, over heap memory laid out as a
//! segment.

use std::time::Duration;

#[cfg(pinshm_loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
#[cfg(not(pinshm_loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};

/// Gives the CPU to another thread (loom's scheduler under `--cfg pinshm_loom`):
/// what a reader does while the writer is in the middle of a change.
pub(crate) fn yield_now() {
    #[cfg(pinshm_loom)]
    loom::thread::yield_now();
    #[cfg(not(pinshm_loom))]
    std::thread::yield_now();
}

/// FUTEX_WAIT: sleeps while `word` holds `expected`, at most `timeout`
/// (the kernel compares and queues atomically with respect to wakes).
#[cfg(not(pinshm_loom))]
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    crate::sys::futex::wait(word, expected, timeout);
}

/// FUTEX_WAKE: wakes up to `n` sleepers on `word`.
#[cfg(not(pinshm_loom))]
pub(crate) fn futex_wake(word: &AtomicU32, n: i32) {
    crate::sys::futex::wake(word, n);
}

/// FUTEX_WAIT under loom: compare and queue atomically (under the word's
/// mutex, as under the kernel's bucket lock); timeouts are ignored, so a
/// lost wake-up is a deadlock loom reports.
#[cfg(pinshm_loom)]
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, _timeout: Option<Duration>) {
    let k = table::futex(word);
    let g = k.lock.lock().unwrap();
    if word.load(Ordering::Relaxed) == expected {
        drop(k.cond.wait(g).unwrap());
    }
}

/// FUTEX_WAKE under loom: every sleeper (a superset of `n`; a woken
/// sleeper re-checks).
#[cfg(pinshm_loom)]
pub(crate) fn futex_wake(word: &AtomicU32, _n: i32) {
    let k = table::futex(word);
    let _g = k.lock.lock().unwrap();
    k.cond.notify_all();
}

/// An atomic word that can be found at an address of a mapping.
pub(crate) trait Word: Sized {
    /// The atomic at `ptr`.
    ///
    /// # Safety
    /// `ptr` is aligned for the word, lies with its bytes inside a live
    /// mapping, and that mapping outlives `'a`.
    unsafe fn at<'a>(ptr: *mut u8) -> &'a Self;
}

#[cfg(not(pinshm_loom))]
macro_rules! word {
    ($($t:ty),*) => {$(
        impl Word for $t {
            #[inline]
            unsafe fn at<'a>(ptr: *mut u8) -> &'a Self {
                // SAFETY: the caller's contract; atomics have no invalid bit
                // patterns and the same layout as their integer.
                unsafe { &*(ptr as *const Self) }
            }
        }
    )*};
}
#[cfg(not(pinshm_loom))]
word!(AtomicU32, AtomicU64);

#[cfg(pinshm_loom)]
pub(crate) mod table {
    //! Loom objects standing in for the words, cells and futexes of a
    //! mapping, and heap memory standing in for the mapping itself.
    use std::any::Any;
    use std::cell::RefCell;
    use std::collections::HashMap;

    /// A futex: the kernel's wait queue of one word.
    pub(crate) struct Futex {
        pub(crate) lock: loom::sync::Mutex<()>,
        pub(crate) cond: loom::sync::Condvar,
    }

    #[derive(Default)]
    struct Table {
        /// By address: a word's atomic, a payload's cell, or (at the
        /// address of the atomic, never a mapping's) a word's futex.
        objects: HashMap<usize, &'static dyn Any>,
        /// Heap mappings of this execution, freed at the next reset.
        mappings: Vec<(*mut u8, std::alloc::Layout)>,
    }

    // Per OS thread: loom runs a model's threads on the thread that calls
    // `loom::model`, and tests running side by side must not share words.
    std::thread_local! {
        static TABLE: RefCell<Table> = RefCell::new(Table::default());
    }

    /// Forgets every object and frees the mappings: call at the start of
    /// each loom execution (the old objects belong to the execution that
    /// made them; they are leaked, never reached again).
    pub(crate) fn reset() {
        TABLE.with(|t| {
            let mut t = t.borrow_mut();
            t.objects.clear();
            for (ptr, layout) in t.mappings.drain(..) {
                // SAFETY: allocated below with this layout, freed once; the
                // execution that used it is over.
                unsafe { std::alloc::dealloc(ptr, layout) };
            }
        });
    }

    /// `len` zeroed bytes, page aligned, standing in for a fresh mapping
    /// until the next [`reset`].
    pub(crate) fn mapping(len: usize) -> *mut u8 {
        let layout = std::alloc::Layout::from_size_align(len.max(1), crate::layout::PAGE)
            .expect("a small mapping");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "heap mapping of {len} bytes");
        TABLE.with(|t| t.borrow_mut().mappings.push((ptr, layout)));
        ptr
    }

    fn object<A: Any>(key: usize, make: impl FnOnce() -> A) -> &'static A {
        let o: &'static dyn Any = TABLE.with(|t| {
            *t.borrow_mut()
                .objects
                .entry(key)
                .or_insert_with(|| Box::leak(Box::new(make())))
        });
        o.downcast_ref::<A>()
            .expect("one address is always reached as the same type")
    }

    /// The loom atomic for the word at `ptr`, made by `make` on first use.
    pub(crate) fn word<A: Any>(ptr: *mut u8, make: impl FnOnce() -> A) -> &'static A {
        object(ptr as usize, make)
    }

    /// The loom cell standing in for the 8 payload bytes at `ptr` (loom
    /// reports any access to it that races another).
    pub(crate) fn cell(ptr: *mut u8) -> &'static loom::cell::UnsafeCell<u64> {
        object(ptr as usize, || loom::cell::UnsafeCell::new(0))
    }

    /// The futex of `word`.
    pub(crate) fn futex<W>(word: &W) -> &'static Futex {
        object(word as *const W as usize, || Futex {
            lock: loom::sync::Mutex::new(()),
            cond: loom::sync::Condvar::new(),
        })
    }
}

#[cfg(pinshm_loom)]
impl Word for AtomicU64 {
    unsafe fn at<'a>(ptr: *mut u8) -> &'a Self {
        // SAFETY: the caller's contract: 8 readable bytes at ptr.
        let init = unsafe { std::ptr::read(ptr as *const u64) };
        table::word(ptr, || AtomicU64::new(init))
    }
}

#[cfg(pinshm_loom)]
impl Word for AtomicU32 {
    unsafe fn at<'a>(ptr: *mut u8) -> &'a Self {
        // SAFETY: the caller's contract: 4 readable bytes at ptr.
        let init = unsafe { std::ptr::read(ptr as *const u32) };
        table::word(ptr, || AtomicU32::new(init))
    }
}
