//! The item read path allocates nothing: `get_item`, metadata, names,
//! fields and field views, counted by a global allocator. (Allocation-free
//! is the point of `ItemView`: an owned header decode cost about a
//! microsecond per read.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::hint::black_box;

use pinshm::{
    codec::{DType, ItemLayout},
    ObjectStore, StoreConfig, StoreReader,
};

/// `System`, counting this thread's allocations (tests run in parallel
/// threads; a per-thread count sees only the code under test).
struct Counting;

thread_local! {
    // Const-initialised and without a destructor: using it never allocates.
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: every method forwards to `System` with the caller's arguments, so
// `System`'s guarantees are this allocator's; counting touches no memory
// the allocator hands out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded; the caller upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded; the caller upholds `alloc_zeroed`'s contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: forwarded; `ptr` came from `System` through this allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded; `ptr` came from `System` through this allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn allocs_in(f: impl FnOnce()) -> u64 {
    let before = ALLOCS.with(Cell::get);
    f();
    ALLOCS.with(Cell::get) - before
}

#[test]
fn reading_an_item_allocates_nothing() {
    let layout = ItemLayout::new()
        .meta("modality", "image")
        .meta("hash", "3f9a61c2d4")
        .field("pixel_values", DType::U8, vec![4096])
        .field("image_grid_thw", DType::I64, vec![1, 3])
        .field("patch_mask", DType::Bool, vec![64])
        .finish()
        .unwrap();
    let cap = (StoreConfig::slot_len(1, layout.len()) * 4).next_multiple_of(4096);
    let mut store = ObjectStore::create(StoreConfig::new(cap, layout.len(), 1)).unwrap();
    let reader = StoreReader::attach(&store.handle()).unwrap();
    let h = store
        .put_item_with("item", &layout, |s| s.field_mut(0).fill(1))
        .unwrap();
    drop(reader.get_item(h).unwrap());

    let n = allocs_in(|| {
        for _ in 0..100 {
            let v = reader.get_item(black_box(h)).unwrap();
            black_box(v.meta("hash"));
            black_box(v.meta("absent"));
            v.meta_entries().for_each(|e| {
                black_box(e);
            });
            v.fields().for_each(|f| {
                black_box(f.shape());
            });
            black_box(v.names().count());
            black_box(v.field("pixel_values").unwrap().bytes().as_ptr());
            black_box(v.field("patch_mask").unwrap().as_bools().unwrap());
            let g = reader.get(h).unwrap();
            black_box(g.item().unwrap().field("image_grid_thw").unwrap());
        }
    });
    assert_eq!(n, 0, "allocations on the read path");
    // The counter counts: an owned copy of the header allocates.
    assert!(allocs_in(|| drop(black_box(reader.get_item(h).unwrap().to_header()))) > 0);
}
