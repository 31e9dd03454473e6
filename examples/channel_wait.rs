//! What the broadcast channel's waiting costs and buys, alone (no Python,
//! no pickling): one writer thread, one reader thread, a reply channel back
//! (the writer waits for each reply: one message in flight), for each
//! spin policy, back to back and at one message per 5 ms.
//!
//! `cargo run --release --example channel_wait [-- --quick]`
//!
//! Latency: one way, writer's send to the reader's `recv` returning (both
//! threads read one `Instant` base). CPU: the reader thread's own user +
//! system time (`RUSAGE_THREAD`) over the run, in % of a core.

use std::time::{Duration, Instant};

use pinshm::{Broadcast, BroadcastConfig, BroadcastReader, SpinPolicy, WaitStats};

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
    stats: WaitStats,
}

fn run(policy: SpinPolicy, cadence: Option<Duration>, n: usize) -> Outcome {
    let base = Instant::now();
    let mut rpc = Broadcast::create(BroadcastConfig::new(1, 4, 64)).unwrap();
    let mut resp = Broadcast::create(BroadcastConfig::new(1, 4, 64)).unwrap();
    let (h, rh) = (rpc.handle(), resp.handle());
    let back = BroadcastReader::attach(&rh).unwrap();
    let reader = std::thread::spawn(move || {
        let mut rx = BroadcastReader::attach(&h).unwrap();
        rx.set_spin_policy(policy);
        let (c0, w0) = (thread_cpu(), Instant::now());
        for _ in 0..n {
            let m = rx.recv().unwrap();
            let now = base.elapsed().as_nanos() as u64;
            let sent = u64::from_le_bytes(m[..8].try_into().unwrap());
            drop(m);
            resp.send(&(now - sent).to_le_bytes()).unwrap();
        }
        let cpu = (thread_cpu() - c0).as_secs_f64() / w0.elapsed().as_secs_f64();
        (cpu, rx.wait_stats(false))
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
    let (cpu, stats) = reader.join().unwrap();
    let warm = n / 10;
    let mut l = lat.split_off(warm);
    l.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Outcome {
        median_us: l[l.len() / 2],
        p99_us: l[(l.len() * 99 / 100).min(l.len() - 1)],
        reader_cpu: 100.0 * cpu,
        stats,
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let policies = [
        ("never spin", SpinPolicy::new(Duration::ZERO)),
        (
            "adaptive, cap 200 µs (the old default)",
            SpinPolicy::adaptive(Duration::from_micros(200)),
        ),
        (
            "predictive, cap 200 µs (default)",
            SpinPolicy::new(Duration::from_micros(200)),
        ),
        (
            "fixed 200 µs",
            SpinPolicy::fixed(Duration::from_micros(200)),
        ),
        (
            "spin through (fixed 10 ms)",
            SpinPolicy::fixed(Duration::from_millis(10)),
        ),
    ];
    let (n_b2b, n_cad) = if quick { (5_000, 200) } else { (20_000, 600) };
    println!("| pattern | reader spin | median | p99 | reader CPU | caught: ready / spin / early / window / sleep | timed-wake overshoot mean / max |");
    println!("|---|---|---|---|---|---|---|");
    for (pattern, cadence, n) in [
        ("back to back", None, n_b2b),
        ("every 5 ms", Some(Duration::from_millis(5)), n_cad),
    ] {
        for (name, p) in policies {
            let o = run(p, cadence, n);
            let s = o.stats;
            let over = if s.overshoots == 0 {
                "-".to_owned()
            } else {
                format!(
                    "{:.1} / {:.1} µs",
                    s.overshoot_total.as_secs_f64() * 1e6 / s.overshoots as f64,
                    s.overshoot_max.as_secs_f64() * 1e6
                )
            };
            println!(
                "| {pattern} | {name} | {:.1} µs | {:.1} µs | {:.1} % | {} / {} / {} / {} / {} | {over} |",
                o.median_us, o.p99_us, o.reader_cpu, s.ready, s.spin, s.early, s.window, s.sleep
            );
        }
    }
}
