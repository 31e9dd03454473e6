//! Criterion benchmarks: each op beside a plain memcpy of the same size into
//! a destination walking an arena as large as the op's ring (the same
//! working set), in the same run. `cargo bench` (add `-- --quick` for a
//! short pass); `examples/bench.rs` prints the same figures as one table.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pinshm::testing as layout;
use pinshm::{
    codec::{DType, ItemLayout},
    ObjectStore, StoreConfig, StoreReader,
};

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;
const SIZES: [usize; 5] = [64, 4 * KIB, 256 * KIB, 4 * MIB, 64 * MIB];

fn ring_objects(size: usize) -> usize {
    (64 * MIB / size).clamp(4, 256)
}

fn store_for(size: usize, objects: usize, prefault: bool) -> ObjectStore {
    let cap = layout::round_up(layout::slot_len(1, size) * objects, 4096);
    ObjectStore::create(StoreConfig::new(cap, size, 1).prefault(prefault)).unwrap()
}

fn configure<'a>(
    c: &'a mut Criterion,
    name: &str,
    size: usize,
) -> criterion::BenchmarkGroup<'a, criterion::measurement::WallTime> {
    let mut g = c.benchmark_group(name);
    g.throughput(Throughput::Bytes(size as u64));
    if size >= 4 * MIB {
        g.sample_size(10);
    }
    g
}

fn bench(c: &mut Criterion) {
    for size in SIZES {
        let objects = ring_objects(size);
        let src = vec![3u8; size];
        let mut g = configure(c, &format!("{size}"), size);

        let mut arena = vec![1u8; size * objects]; // written: pages faulted in
        let mut k = 0;
        g.bench_function("memcpy", |b| {
            b.iter(|| {
                let at = (k % objects) * size;
                arena[at..at + size].copy_from_slice(black_box(&src));
                k += 1;
            })
        });

        // put / put_with: the reader acknowledges each object at once, so the
        // ring wraps and reclaims its oldest slot in every iteration.
        for op in ["put", "put_with"] {
            let mut store = store_for(size, objects, true);
            let reader = StoreReader::attach(&store.handle()).unwrap();
            let keys: Vec<String> = (0..objects * 2).map(|i| format!("k{i}")).collect();
            let mut i = 0;
            g.bench_function(op, |b| {
                b.iter(|| {
                    let key = &keys[i % keys.len()];
                    i += 1;
                    let h = if op == "put" {
                        store.put(key, black_box(&src)).unwrap()
                    } else {
                        store.put_with(key, size, |s| s[0] = i as u8).unwrap()
                    };
                    reader.acknowledge(h).unwrap();
                })
            });
        }

        // put_cold: the first pass over a fresh segment.
        if size <= 4 * MIB {
            g.bench_function(BenchmarkId::new("put_cold", size), |b| {
                b.iter_batched(
                    || store_for(size, 2, true),
                    |mut s| {
                        s.put("k", black_box(&src)).unwrap();
                        s
                    },
                    criterion::BatchSize::PerIteration,
                )
            });
        }

        // get (guard) and get_copy(_into) over a ring full of objects.
        let mut store = store_for(size, objects, true);
        let reader = StoreReader::attach(&store.handle()).unwrap();
        let hs: Vec<_> = (0..objects)
            .map(|i| store.put(&format!("k{i}"), &src).unwrap())
            .collect();
        let mut i = 0;
        g.bench_function("get_guard", |b| {
            b.iter(|| {
                let g = reader.get(black_box(hs[i % objects])).unwrap();
                i += 1;
                black_box(g.as_ptr());
            })
        });
        g.bench_function("get_copy", |b| {
            b.iter(|| {
                i += 1;
                black_box(reader.get_copy(black_box(hs[i % objects])).unwrap())
            })
        });
        let mut buf = Vec::new();
        g.bench_function("get_copy_into", |b| {
            b.iter(|| {
                i += 1;
                reader
                    .get_copy_into(black_box(hs[i % objects]), &mut buf)
                    .unwrap();
                black_box(&buf);
            })
        });
        // get_item: decode the header and view a field in place.
        let item = ItemLayout::new()
            .meta("modality", "image")
            .field("pixel_values", DType::U8, vec![size as u64])
            .field("image_grid_thw", DType::I64, vec![1, 3])
            .finish()
            .unwrap();
        let mut istore = store_for(item.len(), 2, true);
        let ireader = StoreReader::attach(&istore.handle()).unwrap();
        let ih = istore
            .put_item_with("item", &item, |s| s.field_mut(0).fill(1))
            .unwrap();
        g.bench_function("get_item", |b| {
            b.iter(|| {
                let v = ireader.get_item(black_box(ih)).unwrap();
                black_box(v.field("pixel_values").unwrap().bytes().as_ptr());
            })
        });
        g.finish();

        // free/reclaim: free_unused over a ring of acknowledged objects.
        if size <= 256 * KIB {
            let mut g = configure(c, &format!("{size}"), size);
            g.bench_function("free_unused_one", |b| {
                b.iter_batched(
                    || {
                        let mut s = store_for(size, 4, true);
                        let r = StoreReader::attach(&s.handle()).unwrap();
                        let h = s.put("k", &src).unwrap();
                        r.acknowledge(h).unwrap();
                        (s, r)
                    },
                    |(mut s, r)| {
                        assert_eq!(s.free_unused(), 1);
                        (s, r)
                    },
                    criterion::BatchSize::PerIteration,
                )
            });
            g.finish();
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
