//! Soak run: one writer and 2 reader processes for minutes, random object
//! sizes (1 B to 2 MiB), readers killed with SIGKILL and restarted at random.
//! Every object a reader gets is checked against the writer's checksum.
//! Reports objects moved, bytes verified and errors by kind; exits non-zero
//! on any corrupt byte.
//!
//! `cargo run --release --example soak -- --seconds 120`

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use pinshm::{
    store::{ObjectHandle, StoreHandle},
    Error, ObjectStore, StoreConfig, StoreReader,
};

const MIB: usize = 1 << 20;

fn checksum(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ bytes.len() as u64;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        h = (h ^ u64::from_le_bytes(c.try_into().unwrap()))
            .wrapping_mul(0x100_0000_01b3)
            .rotate_left(29);
    }
    for &b in chunks.remainder() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn reader(rank: u32, sh: &StoreHandle) {
    let r = StoreReader::attach_as(sh, rank).expect("attach");
    let (mut ok, mut bytes, mut stale, mut corrupt) = (0u64, 0u64, 0u64, 0u64);
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let f: Vec<u64> = line.split(' ').map(|x| x.parse().unwrap()).collect();
        match r.get(ObjectHandle {
            address: f[0],
            monotonic_id: f[1],
            epoch: f[2],
        }) {
            Ok(g) => {
                if g.len() as u64 == f[3] && checksum(&g) == f[4] {
                    ok += 1;
                    bytes += g.len() as u64;
                } else {
                    corrupt += 1;
                }
            }
            Err(e) if e.is_stale() => stale += 1,
            Err(e) => panic!("reader {rank}: {e}"),
        }
        // Report progress continuously: a killed reader's last line counts.
        println!("{ok} {bytes} {stale} {corrupt}");
    }
}

struct Reader {
    child: Child,
    pipe: Option<ChildStdin>,
    progress: std::sync::mpsc::Receiver<String>,
    last: String,
}

fn spawn(rank: u32, sh: &str) -> Reader {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--reader", &rank.to_string(), sh])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pipe = child.stdin.take().unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let (tx, progress) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in out.lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    Reader {
        child,
        pipe: Some(pipe),
        progress,
        last: "0 0 0 0".into(),
    }
}

impl Reader {
    fn drain(&mut self) {
        while let Ok(l) = self.progress.try_recv() {
            self.last = l;
        }
    }
    fn totals(&self) -> [u64; 4] {
        let v: Vec<u64> = self
            .last
            .split(' ')
            .map(|x| x.parse().unwrap_or(0))
            .collect();
        [v[0], v[1], v[2], v[3]]
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(p) = args.iter().position(|a| a == "--reader") {
        let sh: StoreHandle = serde_json::from_str(&args[p + 2]).unwrap();
        reader(args[p + 1].parse().unwrap(), &sh);
        return;
    }
    let seconds: u64 = args
        .iter()
        .position(|a| a == "--seconds")
        .map(|p| args[p + 1].parse().unwrap())
        .unwrap_or(60);
    let mut w = ObjectStore::create(StoreConfig::new(64 * MIB, 2 * MIB, 2)).unwrap();
    let sh = serde_json::to_string(&w.handle()).unwrap();
    let mut readers: Vec<Reader> = (0..2).map(|r| spawn(r, &sh)).collect();
    let mut rng = Rng(0x50a4);
    let mut done = [0u64; 4]; // totals of killed readers: ok, bytes, stale, corrupt
    let (mut puts, mut full_waits, mut restarts, mut put_bytes) = (0u64, 0u64, 0u64, 0u64);
    let t0 = Instant::now();
    let mut next_kill = Instant::now() + Duration::from_millis(500 + rng.next() % 1500);
    while t0.elapsed() < Duration::from_secs(seconds) {
        let len = (rng.next() % (2 * MIB as u64)) as usize + 1;
        let seed = rng.next();
        let mut sum = 0;
        let h = match w.put_with(&format!("k{puts}"), len, |s| {
            let mut x = seed | 1;
            for c in s.chunks_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let b = x.to_le_bytes();
                c.copy_from_slice(&b[..c.len()]);
            }
            sum = checksum(s);
        }) {
            Ok(h) => h,
            Err(Error::Full { .. }) => {
                full_waits += 1;
                std::thread::sleep(Duration::from_micros(200));
                continue;
            }
            Err(e) => panic!("put: {e}"),
        };
        puts += 1;
        put_bytes += len as u64;
        for r in &mut readers {
            // A reader being restarted may have closed its pipe: skip it.
            if let Some(p) = &mut r.pipe {
                let _ = writeln!(
                    p,
                    "{} {} {} {len} {sum}",
                    h.address, h.monotonic_id, h.epoch
                );
            }
        }
        if Instant::now() >= next_kill {
            let i = (rng.next() % 2) as usize;
            let _ = readers[i].child.kill(); // SIGKILL
            let _ = readers[i].child.wait();
            std::thread::sleep(Duration::from_millis(20));
            readers[i].drain();
            for (d, v) in done.iter_mut().zip(readers[i].totals()) {
                *d += v;
            }
            readers[i] = spawn(i as u32, &sh);
            restarts += 1;
            next_kill = Instant::now() + Duration::from_millis(500 + rng.next() % 1500);
        }
    }
    let mut totals = done;
    for mut r in readers {
        r.pipe.take(); // end of input: the reader finishes and exits
        let _ = r.child.wait();
        std::thread::sleep(Duration::from_millis(20));
        r.drain();
        for (t, v) in totals.iter_mut().zip(r.totals()) {
            *t += v;
        }
    }
    let s = w.stats();
    println!("soak: {seconds} s, 1 writer, 2 reader processes, objects 1 B..2 MiB, ring 64 MiB");
    println!(
        "writer: {puts} objects put ({:.1} GiB), {full_waits} waits on a full ring, {} evictions",
        put_bytes as f64 / (1u64 << 30) as f64,
        s.evictions
    );
    println!("readers: {restarts} killed with SIGKILL and restarted, {} dead readers reaped by the writer", s.dead_readers_reaped);
    println!(
        "readers: {} objects verified ({:.1} GiB), {} stale (reclaimed before a restarted reader counted them), {} corrupt",
        totals[0],
        totals[1] as f64 / (1u64 << 30) as f64,
        totals[2],
        totals[3]
    );
    drop(w); // unlinks the segment (process::exit would skip it)
    std::process::exit(i32::from(totals[3] > 0));
}
