//! Loom models of the broadcast channel: the shipped writer and reader
//! cores (`WriterCore`, `ReaderCore`, every atomic access in [`super::atomics`],
//! offsets included) run unchanged over heap
//! memory laid out as a channel segment, whose words are loom atomics (the
//! address table of `crate::atomics::word`, as for the store's models), with
//! the futex modelled by a loom mutex and condvar whose waits have no
//! timeout. A lost wake-up is therefore a deadlock, which loom reports; a
//! slot rewritten while a reader reads it is a race on its payload cell,
//! which loom reports too.
//!
//! `RUSTFLAGS="--cfg pinshm_loom" CARGO_TARGET_DIR=target/loom cargo test --release --lib channel::loom_tests`

use std::time::{Duration, Instant};

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;

use super::atomics::ChannelPtr;
use super::reader::{ReaderCore, Recv};
use super::spin::WaitPlan;
use super::writer::{Blocked, WriterCore};
use crate::atomics::word::table;
use crate::geometry::ChannelGeometry;
use crate::layout::reader_state;

fn geo(n_readers: u32, slots: u32) -> ChannelGeometry {
    ChannelGeometry {
        n_readers,
        slots,
        slot_size: 8,
    }
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    model_bounded(3, f);
}

/// As `model`, with at most `preemptions` forced preemptions per execution.
/// The three-thread model runs at bound 3 (~90 s here; bound 2 missed a
/// broken wake-up scheme that bound 3 caught); `LOOM_BOUND2=2` shortens it.
fn model_bounded(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(preemptions);
    b.check(move || {
        // Forgets the last execution's atomics, futexes and heap mappings.
        table::reset();
        f()
    });
}

/// Sends `n` messages whose payload is their sequence number + 100.
fn send(w: &mut WriterCore, n: u64, alive: &dyn Fn(u32) -> bool) {
    for _ in 0..n {
        w.wait_slot(None, Duration::ZERO, alive)
            .expect("no deadline, no timeout");
        w.chan().write_payload(w.slot(), w.sent() + 100);
        w.commit(8);
    }
}

/// Receives until `n` messages or the end; checks each payload.
fn receive(r: &mut ReaderCore, n: u64) -> u64 {
    let mut got = 0;
    while got < n {
        match r.wait(None, Duration::ZERO, &|| true).unwrap() {
            Recv::Message(m) => {
                assert_eq!(r.chan().read_payload(m.slot), m.seq + 100);
                r.release(m.seq);
                got += 1;
            }
            Recv::WriterGone => break,
            Recv::TimedOut => unreachable!("no deadline"),
            Recv::Cancelled => unreachable!("nobody cancels"),
            Recv::Ready => unreachable!("a receive never peeks"),
        }
    }
    got
}

#[test]
fn a_sleeping_reader_always_wakes_for_a_message() {
    model(|| {
        let chan = ChannelPtr::heap(geo(1, 2));
        let mut r = ReaderCore::claim(chan.clone(), 0);
        let w = thread::spawn(move || send(&mut WriterCore::new(chan), 1, &|_| true));
        assert_eq!(receive(&mut r, 1), 1);
        w.join().unwrap();
    });
}

#[test]
fn a_reader_waiting_for_readiness_always_wakes_and_takes_nothing() {
    // The peek's sleep (vLLM 0.34's `spin_until_readable`) follows the
    // receive's announce, re-check, sleep protocol: a message sent at any
    // point wakes it, and the message is still there to receive after.
    model(|| {
        let chan = ChannelPtr::heap(geo(1, 2));
        let mut r = ReaderCore::claim(chan.clone(), 0);
        let w = thread::spawn(move || send(&mut WriterCore::new(chan), 1, &|_| true));
        assert_eq!(r.wait_ready(None, &|| true).unwrap(), Recv::Ready);
        assert!(r.ready().unwrap());
        assert_eq!(receive(&mut r, 1), 1);
        w.join().unwrap();
    });
}

/// A predicted window: the timed sleep before it (its timeout, an hour
/// away, never fires; loom's futex ignores timeouts anyway), then the
/// untimed one. Either way only the writer's notify can end them.
fn planned(r: &mut ReaderCore, n: u64, window_passed: bool) -> u64 {
    let now = Instant::now();
    let window = if window_passed {
        (now, now)
    } else {
        let wake = now + Duration::from_secs(3600);
        (wake, wake)
    };
    let plan = WaitPlan {
        spin: Duration::ZERO,
        window: Some(window),
    };
    let mut got = 0;
    while got < n {
        match r.wait_planned(None, plan, &|| true).unwrap().0 {
            Recv::Message(m) => {
                assert_eq!(r.chan().read_payload(m.slot), m.seq + 100);
                r.release(m.seq);
                got += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    got
}

#[test]
fn a_reader_sleeping_before_a_predicted_window_always_wakes_for_a_message() {
    model(|| {
        let chan = ChannelPtr::heap(geo(1, 2));
        let mut r = ReaderCore::claim(chan.clone(), 0);
        let w = thread::spawn(move || send(&mut WriterCore::new(chan), 2, &|_| true));
        assert_eq!(planned(&mut r, 2, false), 2);
        w.join().unwrap();
    });
}

#[test]
fn a_reader_past_its_predicted_window_always_wakes_for_a_message() {
    model(|| {
        let chan = ChannelPtr::heap(geo(1, 2));
        let mut r = ReaderCore::claim(chan.clone(), 0);
        let w = thread::spawn(move || send(&mut WriterCore::new(chan), 1, &|_| true));
        assert_eq!(planned(&mut r, 1, true), 1);
        w.join().unwrap();
    });
}

#[test]
fn a_reader_sleeping_before_a_predicted_window_always_wakes_when_cancelled() {
    model(|| {
        let chan = ChannelPtr::heap(geo(1, 2));
        let mut r = ReaderCore::claim(chan.clone(), 0);
        let flag = r.cancel_flag().clone();
        let t = thread::spawn(move || {
            let wake = Instant::now() + Duration::from_secs(3600);
            let plan = WaitPlan {
                spin: Duration::ZERO,
                window: Some((wake, wake)),
            };
            r.wait_planned(None, plan, &|| true).unwrap().0
        });
        chan.cancel_reader(&flag);
        assert_eq!(t.join().unwrap(), Recv::Cancelled);
    });
}

#[test]
fn a_writer_waiting_for_a_slot_always_wakes_and_never_rewrites_a_held_slot() {
    model(|| {
        let chan = ChannelPtr::heap(geo(1, 1));
        let mut r = ReaderCore::claim(chan.clone(), 0);
        let w = thread::spawn(move || send(&mut WriterCore::new(chan), 2, &|_| true));
        assert_eq!(receive(&mut r, 2), 2);
        w.join().unwrap();
    });
}

#[test]
fn two_sleeping_readers_both_wake_and_the_writer_reuses_the_slot_only_after_both() {
    model_bounded(
        std::env::var("LOOM_BOUND2").map_or(3, |v| v.parse().unwrap()),
        || {
            let chan = ChannelPtr::heap(geo(2, 1));
            let r0 = ReaderCore::claim(chan.clone(), 0);
            let r1 = ReaderCore::claim(chan.clone(), 1);
            let other = thread::spawn(move || {
                let mut r1 = r1;
                receive(&mut r1, 2)
            });
            let w = thread::spawn(move || send(&mut WriterCore::new(chan), 2, &|_| true));
            let mut r0 = r0;
            assert_eq!(receive(&mut r0, 2), 2);
            assert_eq!(other.join().unwrap(), 2);
            w.join().unwrap();
        },
    );
}

#[test]
fn a_closed_channel_is_drained_then_gone() {
    model(|| {
        let chan = ChannelPtr::heap(geo(1, 2));
        let mut r = ReaderCore::claim(chan.clone(), 0);
        let w = thread::spawn(move || {
            let mut w = WriterCore::new(chan);
            send(&mut w, 1, &|_| true);
            w.chan().close();
        });
        assert_eq!(receive(&mut r, 5), 1, "the message, then the end");
        w.join().unwrap();
    });
}

#[test]
fn a_reader_attaching_mid_stream_never_reads_a_rewritten_slot() {
    model(|| {
        let chan = ChannelPtr::heap(geo(1, 1));
        // Entry 0 was used and left: not expected until re-attached.
        let first = ReaderCore::claim(chan.clone(), 0);
        first.leave();
        let s2 = chan.clone();
        let w = thread::spawn(move || {
            let mut w = WriterCore::new(s2);
            send(&mut w, 2, &|_| true);
            w.chan().close();
        });
        let mut r = ReaderCore::claim(chan, 0);
        // Whatever it starts from, each message it gets is whole (checked
        // in `receive`, and loom checks the payload cell for races).
        receive(&mut r, 2);
        w.join().unwrap();
    });
}

#[test]
fn reaping_a_dead_reader_never_marks_the_reader_that_took_its_place() {
    model(|| {
        let chan = ChannelPtr::heap(geo(1, 1));
        // Reader A attached, then died holding message 0 (its lock is gone).
        let _a = ReaderCore::claim(chan.clone(), 0);
        let lock = Arc::new(AtomicBool::new(false));
        let mut w = WriterCore::new(chan.clone());
        send(&mut w, 1, &|_| true);
        let l2 = lock.clone();
        let writer = thread::spawn(move || {
            // Blocked on A until it finds A dead, or B attached past it.
            let alive = move |_i: u32| l2.load(Ordering::Acquire);
            send(&mut w, 1, &alive);
        });
        // Reader B takes the lock, then the entry.
        lock.store(true, Ordering::Release);
        let b = ReaderCore::claim(chan.clone(), 0);
        writer.join().unwrap();
        let word = chan.state_word(0);
        assert_eq!(
            reader_state::state(word),
            reader_state::ATTACHED,
            "B was not reaped"
        );
        b.leave();
    });
}

#[test]
fn a_sleeping_reader_always_wakes_when_cancelled() {
    model(|| {
        let chan = ChannelPtr::heap(geo(1, 2));
        let mut r = ReaderCore::claim(chan.clone(), 0);
        let flag = r.cancel_flag().clone();
        // Nothing is ever sent: only the cancel can end the wait.
        let t = thread::spawn(move || r.wait(None, Duration::ZERO, &|| true).unwrap());
        chan.cancel_reader(&flag);
        assert_eq!(t.join().unwrap(), Recv::Cancelled);
    });
}

#[test]
fn a_writer_waiting_for_a_slot_always_wakes_when_cancelled() {
    model(|| {
        let chan = ChannelPtr::heap(geo(1, 1));
        // The reader never releases message 0: the one slot stays held.
        let _r = ReaderCore::claim(chan.clone(), 0);
        let mut w = WriterCore::new(chan.clone());
        send(&mut w, 1, &|_| true);
        let flag = w.cancel_flag().clone();
        let t = thread::spawn(move || w.wait_slot(None, Duration::ZERO, &|_| true));
        chan.cancel_writer(&flag);
        assert_eq!(t.join().unwrap(), Err(Blocked::Cancelled));
    });
}
