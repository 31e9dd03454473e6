//! A sparse store's first lap against a backed one: one put per "step" of
//! 98 KiB, 1 MiB and 8 MiB into a fresh sparse store (`reserve(false)`,
//! pages never written before: what the vLLM connectors create) and into a
//! reserved, pre-faulted store (every page backed and mapped), beside a
//! memcpy of the same size into an arena as large as the ring (the same
//! working set), interleaved, in one run.
//!
//! `cargo run --release --example bench_first_lap [-- --json FILE] [--repeats N] [--gap-ms MS]`
//!
//! Two modes per size:
//! - `gap`: the three ops of a repeat, then `--gap-ms` (default 20) of
//!   sleep (and 0.2 ms of spinning, to wake the core), as an engine saves
//!   one output per step and waits for its device in between;
//! - `stream`: the same with no sleep, puts back to back (what a burst of
//!   saves costs once it outruns anything done between them).
//!
//! Prints a markdown table (medians, µs; ratios); `--json FILE` also
//! appends one JSON object per (size, mode) to FILE, stamped with the
//! layout version, the commit and `--label` (default "this"), which
//! `tools/figures.py`'s `first-lap` renderer turns into the docs' table
//! (docs/performance.md; one label per results file). Uses only API that
//! every version of the store has, so that the same file measures the code
//! before a change (built from its own tree, with `--label before --commit
//! HASH`) and after it.

use std::hint::black_box;
use std::time::{Duration, Instant};

use pinshm::{ObjectStore, StoreConfig};

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;
/// 98 KiB: a small encoder output (a 224-px image's tokens in bf16, say).
const SIZES: [usize; 3] = [98 * KIB, MIB, 8 * MIB];

/// The six orders of the three ops (0 memcpy, 1 sparse put, 2 backed put).
const ORDERS: [[usize; 3]; 6] = [
    [0, 1, 2],
    [0, 2, 1],
    [1, 0, 2],
    [1, 2, 0],
    [2, 0, 1],
    [2, 1, 0],
];

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// A step between two saves: `d` of sleep (the engine waiting for its
/// device), then 0.2 ms of spinning, so that the first op timed does not
/// pay for waking the core (about 10 µs on the VM measured), which a step
/// that ends in a busy thread does not leave behind either.
fn step(d: Duration) {
    if d.is_zero() {
        return;
    }
    std::thread::sleep(d);
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_micros(200) {
        std::hint::spin_loop();
    }
}

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A cache store of room for `objects` objects of `size` bytes and no
/// wrap: every put of the run lands in pages never written before.
fn store(size: usize, objects: usize, sparse: bool) -> ObjectStore {
    let cap = (objects + 2) * StoreConfig::slot_len(1, size);
    let cap = cap.next_multiple_of(StoreConfig::SLOT_ALIGN);
    let cfg = StoreConfig::new(cap, size, 1)
        .cache(true)
        .pin(pinshm::device::PinMode::Off)
        .reserve(!sparse)
        .prefault(!sparse);
    ObjectStore::create(cfg).expect("store")
}

struct Row {
    size: usize,
    mode: &'static str,
    memcpy: f64,
    sparse: f64,
    backed: f64,
}

fn run(size: usize, repeats: usize, gap: Duration) -> Row {
    let src: Vec<u8> = (0..size).map(|i| i as u8).collect();
    let mut arena = vec![1u8; size * repeats]; // written: faulted in
                                               // The sparse store last: nothing else gives its pages time to be
                                               // backed ahead but the first step's wait (none in `stream` mode).
    let mut backed = store(size, repeats, false);
    let mut sparse = store(size, repeats, true);
    let (mut t_copy, mut t_sparse, mut t_backed) = (Vec::new(), Vec::new(), Vec::new());
    // As an engine: the store is made at start-up, the first save comes
    // a step later.
    step(gap);
    for i in 0..repeats {
        // Every order in turn: each op follows each other op (and comes
        // first) equally often (an op right after the memcpy runs slower).
        for op in ORDERS[i % 6] {
            match op {
                0 => {
                    let at = i * size;
                    let t0 = Instant::now();
                    arena[at..at + size].copy_from_slice(black_box(&src));
                    black_box(&mut arena);
                    t_copy.push(t0.elapsed().as_nanos() as f64);
                }
                1 => {
                    let t0 = Instant::now();
                    black_box(sparse.put(&format!("k{i}"), &src).expect("sparse put"));
                    t_sparse.push(t0.elapsed().as_nanos() as f64);
                }
                _ => {
                    let t0 = Instant::now();
                    black_box(backed.put(&format!("k{i}"), &src).expect("backed put"));
                    t_backed.push(t0.elapsed().as_nanos() as f64);
                }
            }
        }
        step(gap);
    }
    Row {
        size,
        mode: if gap.is_zero() { "stream" } else { "gap" },
        memcpy: median(&mut t_copy),
        sparse: median(&mut t_sparse),
        backed: median(&mut t_backed),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let repeats: usize = arg(&args, "--repeats", 36);
    let gap_ms: u64 = arg(&args, "--gap-ms", 20);
    let json = args
        .iter()
        .position(|a| a == "--json")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let label = args
        .iter()
        .position(|a| a == "--label")
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| "this".into());
    let commit_arg = args
        .iter()
        .position(|a| a == "--commit")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let commit = commit_arg
        .or_else(|| {
            std::process::Command::new("git")
                .args(["rev-parse", "--short", "HEAD"])
                .output()
                .ok()
                .and_then(|o| String::from_utf8(o.stdout).ok())
                .map(|s| s.trim().to_owned())
        })
        .unwrap_or_default();
    let layout = pinshm::testing::LAYOUT_VERSION;
    let mut rows = Vec::new();
    for mode_gap in [Duration::from_millis(gap_ms), Duration::ZERO] {
        for size in SIZES {
            rows.push(run(size, repeats, mode_gap));
        }
    }
    println!(
        "{label}: layout {layout}, commit {commit}, {repeats} interleaved repeats, gap {gap_ms} ms; medians, µs"
    );
    println!();
    println!("| size | mode | memcpy | put, fresh sparse | put, backed | sparse / backed | sparse / memcpy | backed / memcpy |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut out = String::new();
    for r in &rows {
        let size = if r.size >= MIB {
            format!("{} MiB", r.size / MIB)
        } else {
            format!("{} KiB", r.size / KIB)
        };
        println!(
            "| {size} | {} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} |",
            r.mode,
            r.memcpy / 1e3,
            r.sparse / 1e3,
            r.backed / 1e3,
            r.sparse / r.backed,
            r.sparse / r.memcpy,
            r.backed / r.memcpy
        );
        out += &format!(
            "{{\"bench\":\"first_lap\",\"label\":\"{label}\",\"layout\":{layout},\"commit\":\"{commit}\",\"size\":{},\"mode\":\"{}\",\"repeats\":{repeats},\"gap_ms\":{},\"memcpy_ns\":{:.0},\"sparse_put_ns\":{:.0},\"backed_put_ns\":{:.0}}}\n",
            r.size,
            r.mode,
            if r.mode == "gap" { gap_ms } else { 0 },
            r.memcpy,
            r.sparse,
            r.backed
        );
    }
    if let Some(path) = json {
        use std::io::Write;
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(out.as_bytes()))
            .expect("append to the JSON file");
        println!("\nappended to {path}");
    }
}
