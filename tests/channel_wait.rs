//! Waiting on the broadcast channel: a `Canceller` ends a blocked `send` or
//! `recv` from another thread at once (a futex wake), and the reader's
//! spin is learned from its waits. Every test uses its own segment name.
//! No timing assertions: a wait that a lost wake-up would make endless is
//! bounded by a generous deadline only.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use common::Name;
use pinshm::{
    channel::{BroadcastConfig, Canceller},
    Broadcast, BroadcastReader, Error,
};

/// Far longer than any wake-up; a lost one never ends (the other side is
/// alive, so no liveness re-check ends the wait either).
const DEADLINE: Duration = Duration::from_secs(20);

const _: fn() = || {
    fn send_sync_clone<T: Send + Sync + Clone>() {}
    send_sync_clone::<Canceller>();
};

#[test]
fn a_blocked_recv_ends_with_cancelled_when_another_thread_cancels() {
    let name = Name::new("wait-cancel-recv");
    let tx = Broadcast::create(BroadcastConfig::new(1, 4, 64).name(&*name)).unwrap();
    let h = tx.handle();
    let (ready_tx, ready) = mpsc::channel();
    let (done_tx, done) = mpsc::channel();
    let t = std::thread::spawn(move || {
        let mut rx = BroadcastReader::attach(&h).unwrap();
        rx.set_spin(Duration::ZERO); // straight to the futex
        ready_tx.send(rx.canceller()).unwrap();
        let r = rx.recv().map(|m| m.to_vec());
        done_tx
            .send(matches!(r, Err(Error::Cancelled { op: "recv", .. })))
            .unwrap();
        // Every later wait ends the same way.
        matches!(rx.recv(), Err(Error::Cancelled { .. }))
            && matches!(rx.try_recv(), Err(Error::Cancelled { .. }))
    });
    let cancel = ready.recv_timeout(DEADLINE).expect("the reader attached");
    assert!(!cancel.is_cancelled());
    cancel.cancel();
    assert!(cancel.is_cancelled());
    let got = done
        .recv_timeout(DEADLINE)
        .expect("the cancelled recv returned");
    assert!(got, "a cancelled recv says Cancelled");
    assert!(t.join().unwrap(), "later receives are cancelled too");
    drop(tx);
}

#[test]
fn a_send_blocked_on_a_full_ring_ends_with_cancelled_and_sends_nothing() {
    let name = Name::new("wait-cancel-send");
    let mut tx = Broadcast::create(
        BroadcastConfig::new(1, 1, 64)
            .name(&*name)
            .spin(Duration::ZERO),
    )
    .unwrap();
    let rx = BroadcastReader::attach(&tx.handle()).unwrap();
    tx.send(b"first").unwrap(); // the only slot, held until rx releases it
    let cancel = tx.canceller();
    let (done_tx, done) = mpsc::channel();
    let t = std::thread::spawn(move || {
        let r = tx.send(b"second");
        done_tx
            .send(matches!(r, Err(Error::Cancelled { op: "send", .. })))
            .unwrap();
        tx
    });
    cancel.cancel();
    let got = done
        .recv_timeout(DEADLINE)
        .expect("the cancelled send returned");
    assert!(got, "a cancelled send says Cancelled");
    let mut tx = t.join().unwrap();
    assert_eq!(tx.sent(), 1, "nothing was sent");
    // The reader still drains what was sent; the writer stays cancelled.
    assert_eq!(*rx.recv().unwrap(), *b"first");
    assert!(matches!(tx.try_send(b"x"), Err(Error::Cancelled { .. })));
}

#[test]
fn cancelling_one_reader_leaves_the_others_receiving() {
    let name = Name::new("wait-cancel-one");
    let mut tx = Broadcast::create(BroadcastConfig::new(2, 4, 64).name(&*name)).unwrap();
    let h = tx.handle();
    let a = BroadcastReader::attach_as(&h, 0).unwrap();
    let b = BroadcastReader::attach_as(&h, 1).unwrap();
    a.canceller().cancel();
    tx.send(b"m").unwrap();
    assert!(matches!(a.recv(), Err(Error::Cancelled { .. })));
    assert_eq!(*b.recv().unwrap(), *b"m");
}

#[test]
fn a_canceller_that_outlives_its_reader_and_writer_does_nothing() {
    let name = Name::new("wait-cancel-late");
    let tx = Broadcast::create(BroadcastConfig::new(1, 4, 64).name(&*name)).unwrap();
    let rx = BroadcastReader::attach(&tx.handle()).unwrap();
    let (cr, cw) = (rx.canceller(), tx.canceller());
    drop(rx);
    drop(tx);
    cr.cancel(); // the mapping is gone: nothing is touched
    cw.cancel();
    assert!(!name.exists());
}

#[test]
fn a_reader_whose_messages_come_back_to_back_spins_and_one_between_steps_does_not() {
    let name = Name::new("wait-spin");
    let mut tx = Broadcast::create(BroadcastConfig::new(1, 4, 64).name(&*name)).unwrap();
    let rx = BroadcastReader::attach(&tx.handle()).unwrap();
    // Messages already there when asked for: the estimate falls to zero.
    for _ in 0..8 {
        tx.send(b"m").unwrap();
        drop(rx.recv().unwrap());
    }
    assert!(rx.spin_window() > Duration::ZERO, "back to back: it spins");
    // A receive that had to give up says the gaps are long.
    assert!(matches!(
        rx.recv_timeout(Duration::from_millis(1)),
        Err(Error::Timeout { .. })
    ));
    assert_eq!(
        rx.spin_window(),
        Duration::ZERO,
        "a long gap: it sleeps at once"
    );
}

#[test]
fn readiness_is_a_peek_that_takes_nothing_and_holds_no_slot() {
    let name = Name::new("wait-ready-peek");
    let mut tx = Broadcast::create(BroadcastConfig::new(1, 2, 64).name(&*name)).unwrap();
    let rx = BroadcastReader::attach(&tx.handle()).unwrap();
    assert!(!rx.is_ready().unwrap());
    assert!(
        !rx.wait_ready(Duration::from_millis(1)).unwrap(),
        "nothing sent: the time is up"
    );
    tx.send(b"one").unwrap();
    // Asked many times, still one message, and the message is still there.
    for _ in 0..100 {
        assert!(rx.is_ready().unwrap());
        assert!(rx.wait_ready(Duration::ZERO).unwrap());
    }
    assert_eq!(
        &*rx.try_recv().unwrap().expect("the peeked message"),
        b"one"
    );
    assert!(!rx.is_ready().unwrap(), "taken: nothing more is ready");
    // The peeks held no slot: both slots take a message each.
    tx.send(b"two").unwrap();
    tx.send_timeout(b"three", Duration::ZERO).unwrap();
    assert_eq!(&*rx.recv().unwrap(), b"two");
    assert_eq!(&*rx.recv().unwrap(), b"three");
}

#[test]
fn a_reader_waiting_for_readiness_wakes_for_a_message_sent_from_another_thread() {
    let name = Name::new("wait-ready-wake");
    let mut tx = Broadcast::create(BroadcastConfig::new(1, 4, 64).name(&*name)).unwrap();
    let rx = BroadcastReader::attach(&tx.handle()).unwrap();
    let (started_tx, started) = mpsc::channel();
    let t = std::thread::spawn(move || {
        started_tx.send(()).unwrap();
        let woke = rx.wait_ready(DEADLINE).unwrap();
        (woke, rx.try_recv().unwrap().map(|m| m.to_vec()))
    });
    started.recv().unwrap();
    tx.send(b"late").unwrap();
    let (woke, got) = t.join().unwrap();
    assert!(
        woke,
        "a lost wake-up would end only at the deadline, with false"
    );
    assert_eq!(got.as_deref(), Some(&b"late"[..]));
}

#[test]
fn readiness_after_the_writer_goes_or_a_cancel_says_so_at_once() {
    let name = Name::new("wait-ready-end");
    let tx = Broadcast::create(BroadcastConfig::new(2, 4, 64).name(&*name)).unwrap();
    let h = tx.handle();
    let rx = BroadcastReader::attach_as(&h, 0).unwrap();
    let cancelled = BroadcastReader::attach_as(&h, 1).unwrap();
    // A wait in progress ends with Cancelled when another thread cancels.
    let canceller = cancelled.canceller();
    let (started_tx, started) = mpsc::channel();
    let t = std::thread::spawn(move || {
        started_tx.send(()).unwrap();
        cancelled.wait_ready(DEADLINE)
    });
    started.recv().unwrap();
    canceller.cancel();
    assert!(matches!(
        t.join().unwrap(),
        Err(Error::Cancelled {
            op: "wait_ready",
            ..
        })
    ));
    // The writer gone: ready (a recv would end at once, with WriterGone).
    drop(tx);
    assert!(rx.is_ready().unwrap());
    assert!(rx.wait_ready(DEADLINE).unwrap());
    assert!(matches!(rx.recv(), Err(Error::WriterGone { .. })));
}

#[test]
fn wait_stats_count_how_each_receive_found_its_message() {
    let name = Name::new("wait-stats");
    let mut tx = Broadcast::create(BroadcastConfig::new(1, 4, 64).name(&*name)).unwrap();
    let h = tx.handle();
    let mut rx = BroadcastReader::attach(&h).unwrap();
    rx.set_spin(Duration::ZERO); // no spin: a wait is a futex sleep
    assert_eq!(rx.wait_stats(), Default::default());
    tx.send(b"there already").unwrap();
    drop(rx.recv().unwrap());
    assert!(matches!(
        rx.recv_timeout(Duration::from_millis(20)),
        Err(Error::Timeout { .. })
    ));
    let (go, went) = mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        went.recv().unwrap();
        std::thread::sleep(Duration::from_millis(50));
        tx.send(b"later").unwrap();
        tx
    });
    go.send(()).unwrap();
    assert_eq!(&*rx.recv_timeout(DEADLINE).unwrap(), b"later");
    let s = rx.wait_stats();
    assert_eq!((s.ready, s.sleep, s.gave_up), (1, 1, 1), "{s:?}");
    assert_eq!((s.spin, s.early, s.window), (0, 0, 0), "{s:?}");
    // try_recv is not a wait: not counted; a new spin keeps the counts.
    assert!(rx.try_recv().unwrap().is_none());
    rx.set_spin(Duration::from_micros(50));
    assert_eq!(rx.wait_stats(), s);
    drop(t.join().unwrap());
}
