//! GPU tests (feature `cuda`). They need a CUDA device, so they are
//! `#[ignore]`d: `cargo test` reports them as ignored, never as passed.
//! The GPU kit (`tests/gpu/build.sh`, then `run.sh` on a GPU machine) runs
//! them with `--include-ignored`, and `bandwidth_table` on its own.
//! The bodies shared with the CPU engine (`tests/device.rs`) are in
//! `tests/common/engine.rs`; here they run on `CudaEngine`.
#![cfg(feature = "cuda")]

mod common;

use std::io::Write;
use std::time::Instant;

use common::{checksum, child_result, engine, pattern, spawn_child, Name};
use pinshm::testing as layout;
use pinshm::{
    device::{CopyEngine, CudaEngine, PackDesc, PinMode},
    store::{ObjectHandle, ReaderOptions, StoreHandle},
    Error, ObjectStore, StoreConfig, StoreReader,
};

const MIB: usize = 1 << 20;

fn pinned_store(name: &Name, capacity: usize, max: usize) -> ObjectStore {
    <CudaEngine as engine::TestEngine>::store(name, capacity, max)
}

/// Child: attach pinned, read one object, report its checksum and pinning.
#[test]
#[ignore = "child process entry point: its parent test runs it with --ignored"]
fn child_gpu_reader() {
    let Ok(_) = std::env::var("PINSHM_CHILD") else {
        return;
    };
    let sh: StoreHandle = serde_json::from_str(&std::env::var("PINSHM_HANDLE").unwrap()).unwrap();
    let r = StoreReader::attach_with(&sh, ReaderOptions::default().pin(PinMode::Require)).unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let h: ObjectHandle = serde_json::from_str(&line).unwrap();
    let eng = CudaEngine::new(0).unwrap();
    let dst = eng.alloc(r.get(h).unwrap().len()).unwrap();
    let n = r.get_to_device(h, &dst, &eng).unwrap().wait().unwrap();
    let mut back = vec![0; n];
    eng.download(&dst, &mut back).unwrap();
    println!("RESULT pinned={} sum={}", r.is_pinned(), checksum(&back));
}

#[test]
#[ignore = "needs a CUDA GPU: run the GPU kit (tests/gpu/build.sh, then run.sh)"]
fn device_to_slot_in_one_process_then_slot_to_device_in_another() {
    let name = Name::new("gpu-xproc");
    let len = 8 * MIB;
    let mut w = pinned_store(&name, 4 * len, len);
    assert!(w.is_pinned());
    let eng = CudaEngine::new(0).unwrap();
    let src = eng.alloc(len).unwrap();
    let data = pattern(5, len);
    eng.upload(&data, &src).unwrap();
    let p = w.put_from_device("obj", &src, &eng).unwrap();
    let h = w.finish_put(p).unwrap();
    let mut child = spawn_child(
        "child_gpu_reader",
        "gpu",
        &[("PINSHM_HANDLE", serde_json::to_string(&w.handle()).unwrap())],
    );
    writeln!(
        child.stdin.take().unwrap(),
        "{}",
        serde_json::to_string(&h).unwrap()
    )
    .unwrap();
    assert_eq!(
        child_result(child),
        format!("pinned=true sum={}", checksum(&data))
    );
}

#[test]
#[ignore = "needs a CUDA GPU: run the GPU kit (tests/gpu/build.sh, then run.sh)"]
fn pack_and_unpack_kernels_match_the_cpu_reference() {
    engine::pack_and_unpack_match_the_cpu_reference::<CudaEngine>("gpu");
}

/// Not ignored: runs wherever NVRTC can be loaded (CI fetches libnvrtc from
/// PyPI), no GPU needed. Elsewhere it says so and checks nothing, unless
/// `PINSHM_REQUIRE_NVRTC=1` (set by .ci/run) says NVRTC must be there.
#[test]
fn the_kernels_compile_with_nvrtc() {
    if !pinshm::testing::nvrtc_present() {
        assert!(
            std::env::var_os("PINSHM_REQUIRE_NVRTC").is_none(),
            "PINSHM_REQUIRE_NVRTC is set but libnvrtc.so cannot be loaded"
        );
        eprintln!("skipped: libnvrtc.so not found (set LD_LIBRARY_PATH to a CUDA 12 NVRTC)");
        return;
    }
    // Every architecture kernels/bin holds, from the same source: what
    // kernels/build.py does, here through the crate's own NVRTC path (the
    // run-time fallback).
    let b = pinshm::testing::compile_kernels().unwrap();
    for s in &b.skipped {
        eprintln!("not built by this NVRTC: {s}");
    }
    for (name, n) in &b.built {
        eprintln!("built {name}: {n} bytes");
        assert!(*n > 10_000, "{name}: only {n} bytes");
    }
    // Each embedded cubin built or named as skipped, and the PTX built
    // (for compute_70, or the lowest architecture this NVRTC has).
    let (bins, _) = pinshm::testing::kernel_binaries();
    let cubins =
        |names: &mut dyn Iterator<Item = &str>| names.filter(|n| n.contains(".cubin")).count();
    assert_eq!(
        cubins(&mut b.built.iter().map(|(n, _)| n.as_str()))
            + cubins(&mut b.skipped.iter().map(String::as_str)),
        bins.len() - 1
    );
    assert!(
        b.built.iter().any(|(n, _)| n.ends_with(".ptx")),
        "no PTX built"
    );
}

fn reader(w: &ObjectStore) -> StoreReader {
    <CudaEngine as engine::TestEngine>::reader(w)
}

/// The kit's preflight: what the driver sees, and which kernel binary the
/// engine loads (an embedded cubin, the embedded PTX, or NVRTC).
#[test]
#[ignore = "needs a CUDA GPU: run the GPU kit (tests/gpu/build.sh, then run.sh)"]
fn preflight_reports_the_device_and_the_kernel_binary() {
    let v = pinshm::testing::driver_version().expect("a CUDA driver");
    println!("CUDA driver API version: {}.{}", v / 1000, (v % 1000) / 10);
    println!(
        "NVRTC (run-time fallback only): {}",
        if pinshm::testing::nvrtc_present() {
            "loadable"
        } else {
            "not found"
        }
    );
    assert!(CudaEngine::available(), "no CUDA device visible");
    let eng = CudaEngine::new(0).unwrap();
    let (major, minor) = eng.compute_capability().unwrap();
    println!(
        "device 0: {}, compute capability {major}.{minor}, {} SMs",
        eng.name(),
        eng.sm_count()
    );
    let (bins, hash) = pinshm::testing::kernel_binaries();
    println!(
        "embedded kernels: {} ({})",
        bins.iter()
            .map(|(n, b)| format!("{n} {b} B"))
            .collect::<Vec<_>>()
            .join(", "),
        hash.lines().next().unwrap_or("")
    );
    let src = eng.kernel_source().expect("the pack kernels load");
    println!("kernels loaded from: {src}");
    let name = Name::new("gpu-preflight");
    let w = pinned_store(&name, 4 * MIB, MIB);
    assert!(w.is_pinned());
    println!("a 4 MiB segment registers: ok");
}

#[test]
#[ignore = "needs a CUDA GPU: run the GPU kit (tests/gpu/build.sh, then run.sh)"]
fn the_callers_cuda_context_is_left_as_it_was() {
    use pinshm::testing::{current_context, ForeignContext};
    let work = |name: &Name| {
        let mut w = pinned_store(name, 4 * MIB, MIB);
        let r = reader(&w);
        let eng = CudaEngine::new(0).unwrap();
        let src = eng.alloc(4096).unwrap();
        eng.upload(&pattern(1, 4096), &src).unwrap();
        let p = w.put_from_device("k", &src, &eng).unwrap();
        let h = w.finish_put(p).unwrap();
        r.get_to_device(h, &src, &eng).unwrap().wait().unwrap();
        let descs = [PackDesc::contiguous(src.ptr(), 4096, 0)];
        // SAFETY: `src` is a live buffer of `eng`, kept until finish_put.
        let p = unsafe { w.put_packed_from_device("p", &descs, 4096, &eng) }.unwrap();
        w.finish_put(p).unwrap();
        drop((r, w, src, eng));
    };
    std::thread::spawn(move || {
        assert_eq!(current_context(), 0, "a fresh thread has no context");
        work(&Name::new("gpu-ctx-none"));
        assert_eq!(current_context(), 0, "pinshm left a context current");
        let mine = ForeignContext::new(0).unwrap();
        assert_eq!(current_context(), mine.id());
        work(&Name::new("gpu-ctx-foreign"));
        assert_eq!(current_context(), mine.id(), "pinshm changed the context");
    })
    .join()
    .unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: run the GPU kit (tests/gpu/build.sh, then run.sh)"]
fn pinning_follows_the_device_option_and_skips_sparse_segments_under_auto() {
    let name = Name::new("gpu-dev0");
    let w = ObjectStore::create(
        StoreConfig::new(4 * MIB, MIB, 1)
            .name(&*name)
            .cuda_device(0),
    )
    .unwrap();
    assert!(w.is_pinned(), "Auto pins a reserved segment on device 0");
    let r = StoreReader::attach_with(&w.handle(), ReaderOptions::default().cuda_device(0)).unwrap();
    assert!(r.is_pinned());
    let bad = Name::new("gpu-dev-bad");
    let e = ObjectStore::create(
        StoreConfig::new(4 * MIB, MIB, 1)
            .name(&*bad)
            .pin(PinMode::Require)
            .cuda_device(999),
    )
    .unwrap_err();
    assert!(matches!(e, Error::PinUnavailable { .. }), "{e}");
    let e = StoreReader::attach_with(
        &w.handle(),
        ReaderOptions::default()
            .pin(PinMode::Require)
            .cuda_device(999),
    )
    .unwrap_err();
    assert!(matches!(e, Error::PinUnavailable { .. }), "{e}");
    let sparse = Name::new("gpu-sparse");
    let ws = ObjectStore::create(
        StoreConfig::new(64 * MIB, MIB, 2)
            .name(&*sparse)
            .reserve(false)
            .prefault(false),
    )
    .unwrap();
    assert!(!ws.is_pinned(), "Auto leaves a sparse segment unpinned");
    let rs =
        StoreReader::attach_with(&ws.handle(), ReaderOptions::default().prefault(false)).unwrap();
    assert!(!rs.is_pinned(), "a reader tells a sparse segment too");
    let rq = StoreReader::attach_with(&ws.handle(), ReaderOptions::default().pin(PinMode::Require));
    assert!(rq.unwrap().is_pinned(), "Require still pins it");
}

#[test]
#[ignore = "needs a CUDA GPU: run the GPU kit (tests/gpu/build.sh, then run.sh)"]
fn an_engine_works_from_a_thread_other_than_its_creator() {
    engine::an_engine_works_from_a_thread_other_than_its_creator::<CudaEngine>("gpu");
}

#[test]
#[ignore = "needs a CUDA GPU: run the GPU kit (tests/gpu/build.sh, then run.sh)"]
fn an_abandoned_pending_put_frees_its_slot_only_after_its_copy() {
    engine::an_abandoned_pending_put_frees_its_slot_only_after_its_copy::<CudaEngine>(
        "gpu",
        32 * MIB,
    );
}

#[test]
#[ignore = "needs a CUDA GPU: run the GPU kit (tests/gpu/build.sh, then run.sh)"]
fn tensor_and_item_puts_and_gets_go_through_the_gpu() {
    engine::tensors_and_items_round_trip_through_the_device::<CudaEngine>("gpu", 256);
}

#[test]
#[ignore = "needs a CUDA GPU: run the GPU kit (tests/gpu/build.sh, then run.sh)"]
fn the_kernels_match_the_cpu_reference_at_every_alignment() {
    engine::pack_and_unpack_match_the_cpu_reference_at_every_alignment::<CudaEngine>("gpu");
}

#[test]
#[ignore = "needs a CUDA GPU: run the GPU kit (tests/gpu/build.sh, then run.sh)"]
fn a_device_put_is_published_only_when_its_copy_completes() {
    engine::a_device_put_is_published_only_when_its_copy_completes::<CudaEngine>("gpu");
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn best(reps: usize, mut f: impl FnMut() -> f64) -> f64 {
    (0..reps).map(|_| f()).fold(f64::MAX, f64::min)
}

/// The figures of the README's GPU section. Copies are timed with CUDA
/// events on the engine's stream (device time, nothing of the host's
/// bookkeeping), best of several runs; the data is checked once per size;
/// pinned must beat pageable at 256 MiB.
#[test]
#[ignore = "needs a CUDA GPU: run the GPU kit (tests/gpu/build.sh, then run.sh)"]
fn bandwidth_table() {
    let eng = CudaEngine::new(0).unwrap();
    println!("device: {} ({} SMs)", eng.name(), eng.sm_count());
    println!(
        "{:>7} | {:>13} {:>13} | {:>13} {:>13} | {:>11} {:>11}",
        "MiB",
        "D2H->slot",
        "D2H->pageable",
        "slot->H2D",
        "pageable->H2D",
        "put (wall)",
        "get (wall)"
    );
    let mut at_256 = None;
    for mib in [1usize, 16, 256] {
        let len = mib * MIB;
        let name = Name::new("gpu-bw");
        let mut w = pinned_store(&name, 2 * layout::slot_len(1, len), len);
        let r = reader(&w);
        let data = pattern(mib as u64, len);
        let dev = eng.alloc(len).unwrap();
        eng.upload(&data, &dev).unwrap();
        // A slot to copy into and out of; checked once below.
        let mut slot = std::ptr::null_mut();
        let h = w
            .put_with("slot", len, |b| {
                b.fill(0);
                slot = b.as_mut_ptr();
            })
            .unwrap();
        let guard = r.get(h).unwrap();
        let mut pageable = vec![1u8; len];
        let reps = if mib >= 256 { 3 } else { 10 };
        // `slot` is this published object's payload, held by `guard` for
        // the whole loop; only these copies touch it, one at a time (each
        // waited for).
        let d2h_pinned = best(reps, || {
            // SAFETY: as said above.
            eng.time_on_stream(|| unsafe { eng.d2h_async(&dev, slot, None) }?.wait())
                .unwrap()
                .1
        });
        assert_eq!(checksum(&guard), checksum(&data), "D2H into the slot");
        let d2h_pageable = best(reps, || {
            eng.time_on_stream(|| eng.download(&dev, &mut pageable))
                .unwrap()
                .1
        });
        assert_eq!(checksum(&pageable), checksum(&data), "D2H to pageable");
        eng.upload(&vec![0; len], &dev).unwrap();
        let h2d_pinned = best(reps, || {
            // SAFETY: as above; the slot is only read.
            eng.time_on_stream(|| unsafe { eng.h2d_async(slot, len, &dev, None) }?.wait())
                .unwrap()
                .1
        });
        let mut back = vec![0u8; len];
        eng.download(&dev, &mut back).unwrap();
        assert_eq!(checksum(&back), checksum(&data), "H2D out of the slot");
        let h2d_pageable = best(reps, || {
            eng.time_on_stream(|| eng.upload(&pageable, &dev))
                .unwrap()
                .1
        });
        drop(guard);
        // End to end, as a user sees it (wall clock, bookkeeping and event
        // included): put_from_device + finish_put, get_to_device + wait.
        let mut i = 0;
        let put_wall = best(reps, || {
            i += 1;
            w.free_unused();
            let t = Instant::now();
            let p = w.put_from_device(&format!("k{i}"), &dev, &eng).unwrap();
            let hk = w.finish_put(p).unwrap();
            let s = t.elapsed().as_secs_f64();
            r.acknowledge(hk).unwrap();
            s
        });
        let hk = w.get_cached(&format!("k{i}")).unwrap();
        let get_wall = best(reps, || {
            let t = Instant::now();
            r.get_to_device(hk, &dev, &eng).unwrap().wait().unwrap();
            t.elapsed().as_secs_f64()
        });
        println!(
            "{mib:>7} | {:>8.2} GB/s {:>8.2} GB/s | {:>8.2} GB/s {:>8.2} GB/s | {:>6.2} GB/s {:>6.2} GB/s",
            gbps(len, d2h_pinned),
            gbps(len, d2h_pageable),
            gbps(len, h2d_pinned),
            gbps(len, h2d_pageable),
            gbps(len, put_wall),
            gbps(len, get_wall),
        );
        if mib == 256 {
            at_256 = Some((d2h_pinned, d2h_pageable, h2d_pinned, h2d_pageable));
        }
    }

    // Registration: a reader attaching to a reserved 1 GiB segment, pinned
    // vs not (both without pre-faulting), per GiB.
    let gib = 1usize << 30;
    let name = Name::new("gpu-reg");
    let w =
        ObjectStore::create(StoreConfig::new(gib, MIB, 2).name(&*name).pin(PinMode::Off)).unwrap();
    let attach = |mode| {
        let t = Instant::now();
        let r = StoreReader::attach_with(
            &w.handle(),
            ReaderOptions::default().pin(mode).prefault(false),
        )
        .unwrap();
        assert_eq!(r.is_pinned(), mode == PinMode::Require);
        let s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        drop(r);
        (s, t.elapsed().as_secs_f64())
    };
    let (plain, _) = attach(PinMode::Off);
    let (pinned, unpin) = attach(PinMode::Require);
    println!(
        "registration (cuMemHostRegister, reader attach): {:.3} s per GiB; unregister {:.3} s per GiB; unpinned attach {:.4} s",
        pinned - plain,
        unpin,
        plain
    );
    drop(w);

    // 1,000 small tensors (256 B to 16 KiB): one pack or unpack launch
    // sequence vs 1,000 separate copies, wall clock, each waited for once.
    let name = Name::new("gpu-pack1000");
    let mut w = pinned_store(&name, 64 * MIB, 16 * MIB);
    let r = reader(&w);
    let mut rng = common::Rng(1000);
    let bufs: Vec<_> = (0..1000)
        .map(|_| {
            eng.alloc(256 + rng.below(16 * 1024 - 256) as usize)
                .unwrap()
        })
        .collect();
    let mut descs = Vec::new();
    let mut at = 0usize;
    for (i, b) in bufs.iter().enumerate() {
        eng.upload(&pattern(i as u64, b.len()), b).unwrap();
        descs.push(PackDesc::contiguous(b.ptr(), b.len() as u64, at as u64));
        at = layout::round_up(at + b.len(), 16);
    }
    let total = at;
    let mut n = 0;
    let pack = best(5, || {
        n += 1;
        w.free_unused();
        let t = Instant::now();
        // SAFETY: every piece is a live buffer of `eng`, kept until finish_put.
        let p = unsafe { w.put_packed_from_device(&format!("p{n}"), &descs, total, &eng) }.unwrap();
        let hp = w.finish_put(p).unwrap();
        let s = t.elapsed().as_secs_f64();
        r.acknowledge(hp).unwrap();
        s
    });
    let hp = w.get_cached(&format!("p{n}")).unwrap();
    // Held from here to the end: the separate puts below must not reclaim
    // the packed object (the guard's hold keeps it).
    let g = r.get(hp).unwrap();
    let got: &[u8] = &g;
    for (i, d) in descs.iter().enumerate() {
        let a = d.offset as usize;
        assert_eq!(
            got[a..a + d.row_bytes as usize],
            pattern(i as u64, d.row_bytes as usize)[..],
            "packed piece {i}"
        );
    }
    let separate_d2h = best(5, || {
        n += 1;
        w.free_unused();
        let mut tickets = Vec::new();
        let t = Instant::now();
        let hs = w
            .put_with(&format!("s{n}"), total, |b| {
                for (d, src) in descs.iter().zip(&bufs) {
                    // SAFETY: the slot being filled, waited for before
                    // put_with returns and publishes it.
                    tickets.push(unsafe {
                        eng.d2h_async(src, b.as_mut_ptr().add(d.offset as usize), None)
                            .unwrap()
                    });
                }
                for t in tickets.drain(..) {
                    t.wait().unwrap();
                }
            })
            .unwrap();
        let s = t.elapsed().as_secs_f64();
        r.acknowledge(hs).unwrap();
        s
    });
    let unpack = best(5, || {
        let t = Instant::now();
        // SAFETY: reads the guarded slot, writes the live buffers.
        unsafe { eng.unpack_async(g.as_ptr(), g.len(), &descs, None) }
            .unwrap()
            .wait()
            .unwrap();
        t.elapsed().as_secs_f64()
    });
    let separate_h2d = best(5, || {
        let t = Instant::now();
        let tickets: Vec<_> = descs
            .iter()
            .zip(&bufs)
            // SAFETY: reads the guarded slot, writes the live buffers.
            .map(|(d, b)| unsafe {
                eng.h2d_async(g.as_ptr().add(d.offset as usize), b.len(), b, None)
                    .unwrap()
            })
            .collect();
        for t in tickets {
            t.wait().unwrap();
        }
        t.elapsed().as_secs_f64()
    });
    drop(g);
    println!(
        "1,000 tensors ({:.1} MiB): pack {:.3} ms vs 1,000 D2H copies {:.3} ms; unpack {:.3} ms vs 1,000 H2D copies {:.3} ms ({})",
        total as f64 / MIB as f64,
        pack * 1e3,
        separate_d2h * 1e3,
        unpack * 1e3,
        separate_h2d * 1e3,
        eng.kernel_source().unwrap()
    );

    let (dp, dq, hp, hq) = at_256.unwrap();
    assert!(
        dp < dq,
        "pinned D2H ({:.2} GB/s) must beat pageable ({:.2} GB/s) at 256 MiB",
        gbps(256 * MIB, dp),
        gbps(256 * MIB, dq)
    );
    assert!(
        hp < hq,
        "pinned H2D ({:.2} GB/s) must beat pageable ({:.2} GB/s) at 256 MiB",
        gbps(256 * MIB, hp),
        gbps(256 * MIB, hq)
    );
}
