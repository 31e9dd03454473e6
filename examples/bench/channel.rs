//! The broadcast channel's rows of the bench: latency, wake-up,
//! throughput, idle CPU, each beside a baseline measured in the same run.

use std::hint::black_box;
use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::{median, monotonic_ns, KIB};

// ---------------------------------------------------------------------------

/// CPU time of the calling thread.
fn thread_cpu() -> std::time::Duration {
    let mut ts = nix::libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec to a valid pointer.
    unsafe { nix::libc::clock_gettime(nix::libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Ping-pong over two channels, both sides spinning: median of
/// (round trip / 2) over rounds of `batch` round trips.
fn bcast_latency_ns(size: usize, quick: bool) -> f64 {
    use pinshm::{channel::BroadcastConfig, Broadcast, BroadcastReader};
    use std::time::Duration;
    let spin = Duration::from_secs(1);
    let mut ping = Broadcast::create(BroadcastConfig::new(1, 64, size).spin(spin)).unwrap();
    let pong = Broadcast::create(BroadcastConfig::new(1, 64, size).spin(spin)).unwrap();
    let (hping, hpong) = (ping.handle(), pong.handle());
    let (rounds, batch) = if quick { (60, 200) } else { (200, 200) };
    let total = rounds * batch;
    let echo = std::thread::spawn(move || {
        let mut pong = pong;
        let rx = BroadcastReader::attach(&hping).unwrap();
        for _ in 0..total {
            let m = rx.recv().unwrap();
            pong.send(&m).unwrap();
        }
    });
    let rx = BroadcastReader::attach(&hpong).unwrap();
    let data = vec![7u8; size];
    let mut t = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t0 = Instant::now();
        for _ in 0..batch {
            ping.send(&data).unwrap();
            black_box(rx.recv().unwrap().len());
        }
        t.push(t0.elapsed().as_nanos() as f64 / batch as f64 / 2.0);
    }
    echo.join().unwrap();
    median(&mut t)
}

/// As `bcast_latency_ns`, with the echo in another process (this binary
/// re-executed with `--bcast-echo`): the channel as tp_workers uses it.
fn bcast_latency_xproc_ns(size: usize, quick: bool) -> f64 {
    use pinshm::{
        channel::{BroadcastConfig, BroadcastHandle},
        Broadcast, BroadcastReader,
    };
    use std::time::Duration;
    let spin = Duration::from_secs(1);
    let mut ping = Broadcast::create(BroadcastConfig::new(1, 64, size).spin(spin)).unwrap();
    let hping = serde_json::to_string(&ping.handle()).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--bcast-echo", &hping])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let hpong: BroadcastHandle = serde_json::from_str(line.trim()).unwrap();
    let mut rx = BroadcastReader::attach(&hpong).unwrap();
    rx.set_spin(spin);
    let (rounds, batch) = if quick { (60, 200) } else { (200, 200) };
    let data = vec![7u8; size];
    let mut t = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t0 = Instant::now();
        for _ in 0..batch {
            ping.send(&data).unwrap();
            black_box(rx.recv().unwrap().len());
        }
        t.push(t0.elapsed().as_nanos() as f64 / batch as f64 / 2.0);
    }
    drop(ping);
    child.wait().unwrap();
    median(&mut t)
}

/// The echo process of `bcast_latency_xproc_ns`.
pub(crate) fn bcast_echo(hping: &pinshm::channel::BroadcastHandle) {
    use pinshm::{channel::BroadcastConfig, Broadcast, BroadcastReader};
    let spin = std::time::Duration::from_secs(1);
    let mut rx = BroadcastReader::attach(hping).unwrap();
    rx.set_spin(spin);
    let slot = hping.slot_size as usize;
    let mut pong = Broadcast::create(BroadcastConfig::new(1, 64, slot).spin(spin)).unwrap();
    println!("{}", serde_json::to_string(&pong.handle()).unwrap());
    std::io::stdout().flush().unwrap();
    while let Ok(m) = rx.recv() {
        pong.send(&m).unwrap();
    }
}

/// The hardware floor: the same ping-pong through two atomics on their own
/// cache lines, both threads spinning.
fn atomic_pingpong_ns(quick: bool) -> f64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    #[repr(align(128))]
    struct Line(AtomicU64);
    let (a, b) = (
        std::sync::Arc::new(Line(AtomicU64::new(0))),
        std::sync::Arc::new(Line(AtomicU64::new(0))),
    );
    let (rounds, batch) = if quick { (60, 200) } else { (200, 200) };
    let total = (rounds * batch) as u64;
    let (a2, b2) = (a.clone(), b.clone());
    let echo = std::thread::spawn(move || {
        for i in 1..=total {
            while a2.0.load(Ordering::Acquire) != i {
                std::hint::spin_loop();
            }
            b2.0.store(i, Ordering::Release);
        }
    });
    let mut t = Vec::with_capacity(rounds);
    let mut i = 0u64;
    for _ in 0..rounds {
        let t0 = Instant::now();
        for _ in 0..batch {
            i += 1;
            a.0.store(i, Ordering::Release);
            while b.0.load(Ordering::Acquire) != i {
                std::hint::spin_loop();
            }
        }
        t.push(t0.elapsed().as_nanos() as f64 / batch as f64 / 2.0);
    }
    echo.join().unwrap();
    median(&mut t)
}

/// Send to receive when the reader sleeps (no spin, 1 ms between messages):
/// median one-way ns, by CLOCK_MONOTONIC stamped into the message. With
/// `crossbeam`, the same through a crossbeam channel (its blocked receiver
/// parks on a futex too).
fn bcast_wake_ns(crossbeam: bool, quick: bool) -> f64 {
    use pinshm::{channel::BroadcastConfig, Broadcast, BroadcastReader};
    use std::time::Duration;
    let n = if quick { 100 } else { 300 };
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    if crossbeam {
        let (tx, rx) = crossbeam_channel::bounded::<u64>(64);
        let r = std::thread::spawn(move || {
            let mut lat = Vec::new();
            while let Ok(ts) = rx.recv() {
                lat.push(monotonic_ns().saturating_sub(ts) as f64);
                done_tx.send(()).unwrap();
            }
            median(&mut lat)
        });
        for _ in 0..n {
            std::thread::sleep(Duration::from_millis(1));
            tx.send(monotonic_ns()).unwrap();
            done_rx.recv().unwrap();
        }
        drop(tx);
        return r.join().unwrap();
    }
    let mut tx = Broadcast::create(BroadcastConfig::new(1, 64, 64).spin(Duration::ZERO)).unwrap();
    let h = tx.handle();
    let r = std::thread::spawn(move || {
        let rx = BroadcastReader::attach(&h).unwrap();
        let mut lat = Vec::new();
        while let Ok(m) = rx.recv() {
            let ts = u64::from_le_bytes(m[..8].try_into().unwrap());
            lat.push(monotonic_ns().saturating_sub(ts) as f64);
            done_tx.send(()).unwrap();
        }
        median(&mut lat)
    });
    std::thread::sleep(Duration::from_millis(10));
    for _ in 0..n {
        std::thread::sleep(Duration::from_millis(1));
        tx.send(&monotonic_ns().to_le_bytes()).unwrap();
        done_rx.recv().unwrap();
    }
    drop(tx);
    r.join().unwrap()
}

/// Messages of 64 B per second per reader, `readers` reader threads; with
/// `crossbeam`, one bounded crossbeam channel per reader (the writer sends
/// each message into every one), as a baseline.
pub(crate) fn bcast_throughput(readers: u32, crossbeam: bool, quick: bool) -> Vec<f64> {
    use pinshm::{channel::BroadcastConfig, Broadcast, BroadcastReader};
    let n: u64 = if quick { 300_000 } else { 2_000_000 };
    let msg = [5u8; 64];
    fn timed(n: u64, count: impl FnOnce() -> u64) -> f64 {
        let t0 = Instant::now();
        let got = count();
        assert_eq!(got, n);
        n as f64 / t0.elapsed().as_secs_f64()
    }
    if crossbeam {
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..readers)
            .map(|_| crossbeam_channel::bounded::<[u8; 64]>(1024))
            .unzip();
        let hs: Vec<_> = rxs
            .into_iter()
            .map(|rx| {
                std::thread::spawn(move || {
                    timed(n, || {
                        let mut k = 0;
                        while let Ok(m) = rx.recv() {
                            black_box(m[0]);
                            k += 1;
                        }
                        k
                    })
                })
            })
            .collect();
        for _ in 0..n {
            for tx in &txs {
                tx.send(msg).unwrap();
            }
        }
        drop(txs);
        return hs.into_iter().map(|h| h.join().unwrap()).collect();
    }
    let mut tx = Broadcast::create(BroadcastConfig::new(readers, 1024, 64)).unwrap();
    let h = tx.handle();
    let hs: Vec<_> = (0..readers)
        .map(|_| {
            let h = h.clone();
            std::thread::spawn(move || {
                let rx = BroadcastReader::attach(&h).unwrap();
                timed(n, || {
                    let mut k = 0;
                    while let Ok(m) = rx.recv() {
                        black_box(m[0]);
                        k += 1;
                    }
                    k
                })
            })
        })
        .collect();
    for _ in 0..n {
        tx.send(&msg).unwrap();
    }
    drop(tx);
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

/// CPU ns a reader thread uses while blocked for 1 s in `recv_timeout`
/// (crossbeam: the same in its `recv_timeout`).
pub(crate) fn bcast_idle_cpu_ns(crossbeam: bool) -> f64 {
    use pinshm::{channel::BroadcastConfig, Broadcast, BroadcastReader};
    use std::time::Duration;
    let second = Duration::from_secs(1);
    if crossbeam {
        let (_tx, rx) = crossbeam_channel::bounded::<u64>(1);
        return std::thread::spawn(move || {
            let c0 = thread_cpu();
            assert!(rx.recv_timeout(second).is_err());
            (thread_cpu() - c0).as_nanos() as f64
        })
        .join()
        .unwrap();
    }
    let tx = Broadcast::create(BroadcastConfig::new(1, 8, 64)).unwrap();
    let h = tx.handle();
    let cpu = std::thread::spawn(move || {
        let rx = BroadcastReader::attach(&h).unwrap();
        let c0 = thread_cpu();
        assert!(rx.recv_timeout(second).is_err());
        (thread_cpu() - c0).as_nanos() as f64
    })
    .join()
    .unwrap();
    drop(tx);
    cpu
}

/// Runs the broadcast ops and prints them (one JSON object per line with
/// `--json`).
pub(crate) fn bcast_bench(json: bool, quick: bool) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let line = |op: &str, size: usize, ns: f64, base: &str, base_ns: f64, extra: String| {
        if json {
            println!(
                "{{\"op\": \"{op}\", \"size\": {size}, \"median_ns\": {ns:.1}, \"baseline\": \"{base}\", \"baseline_median_ns\": {base_ns:.1}, \"ratio\": {:.3}{extra}}}",
                ns / base_ns
            );
        } else {
            println!(
                "{op:<20} {size:>10} {ns:>14.1}   baseline {base} {base_ns:.1} (ratio {:.2}){extra}",
                ns / base_ns
            );
        }
    };
    if !json {
        println!("\nbroadcast channel: medians in ns; baselines measured in the same run");
    }
    let floor = atomic_pingpong_ns(quick);
    for size in [64, 4 * KIB] {
        line(
            "bcast_latency",
            size,
            bcast_latency_ns(size, quick),
            "atomic_pingpong",
            floor,
            String::new(),
        );
    }
    line(
        "bcast_latency_xproc",
        64,
        bcast_latency_xproc_ns(64, quick),
        "atomic_pingpong",
        floor,
        String::new(),
    );
    line(
        "bcast_wake",
        8,
        bcast_wake_ns(false, quick),
        "crossbeam_channel",
        bcast_wake_ns(true, quick),
        String::new(),
    );
    for readers in [1, 2] {
        let ours = bcast_throughput(readers, false, quick);
        let base = bcast_throughput(readers, true, quick);
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let (m, b) = (mean(&ours), mean(&base));
        let extra = if json {
            format!(
                ", \"readers\": {readers}, \"msgs_per_s_per_reader\": {:?}, \"baseline_msgs_per_s_per_reader\": {:?}, \"cores\": {cores}",
                ours.iter().map(|x| x.round()).collect::<Vec<_>>(),
                base.iter().map(|x| x.round()).collect::<Vec<_>>()
            )
        } else {
            format!(
                "  [{readers} reader(s): {:.2} M msgs/s per reader; crossbeam {:.2} M]",
                m / 1e6,
                b / 1e6
            )
        };
        line(
            &format!("bcast_throughput_{readers}r"),
            64,
            1e9 / m,
            "crossbeam_channel",
            1e9 / b,
            extra,
        );
    }
    if !json && cores < 3 {
        println!(
            "note: {cores} cores: with 2 readers, the writer and both readers (3 threads) share {cores} cores, so readers sleep and wake instead of spinning; the 2-reader figures measure the scheduler as much as the channel"
        );
    }
    line(
        "bcast_idle_cpu",
        0,
        bcast_idle_cpu_ns(false),
        "crossbeam_channel",
        bcast_idle_cpu_ns(true),
        if json {
            ", \"per\": \"1 s blocked\"".into()
        } else {
            "  [CPU ns per 1 s blocked in recv_timeout]".into()
        },
    );
}
