//! The broadcast channel, with real processes (this test binary
//! re-executed: the `channel_child` entry point is `#[ignore]`d so it never
//! counts as a pass, and children run it with `--ignored`) and threads.
//! Every test uses its own segment name and removes it even on panic.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{checksum, pattern, scribble, Name, Rng};
use pinshm::{
    channel::{BroadcastConfig, BroadcastHandle},
    Broadcast, BroadcastReader, Error,
};

const SECS: Duration = Duration::from_secs(20);

/// The writer and each reader move to another thread; the handle is
/// `Clone + Send` (and serde, used throughout).
const _: fn() = || {
    fn send<T: Send>() {}
    fn clone_send<T: Clone + Send>() {}
    send::<Broadcast>();
    send::<BroadcastReader>();
    clone_send::<BroadcastHandle>();
};

/// Re-runs this binary as a child running only `channel_child` with role
/// `role`, the handle and extra environment.
fn spawn_role(role: &str, env: &[(&str, String)]) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "channel_child",
        "--exact",
        "--nocapture",
        "--test-threads=1",
        "--ignored",
    ])
    .env("PINSHM_CHILD", role)
    .stdin(Stdio::piped())
    .stdout(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn child test process")
}

fn handle_env(h: &BroadcastHandle) -> (&'static str, String) {
    ("PINSHM_HANDLE", serde_json::to_string(h).unwrap())
}

/// The next `RESULT ...` line of a child.
fn next_result(r: &mut impl BufRead) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            r.read_line(&mut line).unwrap() > 0,
            "child closed its output"
        );
        if let Some((_, rest)) = line.split_once("RESULT ") {
            return rest.trim().to_owned();
        }
    }
}

/// Waits for a child and returns its last RESULT line.
fn last_result(child: Child) -> String {
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "child failed ({}):\n{text}",
        out.status
    );
    text.lines()
        .rev()
        .find_map(|l| l.split_once("RESULT ").map(|(_, r)| r.trim().to_owned()))
        .unwrap_or_else(|| panic!("child printed no RESULT line:\n{text}"))
}

fn kill9(child: &mut Child) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let _ = child.wait();
}

/// Kills the child when the test ends, even by panic.
struct Reaper(Option<Child>);
impl Drop for Reaper {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Message `i` of a stream: its length comes from `rng`, its bytes from
/// `pattern(i, len)`.
fn stream_len(rng: &mut Rng, max: usize) -> usize {
    1 + rng.below(max as u64) as usize
}

fn say(s: &str) {
    let mut out = std::io::stdout();
    writeln!(out, "RESULT {s}").unwrap();
    out.flush().unwrap();
}

/// Child roles (run only with `--ignored` by the tests below).
#[test]
#[ignore = "child entry point of the multi-process tests"]
fn channel_child() {
    let Ok(role) = std::env::var("PINSHM_CHILD") else {
        return;
    };
    let env = |k: &str| std::env::var(k).unwrap();
    match role.as_str() {
        // Receive the stream of `stream_len` messages, check each, report.
        "stream" => {
            let h: BroadcastHandle = serde_json::from_str(&env("PINSHM_HANDLE")).unwrap();
            let rank: u32 = env("PINSHM_RANK").parse().unwrap();
            let n: u64 = env("PINSHM_N").parse().unwrap();
            let rx = BroadcastReader::attach_as(&h, rank).unwrap();
            let mut rng = Rng(0x5eed);
            let mut sum = 0u64;
            for i in 0..n {
                let len = stream_len(&mut rng, h.slot_size as usize);
                let m = rx.recv().unwrap();
                assert_eq!(m.seq(), i);
                assert_eq!(m.len(), len, "message {i} has the wrong length");
                assert!(*m == pattern(i, len)[..], "message {i} has the wrong bytes");
                sum = sum.wrapping_add(checksum(&m));
            }
            say(&format!("{n} {sum}"));
        }
        // Hold each message a while, checking it is not overwritten meanwhile.
        "slow" => {
            let h: BroadcastHandle = serde_json::from_str(&env("PINSHM_HANDLE")).unwrap();
            let n: u64 = env("PINSHM_N").parse().unwrap();
            let rx = BroadcastReader::attach_as(&h, 0).unwrap();
            say("attached");
            for i in 0..n {
                let m = rx.recv().unwrap();
                let before = m.to_vec();
                assert_eq!(before, pattern(i, before.len()));
                std::thread::sleep(Duration::from_millis(2));
                assert!(*m == before[..], "message {i} changed while held");
            }
            say(&format!("{n} held and intact"));
        }
        // Receive one message, keep it, and wait to be killed.
        "hold" => {
            let h: BroadcastHandle = serde_json::from_str(&env("PINSHM_HANDLE")).unwrap();
            let rx = BroadcastReader::attach_as(&h, 1).unwrap();
            let m = rx.recv().unwrap();
            say(&format!("holding {}", m.seq()));
            std::thread::sleep(Duration::from_secs(60));
        }
        // Create the channel, print its handle, then send forever once told.
        "writer" => {
            let mut tx =
                Broadcast::create(BroadcastConfig::new(2, 16, 256).name(env("PINSHM_NAME")))
                    .unwrap();
            say(&serde_json::to_string(&tx.handle()).unwrap());
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).unwrap();
            let t0 = Instant::now();
            for i in 0u64.. {
                assert!(
                    t0.elapsed() < Duration::from_secs(30),
                    "writer child gave up"
                );
                tx.send(&pattern(i, 1 + (i % 256) as usize)).unwrap();
            }
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn three_reader_processes_receive_ten_thousand_messages_in_order_and_intact() {
    let name = Name::new("bcast-stream");
    let n = 10_000u64;
    let mut tx = Broadcast::create(BroadcastConfig::new(3, 32, 1000).name(&*name)).unwrap();
    let h = tx.handle();
    let kids: Vec<_> = (0..3)
        .map(|rank| {
            spawn_role(
                "stream",
                &[
                    handle_env(&h),
                    ("PINSHM_RANK", rank.to_string()),
                    ("PINSHM_N", n.to_string()),
                ],
            )
        })
        .collect();
    let mut rng = Rng(0x5eed);
    let mut sum = 0u64;
    for i in 0..n {
        let len = stream_len(&mut rng, 1000);
        let data = pattern(i, len);
        sum = sum.wrapping_add(checksum(&data));
        tx.send_timeout(&data, SECS).unwrap();
    }
    for k in kids {
        assert_eq!(last_result(k), format!("{n} {sum}"));
    }
}

#[test]
fn a_slow_reader_makes_the_writer_wait_and_no_slot_is_overwritten_under_it() {
    let name = Name::new("bcast-slow");
    let n = 200u64;
    let mut tx = Broadcast::create(BroadcastConfig::new(1, 4, 512).name(&*name)).unwrap();
    let mut child = spawn_role(
        "slow",
        &[handle_env(&tx.handle()), ("PINSHM_N", n.to_string())],
    );
    let mut out = BufReader::new(child.stdout.take().unwrap());
    assert_eq!(next_result(&mut out), "attached");
    let mut waited = 0;
    for i in 0..n {
        let data = pattern(i, 1 + (i as usize * 7) % 512);
        if !tx.try_send(&data).unwrap() {
            waited += 1;
            tx.send_timeout(&data, SECS).unwrap();
        }
    }
    assert!(
        waited > 0,
        "a 4-slot ring ahead of a slow reader must make the writer wait"
    );
    assert_eq!(next_result(&mut out), format!("{n} held and intact"));
    assert!(child.wait().unwrap().success());
}

#[test]
fn a_reader_killed_while_holding_a_message_stops_blocking_the_writer() {
    let name = Name::new("bcast-kill-reader");
    let mut tx = Broadcast::create(BroadcastConfig::new(2, 4, 64).name(&*name)).unwrap();
    let h = tx.handle();
    let rx0 = BroadcastReader::attach_as(&h, 0).unwrap();
    let mut child = Reaper(Some(spawn_role("hold", &[handle_env(&h)])));
    let mut out = BufReader::new(child.0.as_mut().unwrap().stdout.take().unwrap());
    tx.send(b"m0").unwrap();
    assert_eq!(next_result(&mut out), "holding 0");
    // Reader 0 keeps up; reader 1 holds message 0, so the ring fills.
    let mut sent = 1u64;
    while tx.try_send(format!("m{sent}").as_bytes()).unwrap() {
        assert_eq!(*rx0.recv().unwrap(), *format!("m{}", sent - 1).as_bytes());
        sent += 1;
        assert!(sent < 10, "the writer never waited for the holding reader");
    }
    assert_eq!(sent, 4, "4 slots, message 0 held");
    kill9(child.0.as_mut().unwrap());
    // Within the liveness bound the dead reader stops counting.
    for i in sent..sent + 20 {
        tx.send_timeout(format!("m{i}").as_bytes(), SECS).unwrap();
        let m = rx0.recv_timeout(SECS).unwrap();
        assert_eq!(*m, *format!("m{}", i - 1).as_bytes());
    }
    // Its index can be taken again, and the new reader gets new messages.
    let rx1 = BroadcastReader::attach_as(&h, 1).unwrap();
    tx.send(b"after").unwrap();
    assert_eq!(*rx0.recv().unwrap(), *b"m23");
    assert_eq!(*rx0.recv().unwrap(), *b"after");
    assert_eq!(*rx1.recv().unwrap(), *b"after");
}

#[test]
fn a_writer_killed_mid_stream_lets_every_reader_drain_then_get_writer_gone() {
    let name = Name::new("bcast-kill-writer");
    let mut child = Reaper(Some(spawn_role(
        "writer",
        &[("PINSHM_NAME", name.0.clone())],
    )));
    let mut out = BufReader::new(child.0.as_mut().unwrap().stdout.take().unwrap());
    let h: BroadcastHandle = serde_json::from_str(&next_result(&mut out)).unwrap();
    let (count_tx, count_rx) = std::sync::mpsc::channel();
    let readers: Vec<_> = (0..2)
        .map(|rank| {
            let h = h.clone();
            let count_tx = count_tx.clone();
            std::thread::spawn(move || {
                let rx = BroadcastReader::attach_as(&h, rank).unwrap();
                let mut i = 0u64;
                loop {
                    match rx.recv_timeout(SECS) {
                        Ok(m) => {
                            assert_eq!(*m, pattern(i, 1 + (i % 256) as usize)[..], "message {i}");
                            i += 1;
                            if i == 1000 {
                                count_tx.send(()).unwrap();
                            }
                        }
                        Err(Error::WriterGone { .. }) => return i,
                        Err(e) => panic!("reader {rank} after {i} messages: {e}"),
                    }
                }
            })
        })
        .collect();
    let stdin = child.0.as_mut().unwrap().stdin.as_mut().unwrap();
    writeln!(stdin, "go").unwrap();
    stdin.flush().unwrap();
    count_rx.recv_timeout(SECS).unwrap();
    kill9(child.0.as_mut().unwrap());
    let got: Vec<u64> = readers.into_iter().map(|r| r.join().unwrap()).collect();
    assert!(got[0] >= 1000);
    assert_eq!(
        got[0], got[1],
        "every reader drains everything that was sent"
    );
    // The dead writer's channel is replaced by the next writer of the name.
    let tx = Broadcast::create(BroadcastConfig::new(1, 4, 64).name(&*name)).unwrap();
    assert_ne!(tx.handle().nonce, h.nonce);
}

#[test]
fn dropping_the_writer_lets_readers_drain_then_get_writer_gone() {
    let name = Name::new("bcast-drop-writer");
    let mut tx = Broadcast::create(BroadcastConfig::new(2, 8, 64).name(&*name)).unwrap();
    let h = tx.handle();
    let rx = BroadcastReader::attach_as(&h, 0).unwrap();
    for i in 0..5u8 {
        tx.send(&[i]).unwrap();
    }
    drop(tx);
    assert!(!name.exists(), "the writer unlinks its segment");
    // Index 1 never attached: it still gets everything (from its mapping).
    for i in 0..5u8 {
        assert_eq!(*rx.recv().unwrap(), [i]);
    }
    assert!(matches!(rx.recv(), Err(Error::WriterGone { .. })));
    assert!(matches!(rx.try_recv(), Err(Error::WriterGone { .. })));
}

#[test]
fn a_sleeping_reader_is_woken_when_the_writer_is_dropped() {
    let name = Name::new("bcast-wake-gone");
    let tx = Broadcast::create(BroadcastConfig::new(1, 8, 64).name(&*name)).unwrap();
    // Attached before the writer goes (attaching after is another test's
    // error); the outcome is the same whether the drop lands before the
    // reader sleeps or while it does.
    let rx = BroadcastReader::attach(&tx.handle()).unwrap();
    let (started, waiting) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        started.send(()).unwrap();
        let gone = matches!(rx.recv(), Err(Error::WriterGone { .. }));
        gone
    });
    waiting.recv().unwrap();
    drop(tx);
    assert!(t.join().unwrap());
}

#[test]
fn timeouts_too_long_for_the_clock_wait_without_a_deadline() {
    let name = Name::new("bcast-max-timeout");
    let mut tx = Broadcast::create(BroadcastConfig::new(1, 2, 64).name(&*name)).unwrap();
    let rx = BroadcastReader::attach(&tx.handle()).unwrap();
    tx.send_timeout(b"a", Duration::MAX).unwrap();
    assert_eq!(&rx.recv_timeout(Duration::MAX).unwrap()[..], b"a");
}

#[test]
fn timeouts_on_both_sides_say_what_they_waited_for() {
    let name = Name::new("bcast-timeouts");
    let mut tx = Broadcast::create(BroadcastConfig::new(2, 2, 64).name(&*name)).unwrap();
    let h = tx.handle();
    let rx = BroadcastReader::attach_as(&h, 0).unwrap();
    // Reader: nothing sent.
    assert!(rx.try_recv().unwrap().is_none());
    let t0 = Instant::now();
    let e = rx.recv_timeout(Duration::from_millis(50)).unwrap_err();
    assert!(t0.elapsed() >= Duration::from_millis(50));
    assert!(
        matches!(
            e,
            Error::Timeout {
                op: "recv_timeout",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("no message"), "{e}");
    // Writer: reader 1 never attached, so it is expected and the ring fills.
    tx.send(b"a").unwrap();
    tx.send(b"b").unwrap();
    assert!(!tx.try_send(b"c").unwrap());
    let e = tx
        .send_timeout(b"c", Duration::from_millis(50))
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Timeout {
                op: "send_timeout",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("reader(s) [0, 1]"), "{e}");
    // Reader 0 reads; reader 1 attaches late and still gets both.
    assert_eq!(*rx.recv().unwrap(), *b"a");
    let rx1 = BroadcastReader::attach(&h).unwrap();
    assert_eq!(rx1.index(), 1);
    assert_eq!(*rx1.recv().unwrap(), *b"a");
    assert!(tx.try_send(b"c").unwrap());
}

#[test]
fn blocking_readers_names_the_reader_holding_the_next_slot_and_its_pid() {
    let name = Name::new("bcast-blockers");
    let mut tx = Broadcast::create(BroadcastConfig::new(2, 2, 64).name(&*name)).unwrap();
    let h = tx.handle();
    let rx = BroadcastReader::attach_as(&h, 0).unwrap();
    assert!(
        tx.blocking_readers().is_empty(),
        "an empty ring blocks nobody"
    );
    tx.send(b"a").unwrap();
    tx.send(b"b").unwrap();
    // Both hold the next slot: reader 0 attached (this process), reader 1
    // never attached (no pid, expected anyway).
    let me = std::process::id();
    assert_eq!(tx.blocking_readers(), vec![(0, Some(me)), (1, None)]);
    drop(rx.recv().unwrap());
    assert_eq!(tx.blocking_readers(), vec![(1, None)]);
    let rx1 = BroadcastReader::attach_as(&h, 1).unwrap();
    drop(rx1.recv().unwrap());
    assert!(tx.blocking_readers().is_empty());
    assert!(tx.try_send(b"c").unwrap());
}

#[test]
fn a_message_larger_than_a_slot_is_too_large() {
    let name = Name::new("bcast-too-large");
    let mut tx = Broadcast::create(BroadcastConfig::new(1, 4, 100).name(&*name)).unwrap();
    let e = tx.send(&[0; 101]).unwrap_err();
    assert!(
        matches!(
            e,
            Error::TooLarge {
                size: 101,
                max: 100
            }
        ),
        "{e}"
    );
    assert!(matches!(
        tx.try_send(&[0; 101]),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(
        tx.send_with(101, |_| ()),
        Err(Error::TooLarge { .. })
    ));
    tx.send(&[0; 100]).unwrap();
}

#[test]
fn messages_are_written_in_place_and_read_in_place() {
    let name = Name::new("bcast-in-place");
    let mut tx = Broadcast::create(BroadcastConfig::new(1, 4, 4096).name(&*name)).unwrap();
    let rx = BroadcastReader::attach(&tx.handle()).unwrap();
    tx.send_with(4096, |b| b.fill(7)).unwrap();
    tx.send_with(0, |_| ()).unwrap();
    let m = rx.recv().unwrap();
    assert_eq!(m.as_ptr() as usize % 64, 0, "payloads are 64-byte aligned");
    assert!(m.iter().all(|&b| b == 7) && m.len() == 4096);
    // Two messages held at once, released out of order.
    let m2 = rx.recv().unwrap();
    assert!(m2.is_empty());
    drop(m);
    drop(m2);
    for i in 0..10u8 {
        tx.send(&[i]).unwrap();
        assert_eq!(*rx.recv().unwrap(), [i]);
    }
}

#[test]
fn a_forgotten_message_keeps_its_slot_and_its_reader_and_is_never_overwritten() {
    let name = Name::new("bcast-forget");
    let mut tx = Broadcast::create(BroadcastConfig::new(1, 2, 64).name(&*name)).unwrap();
    let rx = BroadcastReader::attach(&tx.handle()).unwrap();
    tx.send(b"kept").unwrap();
    std::mem::forget(rx.recv().unwrap());
    tx.send(b"next").unwrap();
    assert_eq!(*rx.recv().unwrap(), *b"next");
    // The forgotten message's slot stays held: the writer cannot reuse it.
    assert!(!tx.try_send(b"x").unwrap());
    // Holding a message in every slot, waiting could never end: refused.
    let held = rx.recv().unwrap_err();
    assert!(matches!(held, Error::TooManyGuards { limit: 2 }), "{held}");
    // A message owns its share of the reader's entry, and a forgotten one
    // leaks it: dropping the reader cannot tell a forgotten message from a
    // live one, so the entry stays, and the slot with it, until the
    // process exits.
    drop(rx);
    assert!(!tx.try_send(b"x").unwrap());
}

#[test]
fn attaching_a_taken_index_or_a_full_channel_is_refused() {
    let name = Name::new("bcast-attach");
    let tx = Broadcast::create(BroadcastConfig::new(2, 4, 64).name(&*name)).unwrap();
    let h = tx.handle();
    let a = BroadcastReader::attach(&h).unwrap();
    assert!(matches!(
        BroadcastReader::attach_as(&h, a.index()),
        Err(Error::ReaderSlotTaken { .. })
    ));
    let _b = BroadcastReader::attach(&h).unwrap();
    assert!(matches!(
        BroadcastReader::attach(&h),
        Err(Error::NoReaderSlot { n_readers: 2 })
    ));
    assert!(matches!(
        BroadcastReader::attach_as(&h, 2),
        Err(Error::ReaderIndexOutOfRange { .. })
    ));
    let mut other = h.clone();
    other.nonce ^= 1;
    assert!(matches!(
        BroadcastReader::attach(&other),
        Err(Error::SegmentMismatch { .. })
    ));
    drop(a);
    assert_eq!(BroadcastReader::attach(&h).unwrap().index(), 0);
    assert!(matches!(
        Broadcast::create(BroadcastConfig::new(1, 4, 64).name(&*name)),
        Err(Error::InUse { .. })
    ));
    assert!(matches!(
        Broadcast::create(BroadcastConfig::new(0, 4, 64)),
        Err(Error::InvalidConfig(_))
    ));
}

#[test]
fn a_reader_that_left_no_longer_blocks_and_a_new_one_gets_only_new_messages() {
    let name = Name::new("bcast-rejoin");
    let mut tx = Broadcast::create(BroadcastConfig::new(2, 2, 64).name(&*name)).unwrap();
    let h = tx.handle();
    let r0 = BroadcastReader::attach_as(&h, 0).unwrap();
    let r1 = BroadcastReader::attach_as(&h, 1).unwrap();
    tx.send(b"1").unwrap();
    tx.send(b"2").unwrap();
    assert_eq!(*r0.recv().unwrap(), *b"1");
    assert_eq!(*r0.recv().unwrap(), *b"2");
    drop(r1);
    tx.send(b"3").unwrap();
    tx.send(b"4").unwrap();
    let r1 = BroadcastReader::attach_as(&h, 1).unwrap();
    tx.send_timeout(b"5", Duration::ZERO).unwrap_err();
    assert_eq!(*r0.recv().unwrap(), *b"3");
    tx.send_timeout(b"5", SECS).unwrap();
    assert_eq!(*r1.recv().unwrap(), *b"5");
    assert_eq!(*r0.recv().unwrap(), *b"4");
    assert_eq!(*r0.recv().unwrap(), *b"5");
}

#[test]
fn readers_in_threads_sleep_and_wake_without_losing_a_message() {
    let name = Name::new("bcast-threads");
    // Zero spin: every wait goes through the futex.
    let mut tx = Broadcast::create(
        BroadcastConfig::new(2, 3, 64)
            .name(&*name)
            .spin(Duration::ZERO),
    )
    .unwrap();
    let h = tx.handle();
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let h = h.clone();
            std::thread::spawn(move || {
                let rx = BroadcastReader::attach(&h).unwrap();
                let mut n = 0u64;
                while let Ok(m) = rx.recv() {
                    assert_eq!(*m, n.to_le_bytes());
                    n += 1;
                }
                n
            })
        })
        .collect();
    for i in 0..20_000u64 {
        tx.send(&i.to_le_bytes()).unwrap();
        if i % 1000 == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    drop(tx);
    for r in readers {
        assert_eq!(r.join().unwrap(), 20_000);
    }
}

#[test]
fn random_bytes_scribbled_over_the_channel_give_typed_errors_only() {
    let name = Name::new("bcast-scribble");
    let (n_readers, slots, size) = (2u32, 8u32, 128usize);
    let mut tx =
        Broadcast::create(BroadcastConfig::new(n_readers, slots, size).name(&*name)).unwrap();
    let h = tx.handle();
    let total = std::fs::metadata(name.path()).unwrap().len();
    let mut rng = Rng(0xbad5eed);
    let mut typed = 0u32;
    let mut check = |r: Result<(), Error>| match r {
        Ok(()) => {}
        Err(
            Error::BadHeader { .. }
            | Error::Timeout { .. }
            | Error::WriterGone { .. }
            | Error::SegmentMismatch { .. }
            | Error::NoReaderSlot { .. }
            | Error::ReaderSlotTaken { .. },
        ) => typed += 1,
        Err(e) => panic!("unexpected error kind: {e:?}"),
    };
    for round in 0..300u64 {
        // Mostly the header and reader table, sometimes slots.
        let at = if rng.below(2) == 0 {
            rng.below(512)
        } else {
            rng.below(total)
        };
        let len = 1 + rng.below(16) as usize;
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        scribble(&name, at, &bytes[..len.min((total - at) as usize)]);
        let _ = tx.try_send(&pattern(round, 1 + round as usize % size));
        check(BroadcastReader::attach(&h).and_then(|rx| {
            for _ in 0..3 {
                // The peeks (vLLM 0.34's readiness) read the same words.
                rx.is_ready()?;
                rx.wait_ready(Duration::from_millis(1))?;
                match rx.recv_timeout(Duration::from_millis(1)) {
                    Ok(m) => assert!(m.len() <= size),
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        }));
    }
    assert!(typed > 0, "scribbling produced no error at all");
}

#[test]
fn attached_readers_counts_each_index_once_it_has_attached() {
    let name = Name::new("attached");
    let tx = Broadcast::create(BroadcastConfig::new(2, 4, 64).name(&*name)).unwrap();
    assert_eq!(tx.attached_readers().unwrap(), 0);
    let r0 = BroadcastReader::attach_as(&tx.handle(), 0).unwrap();
    assert_eq!(tx.attached_readers().unwrap(), 1);
    drop(r0);
    assert_eq!(
        tx.attached_readers().unwrap(),
        1,
        "a reader that left has attached"
    );
    let _r0 = BroadcastReader::attach_as(&tx.handle(), 0).unwrap();
    assert_eq!(tx.attached_readers().unwrap(), 1, "the same index again");
    let _r1 = BroadcastReader::attach_as(&tx.handle(), 1).unwrap();
    assert_eq!(tx.attached_readers().unwrap(), 2);
}
