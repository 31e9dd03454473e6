//! The main job: one writer process (the "API server") and N reader
//! processes (tensor-parallel workers) sharing a stream of multimodal-sized
//! objects through one store, as vLLM's `mm_processor_cache_type=shm` does.
//!
//! The writer puts each new image once and re-references repeats with
//! `get_cached`; only the `ObjectHandle` (a few bytes of MessagePack)
//! travels to the workers, through a pinshm `Broadcast` channel in shared
//! memory (no pipe, no socket). Every worker reads every object in place,
//! checks every byte, and reports the store's figures next to the handle
//! hand-off latency (send to receive, across processes). Run: `cargo run --release --example tp_workers [-- --workers 2
//! --requests 2000 --capacity-mib 256 --hit-rate 0.3]`.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pinshm::{
    channel::{BroadcastConfig, BroadcastHandle},
    store::{ObjectHandle, StoreHandle},
    Broadcast, BroadcastReader, Error, ObjectStore, StoreConfig, StoreReader,
};

/// What travels through the channel for each request.
#[derive(serde::Serialize, serde::Deserialize)]
struct Request {
    handle: ObjectHandle,
    len: u64,
    sum: u64,
    /// CLOCK_MONOTONIC when the writer sent it (same clock in every process).
    sent_ns: u64,
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

const MIB: usize = 1 << 20;

struct Args {
    workers: u32,
    requests: u64,
    capacity_mib: usize,
    hit_rate: f64,
}

fn parse_args() -> Args {
    let mut a = Args {
        workers: 2,
        requests: 2000,
        capacity_mib: 256,
        hit_rate: 0.3,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let v = argv.get(i + 1).cloned().unwrap_or_default();
        match argv[i].as_str() {
            "--workers" => a.workers = v.parse().expect("--workers N"),
            "--requests" => a.requests = v.parse().expect("--requests N"),
            "--capacity-mib" => a.capacity_mib = v.parse().expect("--capacity-mib N"),
            "--hit-rate" => a.hit_rate = v.parse().expect("--hit-rate 0..1"),
            "--worker" => return a, // handled in main
            other => {
                eprintln!("unknown argument {other}");
                std::process::exit(2)
            }
        }
        i += 2;
    }
    a
}

/// Deterministic content for image `seed`.
fn fill_image(seed: u64, out: &mut [u8]) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut chunks = out.chunks_exact_mut(8);
    for c in &mut chunks {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    for b in chunks.into_remainder() {
        *b = x as u8;
    }
}

fn checksum(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ bytes.len() as u64;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().unwrap());
        h = (h ^ w).wrapping_mul(0x100_0000_01b3).rotate_left(29);
    }
    for &b in chunks.remainder() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// Image sizes as a multimodal processor emits them: pixel values of
/// 3×H×W f32 for H, W in 224..=896, plus a few small grid tensors.
fn image_len(seed: u64) -> usize {
    let side = 224 + (seed.wrapping_mul(2654435761) % 5) as usize * 168;
    3 * side * side * 4 + 64 * (seed % 7) as usize
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if let Some(p) = argv.iter().position(|a| a == "--worker") {
        let rank: u32 = argv[p + 1].parse().unwrap();
        let sh: StoreHandle = serde_json::from_str(&argv[p + 2]).unwrap();
        let ch: BroadcastHandle = serde_json::from_str(&argv[p + 3]).unwrap();
        std::process::exit(worker(rank, &sh, &ch));
    }
    let a = parse_args();
    std::process::exit(writer(&a));
}

fn writer(a: &Args) -> i32 {
    let max_object = 3 * 896 * 896 * 4 + 64 * 7;
    let capacity = a.capacity_mib * MIB;
    let mut store = match ObjectStore::create(StoreConfig::new(capacity, max_object, a.workers)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("cannot create the store: {e}");
            return 1;
        }
    };
    let sh = serde_json::to_string(&store.handle()).unwrap();
    // Handles go to the workers through a broadcast channel of 256 slots.
    let mut channel = match Broadcast::create(BroadcastConfig::new(a.workers, 256, 256)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cannot create the channel: {e}");
            return 1;
        }
    };
    let ch = serde_json::to_string(&channel.handle()).unwrap();
    println!(
        "pinshm tp_workers: 1 writer, {} worker processes, {} requests, ring {} MiB in /dev/shm/{}, hit rate {:.0}%",
        a.workers,
        a.requests,
        a.capacity_mib,
        store.name(),
        a.hit_rate * 100.0
    );
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..a.workers)
        .map(|rank| {
            Command::new(&exe)
                .args(["--worker", &rank.to_string(), &sh, &ch])
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn worker")
        })
        .collect();
    let mut msg = Vec::with_capacity(256);
    let mut rng = 0x1234_5678u64;
    let mut next_image = 0u64;
    let (mut put_bytes, mut puts, mut hits, mut full_waits) = (0u64, 0u64, 0u64, 0u64);
    let mut put_ns = Vec::with_capacity(a.requests as usize);
    let mut failed = false;
    // Checksum of each image as written into its slot; workers compare.
    let mut sums = std::collections::HashMap::new();
    let t0 = Instant::now();
    for _ in 0..a.requests {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        // A repeat of one of the last 16 images, or a new one.
        let repeat = next_image > 0 && (rng % 1000) as f64 / 1000.0 < a.hit_rate;
        let seed = if repeat {
            next_image - 1 - (rng >> 20) % next_image.min(16)
        } else {
            next_image += 1;
            next_image - 1
        };
        let key = format!("img-{seed}");
        let len = image_len(seed);
        let mut sum = sums.get(&seed).copied().unwrap_or(0);
        let h = match store.get_cached(&key) {
            Some(h) => {
                hits += 1;
                h
            }
            None => loop {
                let t = Instant::now();
                match store.put_with(&key, len, |slot| {
                    fill_image(seed, slot);
                    sum = checksum(slot);
                }) {
                    Ok(h) => {
                        put_ns.push(t.elapsed().as_nanos() as u64);
                        puts += 1;
                        sums.insert(seed, sum);
                        put_bytes += len as u64;
                        break h;
                    }
                    Err(Error::Full { .. }) => {
                        // Workers are behind: let them read.
                        full_waits += 1;
                        std::thread::sleep(Duration::from_micros(100));
                    }
                    Err(e) => {
                        eprintln!("put failed: {e}");
                        failed = true;
                        break ObjectHandle {
                            address: 0,
                            monotonic_id: 0,
                            epoch: 0,
                        };
                    }
                }
            },
        };
        msg.clear();
        let req = Request {
            handle: h,
            len: len as u64,
            sum,
            sent_ns: monotonic_ns(),
        };
        rmp_serde::encode::write(&mut msg, &req).unwrap();
        if let Err(e) = channel.send(&msg) {
            eprintln!("send failed: {e}");
            failed = true;
            break;
        }
    }
    // Workers drain the channel, then see the writer gone and report.
    drop(channel);
    let mut ok = !failed;
    let mut reports = Vec::new();
    for (rank, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        ok &= out.status.success();
        reports.push((rank, text.trim().to_owned()));
    }
    let wall = t0.elapsed();
    put_ns.sort_unstable();
    let s = store.stats();
    println!("\nwriter: {puts} puts ({:.1} MiB), {hits} cache hits, {} evictions, {full_waits} waits for readers",
        put_bytes as f64 / MIB as f64, s.evictions);
    if !put_ns.is_empty() {
        let med = put_ns[put_ns.len() / 2];
        let avg_len = put_bytes as f64 / puts as f64;
        println!(
            "writer: put (fill in place) median {:.1} µs for {:.2} MiB objects = {:.2} GB/s",
            med as f64 / 1e3,
            avg_len / MIB as f64,
            avg_len / med as f64
        );
    }
    for (rank, r) in &reports {
        println!("worker {rank}: {r}");
    }
    println!(
        "\nwall {:.2} s; every worker read every object in place and {}",
        wall.as_secs_f64(),
        if ok {
            "verified every byte: OK"
        } else {
            "FOUND ERRORS"
        }
    );
    if ok {
        0
    } else {
        1
    }
}

fn worker(rank: u32, sh: &StoreHandle, ch: &BroadcastHandle) -> i32 {
    let reader = match StoreReader::attach_as(sh, rank) {
        Ok(r) => r,
        Err(e) => {
            println!("cannot attach: {e}");
            return 1;
        }
    };
    let requests = match BroadcastReader::attach_as(ch, rank) {
        Ok(r) => r,
        Err(e) => {
            println!("cannot attach to the channel: {e}");
            return 1;
        }
    };
    let (mut objects, mut bytes, mut bad, mut stale) = (0u64, 0u64, 0u64, 0u64);
    let mut get_ns = Vec::new();
    let mut handoff_ns = Vec::new();
    let t0 = Instant::now();
    let mut queued = 0u64;
    loop {
        let called = monotonic_ns();
        let req: Request = match requests.recv() {
            Ok(m) => {
                handoff_ns.push(monotonic_ns());
                match rmp_serde::from_slice(&m) {
                    Ok(r) => r,
                    Err(e) => {
                        println!("bad request: {e}");
                        return 1;
                    }
                }
            }
            Err(Error::WriterGone { .. }) => break,
            Err(e) => {
                println!("recv failed: {e}");
                return 1;
            }
        };
        // Hand-off latency: send to receive, for requests this worker was
        // already waiting for; a request sent while the worker was busy
        // with an earlier one queued in the channel and is only counted.
        let received = handoff_ns.pop().unwrap();
        if called <= req.sent_ns {
            handoff_ns.push(received.saturating_sub(req.sent_ns));
        } else {
            queued += 1;
        }
        let h = req.handle;
        let t = Instant::now();
        match reader.get(h) {
            Ok(g) => {
                get_ns.push(t.elapsed().as_nanos() as u64);
                if g.len() as u64 != req.len || checksum(&g) != req.sum {
                    bad += 1;
                }
                objects += 1;
                bytes += g.len() as u64;
            }
            Err(e) if e.is_stale() => stale += 1,
            Err(e) => {
                println!("get failed: {e}");
                return 1;
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    get_ns.sort_unstable();
    handoff_ns.sort_unstable();
    let pct = |v: &[u64], p: usize| v.get(v.len() * p / 100).copied().unwrap_or(0);
    let (med, p99) = (pct(&get_ns, 50), pct(&get_ns, 99));
    println!(
        "{objects} objects, {:.1} MiB read in place ({:.2} GB/s incl. verification), get median {med} ns, p99 {p99} ns, {stale} stale, {bad} corrupt; handle hand-off through the channel to a waiting worker median {:.1} µs, p99 {:.1} µs ({} requests; {queued} found queued)",
        bytes as f64 / MIB as f64,
        bytes as f64 / secs / 1e9,
        pct(&handoff_ns, 50) as f64 / 1e3,
        pct(&handoff_ns, 99) as f64 / 1e3,
        handoff_ns.len(),
    );
    i32::from(bad > 0 || stale > 0)
}
