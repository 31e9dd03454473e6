//! Quick benchmark: put / get figures beside a plain memcpy of the same size,
//! measured in the same run (machines are shared and noisy: read ratios).
//!
//! `cargo run --release --example bench [-- --json] [--quick]`
//!
//! Ops: `put` (steady state, ring wrapping and reclaiming), `put_cold` (the
//! first pass over a freshly created segment), `put_cold_unfaulted` (the same
//! with pre-faulting switched off, to show what it buys), `get_guard` (get a
//! zero-copy guard and drop it), `get_copy` (owned copy), `xproc` (1 writer
//! and 2 reader processes, 1 MiB objects, handles over pipes); and the
//! broadcast channel: `bcast_latency`, `bcast_wake`, `bcast_throughput_*`,
//! `bcast_idle_cpu`, each beside a baseline (`--bcast-only` runs just those).
//! `--hot-only`: the read path's floor beside `get_guard`, puts with 1, 8
//! and 32 readers, reads by key, and the key-fingerprint candidates, each
//! beside its baseline, stamped with the commit and the layout version.

use std::hint::black_box;
use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::time::Instant;

use pinshm::{
    codec::{DType, ItemLayout},
    store::{ObjectHandle, StoreHandle},
    ObjectStore, StoreConfig, StoreReader,
};

mod channel;

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;
const SIZES: [usize; 5] = [64, 4 * KIB, 256 * KIB, 4 * MIB, 64 * MIB];

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Ops per timed batch, so that a batch takes well over the timer's cost.
fn batch_for(size: usize) -> usize {
    (64 * KIB / size).clamp(1, 256)
}

/// Rounds of timing for one (op, size): as many as fit in `budget_ms`.
fn rounds_for(size: usize, quick: bool) -> usize {
    let r = if size >= 64 * MIB {
        15
    } else if size >= 4 * MIB {
        60
    } else {
        300
    };
    if quick {
        r / 3
    } else {
        r
    }
}

/// Median ns of one memcpy of `size` bytes from a warmed buffer into a
/// destination that walks an arena of `arena` bytes, as a put walks the
/// ring (`arena == size`: the same buffer every time, cache-hot).
fn memcpy_ns(size: usize, arena: usize, quick: bool) -> f64 {
    let src = vec![1u8; size];
    let slots = (arena / size).max(1);
    let mut dst = vec![1u8; size * slots]; // written: pages faulted in
    let batch = batch_for(size);
    let mut t = Vec::new();
    let mut k = 0;
    for round in 0..rounds_for(size, quick) + slots / batch {
        let t0 = Instant::now();
        for _ in 0..batch {
            let at = (k % slots) * size;
            dst[at..at + size].copy_from_slice(black_box(&src));
            black_box(&mut dst);
            k += 1;
        }
        if round >= slots / batch {
            t.push(t0.elapsed().as_nanos() as f64 / batch as f64);
        }
    }
    median(&mut t)
}

/// Objects of `size` bytes the steady-state ring holds.
fn ring_objects(size: usize) -> usize {
    (64 * MIB / size).clamp(4, 256)
}

/// A store that holds at least `objects` objects of `size` bytes.
fn store_for(size: usize, objects: usize, prefault: bool) -> ObjectStore {
    let cap = (StoreConfig::slot_len(1, size) * objects).next_multiple_of(4096);
    ObjectStore::create(StoreConfig::new(cap, size, 1).prefault(prefault)).expect("create store")
}

/// Steady-state put: the reader acknowledges each object right away, so
/// the ring keeps wrapping and reclaiming its oldest slot.
fn put_ns(size: usize, quick: bool) -> f64 {
    put_readers_ns(size, 1, quick)
}

/// As `put_ns` with `n_readers` readers, each acknowledging every object:
/// what the writer's reclaim check costs per reader.
fn put_readers_ns(size: usize, n_readers: u32, quick: bool) -> f64 {
    let objects = ring_objects(size);
    let cap = (StoreConfig::slot_len(n_readers, size) * objects).next_multiple_of(4096);
    let mut store =
        ObjectStore::create(StoreConfig::new(cap, size, n_readers)).expect("create store");
    let readers: Vec<StoreReader> = (0..n_readers)
        .map(|_| StoreReader::attach(&store.handle()).unwrap())
        .collect();
    let data = vec![3u8; size];
    let keys: Vec<String> = (0..objects * 2).map(|i| format!("key-{i}")).collect();
    let batch = batch_for(size).min(objects / 2);
    let mut handles = Vec::with_capacity(batch);
    let mut t = Vec::new();
    let mut k = 0;
    // One lap to warm up, then the timed rounds.
    for round in 0..rounds_for(size, quick) + objects / batch {
        handles.clear();
        let t0 = Instant::now();
        for _ in 0..batch {
            handles.push(store.put(&keys[k % keys.len()], black_box(&data)).unwrap());
            k += 1;
        }
        let dt = t0.elapsed().as_nanos() as f64 / batch as f64;
        if round >= objects / batch {
            t.push(dt);
        }
        for h in &handles {
            for reader in &readers {
                reader.acknowledge(*h).unwrap();
            }
        }
    }
    median(&mut t)
}

/// First pass over a fresh segment: every put lands on memory never written.
fn put_cold_ns(size: usize, prefault: bool, quick: bool) -> f64 {
    let objects = (256 * MIB / size).clamp(2, 64);
    let data = vec![3u8; size];
    let mut t = Vec::new();
    let laps = if quick { 2 } else { 5 };
    for _ in 0..laps {
        let mut store = store_for(size, objects, prefault);
        for i in 0..objects {
            let key = format!("k{i}");
            let t0 = Instant::now();
            black_box(store.put(&key, black_box(&data)).unwrap());
            t.push(t0.elapsed().as_nanos() as f64);
        }
    }
    median(&mut t)
}

/// get_guard: one object, get and drop. get_copy / get_copy_into: a ring
/// full of objects copied in turn (cold source, like a real stream).
fn get_ns(size: usize, op: &str, quick: bool) -> f64 {
    let objects = if op == "get_guard" {
        1
    } else {
        ring_objects(size)
    };
    let mut store = store_for(size, objects, true);
    let reader = StoreReader::attach(&store.handle()).unwrap();
    let hs: Vec<_> = (0..objects)
        .map(|i| store.put(&format!("k{i}"), &vec![5u8; size]).unwrap())
        .collect();
    let batch = if op == "get_guard" {
        1000
    } else {
        batch_for(size)
    };
    let mut buf = Vec::new();
    let mut t = Vec::new();
    let mut k = 0;
    for _ in 0..rounds_for(size, quick) {
        let t0 = Instant::now();
        for _ in 0..batch {
            let h = hs[k % objects];
            k += 1;
            match op {
                "get_guard" => {
                    let g = reader.get(black_box(h)).unwrap();
                    black_box(g.as_ptr());
                }
                "get_copy" => {
                    black_box(reader.get_copy(black_box(h)).unwrap());
                }
                _ => {
                    reader.get_copy_into(black_box(h), &mut buf).unwrap();
                    black_box(&buf);
                }
            }
        }
        t.push(t0.elapsed().as_nanos() as f64 / batch as f64);
    }
    median(&mut t)
}

/// The read protocol's floor ([`StoreReader::read_protocol_floor`]: hazard,
/// fence, id, hold, clear, unhold) beside `get_guard` (get and drop a
/// guard) over the same slot of the same segment, their batches
/// alternated so that both see the same noise. Medians in ns.
fn floor_ns(quick: bool) -> (f64, f64) {
    let size = 4096;
    let mut store = store_for(size, 1, true);
    let reader = StoreReader::attach(&store.handle()).unwrap();
    let h = store.put("k", &vec![5u8; size]).unwrap();
    let held = reader.get(h).unwrap();
    let batch = 1000;
    let (mut floor, mut guard) = (Vec::new(), Vec::new());
    for _ in 0..rounds_for(size, quick) {
        let t0 = Instant::now();
        for _ in 0..batch {
            assert!(reader.read_protocol_floor(black_box(&held)));
        }
        floor.push(t0.elapsed().as_nanos() as f64 / batch as f64);
        let t0 = Instant::now();
        for _ in 0..batch {
            let g = reader.get(black_box(h)).unwrap();
            black_box(g.as_ptr());
        }
        guard.push(t0.elapsed().as_nanos() as f64 / batch as f64);
    }
    (median(&mut floor), median(&mut guard))
}

fn floor_bench(json: bool, quick: bool) {
    let (floor, guard) = floor_ns(quick);
    for (op, ns) in [("read_floor", floor), ("get_guard", guard)] {
        if json {
            println!(
                "{{\"op\": \"{op}\", \"size\": 4096, \"median_ns\": {ns:.1}, \"floor_ns\": {floor:.1}, \"ratio\": {:.3}}}",
                ns / floor
            );
        } else {
            println!(
                "{op:<20} {:>10} {ns:>14.1} {floor:>14.1} {:>8.2}   (baseline: the read protocol's floor, same slot)",
                4096,
                ns / floor
            );
        }
    }
}

/// Fingerprint candidates over the keys of `key_ns` (64 hex digits), each
/// keyed with a 32-byte secret: today's (up to layout 8) SHA-256(secret ‖
/// key) first, the baseline; SipHash-1-3 and 2-4 (128-bit output) and keyed
/// BLAKE3 (first 128 bits); and the shipped `key_fingerprint` with its key
/// kept ([`pinshm::testing::FingerprintKey`], as readers keep it).
fn fingerprint_ns(quick: bool) -> Vec<(&'static str, f64)> {
    use sha2::{Digest, Sha256};
    use siphasher::sip128::{SipHasher13, SipHasher24};
    let secret = [0x5au8; 32];
    let keys: Vec<String> = (0..1000u64)
        .map(|i| format!("{:064x}", i.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
        .collect();
    let k16: [u8; 16] = secret[..16].try_into().unwrap();
    let shipped = pinshm::testing::FingerprintKey::new(&secret);
    let rounds = if quick { 30 } else { 150 };
    let ops: [&'static str; 5] = [
        "fp_sha256",
        "fp_siphash13_128",
        "fp_siphash24_128",
        "fp_blake3_keyed",
        "fp_shipped",
    ];
    ops.iter()
        .map(|&op| {
            let mut t = Vec::new();
            for _ in 0..rounds {
                let t0 = Instant::now();
                for k in &keys {
                    let k = black_box(k.as_bytes());
                    let fp: u128 = match op {
                        "fp_sha256" => {
                            let mut h = Sha256::new();
                            h.update(secret);
                            h.update(k);
                            u128::from_le_bytes(h.finalize()[..16].try_into().unwrap())
                        }
                        "fp_siphash13_128" => SipHasher13::new_with_key(&k16).hash(k).into(),
                        "fp_siphash24_128" => SipHasher24::new_with_key(&k16).hash(k).into(),
                        "fp_blake3_keyed" => u128::from_le_bytes(
                            blake3::keyed_hash(&secret, k).as_bytes()[..16]
                                .try_into()
                                .unwrap(),
                        ),
                        _ => {
                            let [a, b] = shipped.fingerprint(std::str::from_utf8(k).unwrap());
                            (a as u128) | ((b as u128) << 64)
                        }
                    };
                    black_box(fp);
                }
                t.push(t0.elapsed().as_nanos() as f64 / keys.len() as f64);
            }
            (op, median(&mut t))
        })
        .collect()
}

fn fingerprint_bench(json: bool, quick: bool) {
    let rows = fingerprint_ns(quick);
    let base = rows[0].1;
    for (op, ns) in rows {
        if json {
            println!(
                "{{\"op\": \"{op}\", \"key_len\": 64, \"median_ns\": {ns:.1}, \"sha256_ns\": {base:.1}, \"ratio\": {:.3}}}",
                ns / base
            );
        } else {
            println!(
                "{op:<20} {:>10} {ns:>14.1} {base:>14.1} {:>8.2}   (keys of 64 hex digits; baseline: keyed SHA-256, layout 8's)",
                64,
                ns / base
            );
        }
    }
}

/// What the figures measured: the commit (with `+dirty` for uncommitted
/// changes) and the layout version.
fn stamp(json: bool) {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    // PINSHM_COMMIT: where the binary runs away from its checkout (the GPU
    // kit's run.sh sets it from the kit's COMMIT file).
    let commit = std::env::var("PINSHM_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| {
            let commit =
                git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{commit}+dirty")
            } else {
                commit
            }
        });
    let layout = pinshm::testing::LAYOUT_VERSION;
    let cpu = cpu_model();
    // The logical CPUs this process may run on (affinity, cgroups); 0 if
    // unknown.
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    if json {
        println!(
            "{{\"op\": \"stamp\", \"commit\": \"{commit}\", \"layout_version\": {layout}, \"cpu\": {}, \"cpus\": {cpus}}}",
            serde_json::Value::from(cpu)
        );
    } else {
        println!("commit {commit}, layout version {layout}, {cpu}, {cpus} CPUs");
    }
}

/// The processor's model name, as /proc/cpuinfo gives it on x86_64 (on
/// aarch64, which has none, the architecture and the first core's part
/// number): ratios such as `get_guard` over the read floor depend on it (a
/// locked instruction costs several times more on some cores than on
/// others).
fn cpu_model() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == name).then(|| v.trim().to_owned())
        })
    };
    field("model name").unwrap_or_else(|| {
        let part = field("CPU part").map_or(String::new(), |p| format!(", part {p}"));
        format!("{} CPU{part}", std::env::consts::ARCH)
    })
}

/// The 4 KiB put with 1, 8 and 32 readers, each acknowledging every
/// object: the writer's cost per reader (the 1-reader row is the baseline
/// of this run).
fn put_readers_bench(json: bool, quick: bool) {
    let base = put_readers_ns(4096, 1, quick);
    for n in [1u32, 8, 32] {
        let ns = if n == 1 {
            base
        } else {
            put_readers_ns(4096, n, quick)
        };
        if json {
            println!(
                "{{\"op\": \"put_readers\", \"readers\": {n}, \"size\": 4096, \"median_ns\": {ns:.1}, \"put_1_reader_ns\": {base:.1}, \"ratio\": {:.3}}}",
                ns / base
            );
        } else {
            println!(
                "{:<20} {:>10} {ns:>14.1} {base:>14.1} {:>8.2}   ({n} readers; baseline: put with 1 reader)",
                "put_readers",
                4096,
                ns / base
            );
        }
    }
}

/// Reads by key in a cache with a shared key index, beside the read by
/// handle (get_guard) of the same objects in the same run.
fn keys_bench(json: bool, quick: bool) {
    let by_key = key_ns(quick);
    let base = by_key[0].1;
    for (op, ns) in by_key {
        if json {
            println!(
                "{{\"op\": \"{op}\", \"size\": 4096, \"objects\": 1000, \"median_ns\": {ns:.1}, \"get_guard_ns\": {base:.1}, \"ratio\": {:.3}}}",
                ns / base
            );
        } else {
            println!(
                "{op:<20} {:>10} {ns:>14.1} {base:>14.1} {:>8.2}   (1000 keys of 64 hex digits; baseline: get_guard by handle)",
                4096,
                ns / base
            );
        }
    }
}

/// Reads by key, medians in ns, in one cache store of 1000 objects of
/// 4 KiB (keys as vLLM's mm hashes: 64 hex digits), each op over every key
/// in turn: get_guard (by handle, the baseline), lookup (key to handle),
/// get_key (look up, hold, drop), lease_key (look up, lease, release).
fn key_ns(quick: bool) -> Vec<(&'static str, f64)> {
    let (size, objects) = (4096, 1000);
    let cap = (StoreConfig::slot_len(1, size) * objects).next_multiple_of(4096);
    let mut store = ObjectStore::create(
        StoreConfig::new(cap, size, 1)
            .cache(true)
            .key_index(2 * objects),
    )
    .expect("create store");
    let reader = StoreReader::attach(&store.handle()).unwrap();
    let keys: Vec<String> = (0..objects)
        .map(|i| format!("{:064x}", (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)))
        .collect();
    let hs: Vec<_> = keys
        .iter()
        .map(|k| store.put(k, &vec![5u8; size]).unwrap())
        .collect();
    let rounds = if quick { 20 } else { 100 };
    let ops = ["get_guard", "lookup", "get_key", "lease_key"];
    ops.iter()
        .map(|&op| {
            let mut t = Vec::new();
            for _ in 0..rounds {
                let t0 = Instant::now();
                for (k, h) in keys.iter().zip(&hs) {
                    match op {
                        "get_guard" => black_box(reader.get(black_box(*h)).unwrap().as_ptr()),
                        "lookup" => {
                            black_box(reader.lookup(black_box(k)).unwrap().unwrap());
                            std::ptr::null()
                        }
                        "get_key" => {
                            black_box(reader.get_key(black_box(k)).unwrap().unwrap().as_ptr())
                        }
                        _ => {
                            reader.lease_key(black_box(k)).unwrap().unwrap().release();
                            std::ptr::null()
                        }
                    };
                }
                t.push(t0.elapsed().as_nanos() as f64 / objects as f64);
            }
            (op, median(&mut t))
        })
        .collect()
}

/// get_item: an item of three fields (pixel values of `size` bytes, a grid
/// and a mask) decoded and viewed in place, then dropped. A view, not a
/// copy: the cost should not grow with `size`.
fn get_item_ns(size: usize, quick: bool) -> f64 {
    let layout = ItemLayout::new()
        .meta("modality", "image")
        .meta("hash", "3f9a61c2d4")
        .field("pixel_values", DType::U8, vec![size as u64])
        .field("image_grid_thw", DType::I64, vec![1, 3])
        .field("patch_mask", DType::Bool, vec![64])
        .finish()
        .unwrap();
    let mut store = store_for(layout.len(), 2, true);
    let reader = StoreReader::attach(&store.handle()).unwrap();
    let h = store
        .put_item_with("item", &layout, |s| s.field_mut(0).fill(1))
        .unwrap();
    let batch = 200;
    let mut t = Vec::new();
    for _ in 0..rounds_for(size, quick).max(100) {
        let t0 = Instant::now();
        for _ in 0..batch {
            let v = reader.get_item(black_box(h)).unwrap();
            let f = v.field("pixel_values").unwrap();
            black_box(f.bytes().as_ptr());
        }
        t.push(t0.elapsed().as_nanos() as f64 / batch as f64);
    }
    median(&mut t)
}

fn monotonic_ns() -> u64 {
    let mut ts = nix::libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec to a valid pointer.
    unsafe { nix::libc::clock_gettime(nix::libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Reader process of `xproc`. Lines `S addr id epoch` are streamed; after
/// a `P ...` line it answers on stdout at once (ping-pong, for latency).
/// At the end it prints `bytes seconds` of the streamed part and the
/// monotonic time each ping object was done.
fn xproc_reader(rank: u32, sh: &StoreHandle) {
    let r = StoreReader::attach_as(sh, rank).unwrap();
    let mut done = Vec::new();
    let (mut bytes, mut first, mut last) = (0u64, None, Instant::now());
    let mut out = std::io::stdout().lock();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let f: Vec<u64> = line[2..].split(' ').map(|x| x.parse().unwrap()).collect();
        let g = r
            .get(ObjectHandle {
                address: f[0],
                monotonic_id: f[1],
                epoch: f[2],
            })
            .unwrap();
        let words: &[u64] = bytemuck::cast_slice(&g);
        black_box(words.iter().fold(0u64, |a, &w| a.wrapping_add(w)));
        let len = g.len() as u64;
        drop(g);
        if line.starts_with('S') {
            first.get_or_insert_with(Instant::now);
            bytes += len;
            last = Instant::now();
        } else {
            done.push(monotonic_ns());
            writeln!(out, "ok").unwrap();
            out.flush().unwrap();
        }
    }
    let secs = first.map_or(1.0, |f| (last - f).as_secs_f64());
    writeln!(out, "{} {}", bytes, secs).unwrap();
    for d in done {
        writeln!(out, "{d}").unwrap();
    }
}

/// Returns (per-reader GB/s streaming, end-to-end latency median ns).
fn xproc(quick: bool) -> (Vec<f64>, f64) {
    let size = MIB;
    let (n_stream, n_ping) = if quick { (500, 100) } else { (2000, 300) };
    let cap = (StoreConfig::slot_len(2, size) * 64).next_multiple_of(4096);
    let mut store = ObjectStore::create(StoreConfig::new(cap, size, 2)).unwrap();
    let sh = serde_json::to_string(&store.handle()).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut kids: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(&exe)
                .args(["--xproc-reader", &rank.to_string(), &sh])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut pipes: Vec<_> = kids.iter_mut().map(|k| k.stdin.take().unwrap()).collect();
    let mut replies: Vec<_> = kids
        .iter_mut()
        .map(|k| std::io::BufReader::new(k.stdout.take().unwrap()))
        .collect();
    let data = vec![9u8; size];
    let mut starts = Vec::with_capacity(n_ping);
    for i in 0..n_stream + n_ping {
        let key = format!("x{i}");
        let ping = i >= n_stream;
        let start = monotonic_ns();
        let h = loop {
            match store.put(&key, &data) {
                Ok(h) => break h,
                Err(pinshm::Error::Full { .. }) => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        };
        let tag = if ping { 'P' } else { 'S' };
        for p in &mut pipes {
            writeln!(p, "{tag} {} {} {}", h.address, h.monotonic_id, h.epoch).unwrap();
        }
        if ping {
            starts.push(start);
            for r in &mut replies {
                let mut l = String::new();
                r.read_line(&mut l).unwrap();
            }
        }
    }
    drop(pipes);
    let mut gbps = Vec::new();
    let mut last_done = vec![0u64; n_ping];
    for (k, mut r) in kids.into_iter().zip(replies) {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut r, &mut text).unwrap();
        k.wait_with_output().unwrap();
        let mut lines = text.lines();
        let head: Vec<f64> = lines
            .next()
            .unwrap()
            .split(' ')
            .map(|x| x.parse().unwrap())
            .collect();
        gbps.push(head[0] / head[1] / 1e9);
        for (i, l) in lines.enumerate() {
            last_done[i] = last_done[i].max(l.parse().unwrap());
        }
    }
    let mut lat: Vec<f64> = last_done
        .iter()
        .zip(&starts)
        .map(|(d, s)| d.saturating_sub(*s) as f64)
        .collect();
    (gbps, median(&mut lat))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(p) = args.iter().position(|a| a == "--xproc-reader") {
        let sh: StoreHandle = serde_json::from_str(&args[p + 2]).unwrap();
        xproc_reader(args[p + 1].parse().unwrap(), &sh);
        return;
    }
    if let Some(p) = args.iter().position(|a| a == "--profile-put") {
        // For callgrind / perf: steady-state puts of one size, nothing else.
        let size: usize = args[p + 1].parse().unwrap();
        black_box(put_ns(size, true));
        return;
    }
    if let Some(p) = args.iter().position(|a| a == "--profile-put-readers") {
        // For callgrind: steady-state 4 KiB puts with N readers.
        let n: u32 = args[p + 1].parse().unwrap();
        black_box(put_readers_ns(4096, n, true));
        return;
    }
    if args.iter().any(|a| a == "--profile-get") {
        // For callgrind: get_guard and the floor, nothing else.
        black_box(floor_ns(true));
        return;
    }
    let json = args.iter().any(|a| a == "--json");
    let quick = args.iter().any(|a| a == "--quick");
    if let Some(p) = args.iter().position(|a| a == "--bcast-echo") {
        channel::bcast_echo(&serde_json::from_str(&args[p + 1]).unwrap());
        return;
    }
    if let Some(p) = args.iter().position(|a| a == "--bcast-throughput") {
        // For strace / perf: the broadcast throughput op alone.
        let readers: u32 = args[p + 1].parse().unwrap();
        println!("{:?}", channel::bcast_throughput(readers, false, true));
        return;
    }
    if args.iter().any(|a| a == "--bcast-idle") {
        println!("{}", channel::bcast_idle_cpu_ns(false));
        return;
    }
    if args.iter().any(|a| a == "--hot-only") {
        // The hot paths of issue 41, each beside its baseline of this run.
        stamp(json);
        floor_bench(json, quick);
        put_readers_bench(json, quick);
        keys_bench(json, quick);
        fingerprint_bench(json, quick);
        return;
    }
    if args.iter().any(|a| a == "--keys-only") {
        keys_bench(json, quick);
        return;
    }
    if args.iter().any(|a| a == "--bcast-only") {
        channel::bcast_bench(json, quick);
        return;
    }
    let t_all = Instant::now();
    stamp(json);
    let emit = |op: &str, size: usize, ns: f64, memcpy: f64, hot: f64| {
        let ratio = ns / memcpy;
        if json {
            println!(
                "{{\"op\": \"{op}\", \"size\": {size}, \"median_ns\": {ns:.1}, \"memcpy_median_ns\": {memcpy:.1}, \"ratio\": {ratio:.3}, \"memcpy_hot_ns\": {hot:.1}}}"
            );
        } else {
            println!("{op:<20} {size:>10} {ns:>14.1} {memcpy:>14.1} {ratio:>8.2} {hot:>14.1}");
        }
    };
    if !json {
        println!("pinshm bench: medians in ns; ratio = op / memcpy of the same size in this run");
        println!("memcpy_ns: destination walks an arena as large as the op's ring; memcpy_hot_ns: one cache-hot buffer");
        println!(
            "{:<20} {:>10} {:>14} {:>14} {:>8} {:>14}",
            "op", "size", "median_ns", "memcpy_ns", "ratio", "memcpy_hot_ns"
        );
    }
    for size in SIZES {
        // Same working set as the op: the ring's size (put, get_copy) ...
        let m = memcpy_ns(size, ring_objects(size) * size, quick);
        // ... or one buffer, cache-hot (shown for scale).
        let hot = memcpy_ns(size, size, quick);
        emit("put", size, put_ns(size, quick), m, hot);
        emit("put_cold", size, put_cold_ns(size, true, quick), m, hot);
        emit(
            "put_cold_unfaulted",
            size,
            put_cold_ns(size, false, quick),
            m,
            hot,
        );
        emit("get_guard", size, get_ns(size, "get_guard", quick), m, hot);
        emit("get_copy", size, get_ns(size, "get_copy", quick), m, hot);
        emit(
            "get_copy_into",
            size,
            get_ns(size, "get_copy_into", quick),
            m,
            hot,
        );
        emit("get_item", size, get_item_ns(size, quick), m, hot);
    }
    floor_bench(json, quick);
    put_readers_bench(json, quick);
    keys_bench(json, quick);
    fingerprint_bench(json, quick);
    let m = memcpy_ns(MIB, 64 * MIB, quick);
    let (gbps, lat) = xproc(quick);
    if json {
        println!(
            "{{\"op\": \"xproc\", \"size\": {MIB}, \"median_ns\": {lat:.1}, \"memcpy_median_ns\": {m:.1}, \"ratio\": {:.3}, \"readers\": 2, \"per_reader_gbps\": [{:.2}, {:.2}], \"latency_median_ns\": {lat:.1}}}",
            lat / m, gbps[0], gbps[1]
        );
    } else {
        println!(
            "xproc: 1 writer + 2 reader processes, 1 MiB objects: {:.2} / {:.2} GB/s delivered per reader, end-to-end latency median {:.1} µs (memcpy 1 MiB {:.1} µs)",
            gbps[0], gbps[1], lat / 1e3, m / 1e3
        );
    }
    channel::bcast_bench(json, quick);
    if !json {
        println!("total {:.1} s", t_all.elapsed().as_secs_f64());
    }
}
