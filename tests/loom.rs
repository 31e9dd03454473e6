//! Loom models of the slot protocol of src/ring.rs, on heap memory: every
//! interleaving (and every weak-memory outcome loom explores) of a writer
//! reclaiming a slot against a reader taking a guard on it.
//!
//! `RUSTFLAGS="--cfg loom" cargo test --release --test loom`
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering::*};
use loom::sync::Arc;
use loom::thread;

const OLD: u64 = 1;
const NEW: u64 = 2;

/// One slot and one reader's words, laid out as in the segment.
struct Slot {
    id: AtomicU64,
    refs: AtomicU32,
    reads: AtomicU32,
    hazard: AtomicU64,
    payload: UnsafeCell<u64>,
}

impl Slot {
    fn published() -> Self {
        Slot {
            id: AtomicU64::new(OLD),
            refs: AtomicU32::new(1),
            reads: AtomicU32::new(0),
            hazard: AtomicU64::new(0),
            payload: UnsafeCell::new(100),
        }
    }

    /// ObjectStore::try_free + reuse: check the read counter, invalidate,
    /// scan the hazard, back off or overwrite.
    fn writer_reclaim(&self) -> bool {
        if self.reads.load(Acquire) < self.refs.load(Relaxed) {
            return false;
        }
        // SlotPtr::invalidate, then ReaderPtr::holds.
        self.id.store(0, Relaxed);
        fence(SeqCst);
        if self.hazard.load(Acquire) == OLD {
            self.id.store(OLD, Release);
            return false;
        }
        // Reuse: begin_write, write the payload, publish.
        self.payload.with_mut(|p| unsafe { *p = 200 });
        self.id.store(NEW, Release);
        true
    }

    /// StoreReader::get + ReadGuard::drop: hazard, validate, read, ack,
    /// clear hazard. Returns what it read, if the handle was valid.
    fn reader_guard(&self) -> Option<u64> {
        // ReaderPtr::set_hazard, then SlotPtr::id_after_hazard.
        self.hazard.store(OLD, Relaxed);
        fence(SeqCst);
        let got = if self.id.load(Acquire) == OLD {
            let v = self.payload.with(|p| unsafe { *p });
            // ack_held: only this reader writes `reads`.
            let done = self.reads.load(Relaxed);
            if done < self.refs.load(Acquire) {
                self.reads.store(done + 1, Release);
            }
            Some(v)
        } else {
            None
        };
        self.hazard.store(0, Release);
        got
    }
}

#[test]
fn a_guarded_slot_is_never_reused_under_the_reader() {
    loom::model(|| {
        let s = Arc::new(Slot::published());
        let r = {
            let s = s.clone();
            thread::spawn(move || s.reader_guard())
        };
        // The writer keeps trying, as a put on a full ring does.
        let mut reused = false;
        for _ in 0..2 {
            reused |= s.writer_reclaim();
        }
        let read = r.join().unwrap();
        // A valid guard saw the old bytes (loom also flags any race on the
        // payload cell), and the slot was reused only after the read.
        if let Some(v) = read {
            assert_eq!(v, 100);
        }
        if reused {
            assert_eq!(s.id.load(Acquire), NEW);
        }
    });
}

#[test]
fn a_reader_that_already_acknowledged_is_still_protected_by_its_guard() {
    loom::model(|| {
        let s = Arc::new(Slot::published());
        s.reads.store(1, SeqCst); // the read was counted earlier (touch)
        let r = {
            let s = s.clone();
            thread::spawn(move || s.reader_guard())
        };
        let _ = s.writer_reclaim();
        if let Some(v) = r.join().unwrap() {
            assert_eq!(v, 100);
        }
    });
}

#[test]
fn an_unread_object_is_never_reclaimed() {
    loom::model(|| {
        let s = Arc::new(Slot::published());
        let w = {
            let s = s.clone();
            thread::spawn(move || s.writer_reclaim())
        };
        // The reader has not acknowledged: the writer must not reclaim,
        // whatever it observes.
        let reused = w.join().unwrap();
        assert!(!reused);
        assert_eq!(s.reader_guard(), Some(100));
    });
}
