//! The atomics the shared-memory code is written against: std's, or, when
//! built with `--cfg loom`, loom's. Loom's atomics cannot be laid over
//! mapped bytes, so under loom each word of the memory is given a loom
//! atomic from a side table, keyed by address and made on first use from
//! the bytes there; the code under test is the same `SlotPtr` / `ReaderPtr`
//! code that ships.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

/// An atomic word that can be found at an address of a mapping.
pub(crate) trait Word: Sized {
    /// The atomic at `ptr`.
    ///
    /// # Safety
    /// `ptr` is aligned for the word, lies with its bytes inside a live
    /// mapping, and that mapping outlives `'a`.
    unsafe fn at<'a>(ptr: *mut u8) -> &'a Self;
}

#[cfg(not(loom))]
macro_rules! word {
    ($($t:ty),*) => {$(
        impl Word for $t {
            unsafe fn at<'a>(ptr: *mut u8) -> &'a Self {
                // SAFETY: the caller's contract; atomics have no invalid bit
                // patterns and the same layout as their integer.
                unsafe { &*(ptr as *const Self) }
            }
        }
    )*};
}
#[cfg(not(loom))]
word!(AtomicU32, AtomicU64);

#[cfg(loom)]
pub(crate) mod table {
    //! Loom atomics standing in for the words of a mapping.
    use std::any::Any;
    use std::cell::RefCell;
    use std::collections::HashMap;

    type Table = HashMap<usize, &'static (dyn Any + Send + Sync)>;
    // Per OS thread: loom runs a model's threads on the thread that calls
    // `loom::model`, and tests running side by side must not share words.
    std::thread_local! {
        static WORDS: RefCell<Table> = RefCell::new(HashMap::new());
    }

    /// Forgets every word: call at the start of each loom execution (the
    /// old words belong to the execution that made them; they are leaked).
    pub(crate) fn reset() {
        WORDS.with(|w| w.borrow_mut().clear());
    }

    /// The loom atomic for the word at `ptr`, made by `make` on first use.
    pub(crate) fn word<A: Any + Send + Sync>(ptr: *mut u8, make: impl FnOnce() -> A) -> &'static A {
        let w: &'static (dyn Any + Send + Sync) = WORDS.with(|words| {
            *words
                .borrow_mut()
                .entry(ptr as usize)
                .or_insert_with(|| Box::leak(Box::new(make())))
        });
        w.downcast_ref::<A>()
            .expect("one word is always reached as the same type")
    }
}

#[cfg(loom)]
impl Word for AtomicU64 {
    unsafe fn at<'a>(ptr: *mut u8) -> &'a Self {
        // SAFETY: the caller's contract: 8 readable bytes at ptr.
        let init = unsafe { std::ptr::read(ptr as *const u64) };
        table::word(ptr, || AtomicU64::new(init))
    }
}

#[cfg(loom)]
impl Word for AtomicU32 {
    unsafe fn at<'a>(ptr: *mut u8) -> &'a Self {
        // SAFETY: the caller's contract: 4 readable bytes at ptr.
        let init = unsafe { std::ptr::read(ptr as *const u32) };
        table::word(ptr, || AtomicU32::new(init))
    }
}
