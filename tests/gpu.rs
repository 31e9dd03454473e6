//! GPU tests (feature `cuda`). They need a CUDA device, so they are
//! `#[ignore]`d: `cargo test` reports them as ignored, never as passed.
//! `tests/gpu/run.sh` runs them on a GPU machine with `--ignored`.
#![cfg(feature = "cuda")]

mod common;

use std::io::Write;
use std::time::Instant;

use common::{checksum, child_result, pattern, spawn_child, Name};
use pinshm::testing as layout;
use pinshm::testing::pack_cpu;
use pinshm::{
    CopyEngine, CudaEngine, ObjectHandle, ObjectStore, PackDesc, PinMode, ReaderOptions,
    StoreConfig, StoreHandle, StoreReader,
};

const MIB: usize = 1 << 20;

fn pinned_store(name: &Name, capacity: usize, max: usize) -> ObjectStore {
    ObjectStore::create(
        StoreConfig::new(capacity, max, 1)
            .name(&**name)
            .pin(PinMode::Require),
    )
    .expect("a pinned store (is there a GPU?)")
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
#[ignore = "needs a CUDA GPU: run tests/gpu/run.sh"]
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
#[ignore = "needs a CUDA GPU: run tests/gpu/run.sh"]
fn pack_and_unpack_kernels_match_the_cpu_reference() {
    let name = Name::new("gpu-pack");
    let mut w = pinned_store(&name, 16 * MIB, 4 * MIB);
    let r = StoreReader::attach_with(&w.handle(), ReaderOptions::default().pin(PinMode::Require))
        .unwrap();
    let eng = CudaEngine::new(0).unwrap();
    // 100 small pieces of odd sizes, plus a strided 64 × 48-byte view of a
    // 64 × 128-byte matrix (16-byte aligned: the vector path).
    let mut bufs = Vec::new();
    let mut descs = Vec::new();
    let mut host = Vec::new();
    let mut at = 0u64;
    for i in 0..100usize {
        let n = 1 + (i * 37) % 300;
        let b = eng.alloc(n).unwrap();
        let d = pattern(i as u64, n);
        eng.upload(&d, &b).unwrap();
        descs.push(PackDesc::contiguous(b.ptr(), n as u64, at));
        host.push((d, PackDesc::contiguous(0, n as u64, at)));
        at = layout::round_up(at as usize + n, 16) as u64;
        bufs.push(b);
    }
    let m = eng.alloc(64 * 128).unwrap();
    let md = pattern(999, 64 * 128);
    eng.upload(&md, &m).unwrap();
    descs.push(PackDesc {
        device_ptr: m.ptr(),
        offset: at,
        rows: 64,
        row_bytes: 48,
        pitch: 128,
    });
    let total = at as usize + 64 * 48;
    // SAFETY: every piece is a live buffer of `eng`, kept until finish_put.
    let p = unsafe { w.put_packed_from_device("packed", &descs, total, &eng) }.unwrap();
    let h = w.finish_put(p).unwrap();
    let got = r.get_copy(h).unwrap();
    // The CPU reference over host copies of the same pieces.
    let mut cpu_descs: Vec<PackDesc> = host
        .iter()
        .map(|(d, p)| PackDesc {
            device_ptr: d.as_ptr() as u64,
            ..*p
        })
        .collect();
    cpu_descs.push(PackDesc {
        device_ptr: md.as_ptr() as u64,
        offset: at,
        rows: 64,
        row_bytes: 48,
        pitch: 128,
    });
    let mut expect = vec![0u8; total];
    // SAFETY: host slices alive for the call.
    unsafe { pack_cpu(&cpu_descs, &mut expect) }.unwrap();
    assert_eq!(got, expect, "GPU pack equals the CPU reference");
    // Unpack into fresh device buffers and compare.
    let outs: Vec<_> = host
        .iter()
        .map(|(d, _)| eng.alloc(d.len()).unwrap())
        .collect();
    let m2 = eng.alloc(64 * 128).unwrap();
    eng.upload(&vec![0; 64 * 128], &m2).unwrap();
    let mut back: Vec<PackDesc> = outs
        .iter()
        .zip(&host)
        .map(|(b, (_, p))| PackDesc {
            device_ptr: b.ptr(),
            ..*p
        })
        .collect();
    back.push(PackDesc {
        device_ptr: m2.ptr(),
        offset: at,
        rows: 64,
        row_bytes: 48,
        pitch: 128,
    });
    let g = r.get(h).unwrap();
    // SAFETY: unpack reads the guarded slot and writes the fresh buffers.
    let t = unsafe { eng.unpack_async(g.as_ptr(), g.len(), &back, None) }.unwrap();
    t.wait().unwrap();
    drop(g);
    for (b, (d, _)) in outs.iter().zip(&host) {
        let mut v = vec![0; d.len()];
        eng.download(b, &mut v).unwrap();
        assert_eq!(&v, d);
    }
    let mut v = vec![0; 64 * 128];
    eng.download(&m2, &mut v).unwrap();
    for row in 0..64 {
        assert_eq!(v[row * 128..row * 128 + 48], md[row * 128..row * 128 + 48]);
        assert!(
            v[row * 128 + 48..(row + 1) * 128].iter().all(|&x| x == 0),
            "outside the rows untouched"
        );
    }
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
    let n = pinshm::testing::compile_kernels().unwrap();
    assert!(n > 1000, "PTX of {n} bytes");
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

#[test]
#[ignore = "needs a CUDA GPU: run tests/gpu/run.sh"]
fn print_pinned_vs_pageable_bandwidth() {
    let eng = CudaEngine::new(0).unwrap();
    println!("device: {}", eng.name());
    println!(
        "{:>8} {:>12} {:>12} {:>12} {:>12}",
        "MiB", "D2H pinned", "D2H pageable", "H2D pinned", "H2D pageable"
    );
    for mib in [1usize, 16, 256] {
        let len = mib * MIB;
        let name = Name::new("gpu-bw");
        let mut w = pinned_store(&name, 2 * len + MIB, len);
        let r =
            StoreReader::attach_with(&w.handle(), ReaderOptions::default().pin(PinMode::Require))
                .unwrap();
        let dev = eng.alloc(len).unwrap();
        eng.upload(&pattern(1, len), &dev).unwrap();
        let reps = if mib >= 256 { 3 } else { 10 };
        let mut best = [f64::MAX; 4];
        let mut pageable = vec![0u8; len];
        for i in 0..reps {
            let t = Instant::now();
            let p = w.put_from_device(&format!("k{i}"), &dev, &eng).unwrap();
            let h = w.finish_put(p).unwrap();
            best[0] = best[0].min(t.elapsed().as_secs_f64());
            let t = Instant::now();
            eng.download(&dev, &mut pageable).unwrap();
            best[1] = best[1].min(t.elapsed().as_secs_f64());
            let t = Instant::now();
            r.get_to_device(h, &dev, &eng).unwrap().wait().unwrap();
            best[2] = best[2].min(t.elapsed().as_secs_f64());
            let t = Instant::now();
            eng.upload(&pageable, &dev).unwrap();
            best[3] = best[3].min(t.elapsed().as_secs_f64());
            w.free_unused();
        }
        println!(
            "{mib:>8} {:>9.2} GB/s {:>9.2} GB/s {:>9.2} GB/s {:>9.2} GB/s",
            gbps(len, best[0]),
            gbps(len, best[1]),
            gbps(len, best[2]),
            gbps(len, best[3])
        );
    }
}
