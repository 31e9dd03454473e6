//! What the allocator does under fragmentation: the fraction of puts that
//! fail (`Error::Full`) when some objects stay in use for a while, against an
//! ideal allocator that could move objects, on the same stream.
//!
//! `cargo run --release --example fragmentation [-- --json] [--puts N]
//!  [--hold H] [--seeds S] [--p-hold P]`
//!
//! The stream: `--puts` puts (default 20,000) of sizes drawn log-uniformly
//! in 64 KiB-4 MiB, each under a new key. A fraction `--p-hold` of them
//! (default 0.10) stays in use for a random number of subsequent puts,
//! uniform in 1..=2H (`--hold`, default H = 200); every other object is read
//! and released at once. Two ways to stay in use:
//!   guard   a reader takes a guard at once and drops it when its while is up;
//!   unread  the reader reads it only when its while is up (owed meanwhile).
//! A put that fails is served uncached (it is not retried, and an object
//! meant to stay in use then holds nothing).
//!
//! Capacities are chosen so that the bytes in use average 10, 20, 30, 40
//! and 50 % of capacity (the time-average of the slot bytes of objects in use,
//! from the stream itself). Reported per capacity: failed puts on pinshm's
//! allocator (next-fit from a cursor, around objects in use); failed puts on
//! the ideal allocator (a put fails only if free + reclaimable bytes, i.e.
//! capacity minus the slot bytes of objects in use, are fewer than the slot
//! bytes asked for: what compaction could reach), simulated here on the same
//! stream; and the measured fraction of capacity in use (mean and max).
//! Medians over `--seeds` streams (default 3); `--json` prints every run.
//!
//! The payload is not copied in (only its first 8 bytes are written and
//! checked by the reader): placement does not depend on the bytes, and the
//! run stays short.

use std::collections::VecDeque;

use pinshm::{store::ObjectHandle, Error, ObjectStore, ReadGuard, StoreConfig, StoreReader};

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;
const MIN_SIZE: usize = 64 * KIB;
const MAX_SIZE: usize = 4 * MIB;
const TARGETS: [f64; 5] = [0.10, 0.20, 0.30, 0.40, 0.50];

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64: a fixed, dependency-free stream per seed.
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One put of the stream: its payload size, and for how many subsequent
/// puts it stays in use (0: read and released at once).
#[derive(Clone, Copy)]
struct Put {
    size: usize,
    hold: usize,
}

fn stream(seed: u64, n: usize, p_hold: f64, hold: usize) -> Vec<Put> {
    let mut rng = Rng(seed);
    let (lo, hi) = ((MIN_SIZE as f64).ln(), (MAX_SIZE as f64).ln());
    (0..n)
        .map(|_| {
            let size = ((lo + (hi - lo) * rng.unit()).exp() as usize).clamp(MIN_SIZE, MAX_SIZE);
            let held = rng.unit() < p_hold;
            let hold = if held {
                1 + (rng.next() % (2 * hold as u64)) as usize
            } else {
                0
            };
            Put { size, hold }
        })
        .collect()
}

fn slot(size: usize) -> u64 {
    StoreConfig::slot_len(1, size) as u64
}

/// The time-average of slot bytes in use over the stream, if no put failed.
fn offered_in_use(s: &[Put]) -> f64 {
    let n = s.len();
    let total: f64 = s
        .iter()
        .enumerate()
        .map(|(i, p)| slot(p.size) as f64 * p.hold.min(n - 1 - i) as f64)
        .sum();
    total / n as f64
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Guard,
    Unread,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Guard => "guard",
            Mode::Unread => "unread",
        }
    }
}

struct Outcome {
    failed: usize,
    in_use_mean: f64,
    in_use_max: f64,
}

/// An allocator that could move objects: a put fails only if capacity minus
/// the bytes in use is short of its slot.
fn ideal(s: &[Put], capacity: u64) -> Outcome {
    let mut in_use: VecDeque<(usize, u64)> = VecDeque::new(); // (due, bytes)
    let (mut used, mut failed, mut sum, mut max) = (0u64, 0, 0f64, 0u64);
    for (i, p) in s.iter().enumerate() {
        in_use.retain(|&(due, b)| {
            if due <= i {
                used -= b;
                false
            } else {
                true
            }
        });
        sum += used as f64;
        max = max.max(used);
        let need = slot(p.size);
        if capacity - used < need {
            failed += 1;
        } else if p.hold > 0 {
            used += need;
            in_use.push_back((i + p.hold, need));
        }
    }
    Outcome {
        failed,
        in_use_mean: sum / s.len() as f64 / capacity as f64,
        in_use_max: max as f64 / capacity as f64,
    }
}

fn check(bytes: &[u8], i: usize) {
    assert_eq!(
        bytes[..8],
        (i as u64).to_le_bytes(),
        "object {i} read back wrong"
    );
}

/// The same stream on pinshm's store, one reader in this process.
fn pinshm_run(s: &[Put], capacity: u64, mode: Mode) -> Outcome {
    let mut w = ObjectStore::create(StoreConfig::new(capacity as usize, MAX_SIZE, 1))
        .expect("create store");
    let r = StoreReader::attach(&w.handle()).expect("attach");
    enum InUse {
        // Kept only to be dropped when its while is up.
        #[allow(dead_code)]
        Guard(ReadGuard),
        Unread(ObjectHandle),
    }
    let mut in_use: Vec<(usize, usize, u64, InUse)> = Vec::new(); // (due, object, bytes, what)
    let (mut used, mut failed, mut sum, mut max) = (0u64, 0, 0f64, 0u64);
    for (i, p) in s.iter().enumerate() {
        let mut k = 0;
        while k < in_use.len() {
            if in_use[k].0 <= i {
                let (_, obj, b, what) = in_use.swap_remove(k);
                if let InUse::Unread(h) = what {
                    check(&r.get(h).expect("an unread object stays"), obj);
                }
                used -= b;
            } else {
                k += 1;
            }
        }
        sum += used as f64;
        max = max.max(used);
        let key = format!("o{i}");
        let h = match w.put_with(&key, p.size, |buf| {
            buf[..8].copy_from_slice(&(i as u64).to_le_bytes())
        }) {
            Ok(h) => h,
            Err(Error::Full { .. }) => {
                failed += 1;
                continue;
            }
            Err(e) => panic!("put {i} of {} bytes: {e}", p.size),
        };
        if p.hold == 0 {
            check(&r.get(h).expect("get"), i);
            continue;
        }
        used += slot(p.size);
        let what = match mode {
            Mode::Guard => {
                let g = r.get(h).expect("get");
                check(&g, i);
                InUse::Guard(g)
            }
            Mode::Unread => InUse::Unread(h),
        };
        in_use.push((i + p.hold, i, slot(p.size), what));
    }
    drop(in_use);
    Outcome {
        failed,
        in_use_mean: sum / s.len() as f64 / capacity as f64,
        in_use_max: max as f64 / capacity as f64,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().unwrap_or_else(|_| panic!("bad value for {name}")))
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    let n: usize = arg(&args, "--puts", 20_000);
    let hold: usize = arg(&args, "--hold", 200);
    let seeds: u64 = arg(&args, "--seeds", 3);
    let p_hold: f64 = arg(&args, "--p-hold", 0.10);

    // (mode, target) -> per-seed (pinshm failed, ideal failed, in-use mean, in-use max, capacity)
    let mut cells: Vec<(Mode, f64, Vec<[f64; 5]>)> = Vec::new();
    for mode in [Mode::Guard, Mode::Unread] {
        for target in TARGETS {
            cells.push((mode, target, Vec::new()));
        }
    }
    for seed in 0..seeds {
        let s = stream(0x18_f4a6 + seed, n, p_hold, hold);
        let offered = offered_in_use(&s);
        for (mode, target, runs) in cells.iter_mut() {
            let capacity = ((offered / *target) as u64 / 64 * 64).max(slot(MAX_SIZE) * 2);
            let real = pinshm_run(&s, capacity, *mode);
            let best = ideal(&s, capacity);
            let row = [
                real.failed as f64 / n as f64,
                best.failed as f64 / n as f64,
                real.in_use_mean,
                real.in_use_max,
                capacity as f64,
            ];
            if json {
                println!(
                    "{}",
                    serde_json::json!({
                        "mode": mode.name(), "target_in_use": target, "seed": seed,
                        "capacity": capacity, "puts": n, "p_hold": p_hold, "hold_max": 2 * hold,
                        "failed": real.failed, "failed_frac": row[0],
                        "ideal_failed": best.failed, "ideal_failed_frac": row[1],
                        "in_use_mean": real.in_use_mean, "in_use_max": real.in_use_max,
                        "ideal_in_use_mean": best.in_use_mean,
                    })
                );
            }
            runs.push(row);
        }
    }
    if json {
        return;
    }
    println!(
        "{n} puts of 64 KiB-4 MiB (log-uniform), {:.0} % in use for 1..={} later puts, \
         the rest read at once; medians of {seeds} seeds",
        p_hold * 100.0,
        2 * hold
    );
    println!(
        "{:<7} {:>7} {:>9} {:>12} {:>11} {:>14} {:>13}",
        "in use",
        "target",
        "capacity",
        "in use mean",
        "in use max",
        "failed pinshm",
        "failed ideal"
    );
    for (mode, target, runs) in &cells {
        let col = |j: usize| median(runs.iter().map(|r| r[j]).collect());
        println!(
            "{:<7} {:>6.0}% {:>5.1} MiB {:>11.1}% {:>10.1}% {:>13.2}% {:>12.2}%",
            mode.name(),
            target * 100.0,
            col(4) / MIB as f64,
            col(2) * 100.0,
            col(3) * 100.0,
            col(0) * 100.0,
            col(1) * 100.0
        );
    }
}
