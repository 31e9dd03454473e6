//! What the broadcast channel's waiting costs and buys, alone (no Python,
//! no pickling): one writer thread, one reader thread, a reply channel back
//! (the writer waits for each reply: one message in flight), with the
//! default wait and with none, back to back and at one message per 5 ms,
//! the two interleaved in rounds (medians over the rounds, ratios to the
//! best).
//!
//! `cargo run --release --example channel_wait [-- --quick]`
//!
//! Latency: one way, writer's send to the reader's `recv` returning (both
//! threads read one `Instant` base). CPU: the reader thread's own user +
//! system time (`RUSAGE_THREAD`) over the run, in % of a core.

use std::time::{Duration, Instant};

use pinshm::{channel::BroadcastConfig, Broadcast, BroadcastReader};

fn thread_cpu() -> Duration {
    let mut ru = std::mem::MaybeUninit::<nix::libc::rusage>::uninit();
    // SAFETY: getrusage writes one rusage to a valid pointer.
    let r = unsafe { nix::libc::getrusage(nix::libc::RUSAGE_THREAD, ru.as_mut_ptr()) };
    assert_eq!(r, 0);
    // SAFETY: initialised by the successful call.
    let ru = unsafe { ru.assume_init() };
    let tv = |t: nix::libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

struct Outcome {
    median_us: f64,
    p99_us: f64,
    reader_cpu: f64,
}

fn run(spin: Duration, cadence: Option<Duration>, n: usize) -> Outcome {
    let base = Instant::now();
    let mut rpc = Broadcast::create(BroadcastConfig::new(1, 4, 64)).unwrap();
    let mut resp = Broadcast::create(BroadcastConfig::new(1, 4, 64)).unwrap();
    let (h, rh) = (rpc.handle(), resp.handle());
    let back = BroadcastReader::attach(&rh).unwrap();
    let reader = std::thread::spawn(move || {
        let mut rx = BroadcastReader::attach(&h).unwrap();
        rx.set_spin(spin);
        let (c0, w0) = (thread_cpu(), Instant::now());
        for _ in 0..n {
            let m = rx.recv().unwrap();
            let now = base.elapsed().as_nanos() as u64;
            let sent = u64::from_le_bytes(m[..8].try_into().unwrap());
            drop(m);
            resp.send(&(now - sent).to_le_bytes()).unwrap();
        }
        (thread_cpu() - c0).as_secs_f64() / w0.elapsed().as_secs_f64()
    });
    let mut lat = Vec::with_capacity(n);
    let mut tick = Instant::now();
    for _ in 0..n {
        if let Some(c) = cadence {
            tick += c;
            if let Some(d) = tick.checked_duration_since(Instant::now()) {
                std::thread::sleep(d);
            }
        }
        rpc.send(&(base.elapsed().as_nanos() as u64).to_le_bytes())
            .unwrap();
        let r = back.recv().unwrap();
        lat.push(u64::from_le_bytes(r[..8].try_into().unwrap()) as f64 / 1e3);
    }
    let cpu = reader.join().unwrap();
    let warm = n / 10;
    let mut l = lat.split_off(warm);
    l.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Outcome {
        median_us: l[l.len() / 2],
        p99_us: l[(l.len() * 99 / 100).min(l.len() - 1)],
        reader_cpu: 100.0 * cpu,
    }
}

/// The median of `v` (sorted in place).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    // The two waits a reader has: the channel's default (a short spin
    // while recent waits say it pays, and a window around the predicted
    // arrival at a steady period), and none (sleep at once: spin 0).
    let policies = [
        ("never spin", Duration::ZERO),
        (
            "default (predictive), cap 200 µs",
            Duration::from_micros(200),
        ),
    ];
    // Policies interleaved: each round runs every policy once, so a load
    // that comes and goes on a shared machine falls on all of them; the
    // figures are medians over the rounds, and ratios to the best median.
    let (rounds, n_b2b, n_cad) = if quick {
        (5, 2_000, 200)
    } else {
        (9, 5_000, 400)
    };
    println!("{rounds} rounds, policies interleaved; medians over the rounds");
    println!();
    println!("| pattern | reader spin | median | / best | p99 | reader CPU |");
    println!("|---|---|---|---|---|---|");
    for (pattern, cadence, n) in [
        ("back to back", None, n_b2b),
        ("every 5 ms", Some(Duration::from_millis(5)), n_cad),
    ] {
        let mut med = vec![Vec::new(); policies.len()];
        let mut p99 = vec![Vec::new(); policies.len()];
        let mut cpu = vec![Vec::new(); policies.len()];
        for _ in 0..rounds {
            for (i, &(_, spin)) in policies.iter().enumerate() {
                let o = run(spin, cadence, n);
                med[i].push(o.median_us);
                p99[i].push(o.p99_us);
                cpu[i].push(o.reader_cpu);
            }
        }
        let meds: Vec<f64> = med.iter_mut().map(|v| median(v)).collect();
        let best = meds.iter().cloned().fold(f64::INFINITY, f64::min);
        for (i, (name, _)) in policies.iter().enumerate() {
            println!(
                "| {pattern} | {name} | {:.1} µs | {:.2}× | {:.1} µs | {:.1} % |",
                meds[i],
                meds[i] / best,
                median(&mut p99[i]),
                median(&mut cpu[i]),
            );
        }
    }
}
