//! A sparse store's background backer ([`Ahead`]): a thread that backs
//! (`fallocate`) and maps (`MADV_POPULATE_WRITE`) the pages just past what
//! the writer has used, a step ahead of it, so that a put into pages never
//! written before runs as a put into backed ones does: with no page
//! allocation and no page fault inside it.
//!
//! Measured on a 2-vCPU VM, a put into fresh sparse pages cost 12 to 20
//! times a memcpy, nearly all of it the kernel's per-page work (allocating
//! and zeroing each page, then a fault per page on first write), which no
//! larger step or batching inside the put removes. Done ahead, between
//! puts, that work leaves the put.
//!
//! The protocol (all of it in this process's memory; nothing here is in
//! the segment):
//! - What is backed is a prefix of the segment, `0..backed` (the writer's
//!   [`Backing`] is a prefix one). Whoever extends it, the backer or the
//!   writer, holds `io` across the headroom check and the `fallocate`, and
//!   publishes the new end in `backed` (Release) after the pages exist. So
//!   the two never both take the same free space, and never go below
//!   [`StoreConfig::shm_headroom`](crate::StoreConfig::shm_headroom)
//!   together.
//! - The writer, before it writes a span, loads `backed` (Acquire) and
//!   records it in its `Backing`: a span below it costs no system call.
//!   A span past it (the backer is behind, blocked, or off) is backed by
//!   the writer itself, under `io` (after the backer's current unit, at
//!   most [`UNIT`] bytes), exactly as without a backer: a full /dev/shm is
//!   `NoSpace` from that put, never SIGBUS.
//! - Then the writer asks for `step` bytes past the end of the span
//!   (`ctl.want`, under `ctl`, with a notify). The backer works towards it
//!   in units, each backed and mapped writable into the writer's page
//!   tables under `io`, then published: pages the writer finds published
//!   take no fault, and the writer and the backer never fault the same
//!   pages at once (a writer that needs the unit in progress waits for
//!   it, then backs whatever else it needs itself, while the backer goes
//!   on past it).
//! - A unit the headroom or the kernel refuses is not retried until the
//!   writer asks for more (`ctl.blocked_at`): a full /dev/shm costs the
//!   backer one `statvfs` per unit of the writer's progress, and the put
//!   that needs those pages reports the error.
//! - Memory: at most `step` (rounded up to a chunk) past the end of what
//!   the writer has used. The thread ends once the whole data region is
//!   backed (the first lap), or when the store goes (joined in its drop;
//!   in a forked child, which has no such thread, nothing is joined).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use super::mapping::Mapping;
use crate::error::Result;
use crate::sys::fork;
use crate::sys::segment::{self, Backing, Segment};

/// The most bytes the backer backs and maps under one hold of `io`: what a
/// writer that needs pages the backer is working on waits for, at most
/// (about 0.3 ms of kernel work on the VM measured).
pub(super) const UNIT: u64 = 256 << 10;

/// How far the writer's target must move before the writer wakes the
/// backer again (a wake is a system call; a step ahead is many of these).
const ASK_EVERY: u64 = 1 << 20;

/// The writer's handle on its backer thread.
#[derive(Debug)]
pub(super) struct Ahead {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// The fork generation the thread was started in.
    fork_gen: u64,
    /// Bytes to keep backed past the end of the writer's last span.
    step: u64,
    /// The last `want` the writer asked for.
    asked: u64,
}

#[derive(Debug)]
struct Shared {
    /// Keeps the segment mapped while the thread uses it.
    map: Arc<Mapping>,
    /// Where backing ahead stops: the end of the data region.
    end: u64,
    headroom: u64,
    /// The end of the backed prefix (a chunk multiple, or the segment's
    /// end), changed only under this lock, by whoever backs pages.
    io: Mutex<u64>,
    /// `io`'s value, for the writer's check without the lock: stored
    /// (Release) after the pages exist, loaded (Acquire) by the writer.
    backed: AtomicU64,
    ctl: Mutex<Ctl>,
    wake: Condvar,
}

#[derive(Debug)]
struct Ctl {
    /// Back up to here.
    want: u64,
    /// A `want` the backer could not reach (headroom, full /dev/shm, no
    /// `fallocate`): not tried again until `want` grows past it.
    blocked_at: u64,
    stop: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing under these locks can panic midway; a poisoned one holds a
    // consistent value.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Ahead {
    /// Starts a backer for the sparse segment of `map`, whose prefix
    /// `0..backed` is backed, to keep `step` bytes backed ahead of the
    /// writer up to `end` (the data region's end), leaving `headroom`
    /// bytes of /dev/shm free. It starts at once, with `start + step`
    /// (`start`: the data region's start): the first put of a new store
    /// finds its pages ready. `None` if no thread can be started (pages
    /// are then backed inside the puts, as without a backer).
    pub(super) fn start(
        map: &Arc<Mapping>,
        backed: u64,
        start: u64,
        end: u64,
        step: u64,
        headroom: u64,
    ) -> Option<Ahead> {
        let step = step.next_multiple_of(Backing::CHUNK);
        let want = start.saturating_add(step).min(end);
        let shared = Arc::new(Shared {
            map: Arc::clone(map),
            end,
            headroom,
            io: Mutex::new(backed),
            backed: AtomicU64::new(backed),
            ctl: Mutex::new(Ctl {
                want,
                blocked_at: 0,
                stop: false,
            }),
            wake: Condvar::new(),
        });
        let thread = std::thread::Builder::new()
            .name("pinshm-backer".into())
            .spawn({
                let shared = Arc::clone(&shared);
                move || shared.run()
            });
        match thread {
            Ok(t) => Some(Ahead {
                shared,
                thread: Some(t),
                fork_gen: fork::current(),
                step,
                asked: want,
            }),
            Err(e) => {
                tracing::debug!(%e, "no backer thread: pages are backed inside the puts");
                None
            }
        }
    }

    /// Makes `offset..offset + len` backed before the writer writes it (as
    /// [`Backing::ensure`]), taking what the backer has done, then asks the
    /// backer for a step more. Returns the bytes the writer backed itself.
    pub(super) fn ensure(
        &mut self,
        backing: &mut Backing,
        seg: &Segment,
        offset: u64,
        len: u64,
    ) -> Result<u64> {
        let end = offset.saturating_add(len);
        backing.mark_prefix(self.shared.backed.load(Ordering::Acquire));
        let mut own = 0;
        if end > backing.backed() {
            // Behind: wait for its unit in progress, then do the rest here.
            let mut io = lock(&self.shared.io);
            backing.mark_prefix(*io);
            let before = backing.backed();
            if end > before {
                backing.ensure(seg, offset, len)?;
                own = backing.backed() - before;
                *io = (*io).max(backing.backed());
                self.shared.backed.store(*io, Ordering::Release);
            }
        }
        self.ask(end);
        Ok(own)
    }

    /// Whether `backing` covers the whole data region: nothing is left
    /// to back ahead.
    pub(super) fn finished(&self, backing: &Backing) -> bool {
        backing.backed() >= self.shared.end
    }

    /// Asks the backer to back up to `step` bytes past `end`. Wakes it
    /// only when that moves the target by [`ASK_EVERY`] or more, and not
    /// when it is there already.
    fn ask(&mut self, end: u64) {
        let target = end.saturating_add(self.step).min(self.shared.end);
        let moved = target >= self.asked.saturating_add(ASK_EVERY.min(self.step))
            || (target == self.shared.end && target > self.asked);
        if !moved {
            return;
        }
        self.asked = target;
        lock(&self.shared.ctl).want = target;
        if self.shared.backed.load(Ordering::Relaxed) < target {
            self.shared.wake.notify_one();
        }
    }
}

impl Shared {
    /// The backer's loop: a unit at a time towards `want`, until the data
    /// region is backed or the store stops it.
    fn run(&self) {
        loop {
            let want = {
                let mut c = lock(&self.ctl);
                loop {
                    if c.stop || self.backed.load(Ordering::Relaxed) >= self.end {
                        return;
                    }
                    if c.want > self.backed.load(Ordering::Relaxed) && c.want > c.blocked_at {
                        break c.want;
                    }
                    c = self.wake.wait(c).unwrap_or_else(PoisonError::into_inner);
                }
            };
            let seg = self.map.seg();
            let mut io = lock(&self.io);
            let from = *io;
            if from >= want {
                continue; // the writer backed it meanwhile
            }
            let to = want
                .min(from.saturating_add(UNIT))
                .next_multiple_of(Backing::CHUNK)
                .min(self.end.next_multiple_of(Backing::CHUNK))
                .min(seg.len() as u64);
            let backed = segment::check_headroom(seg, to - from, self.headroom).is_ok()
                && matches!(seg.allocate_pages(from, to - from), Ok(true));
            if !backed {
                drop(io);
                lock(&self.ctl).blocked_at = want;
                continue;
            }
            // Mapped before they are published: a put that then writes
            // them takes no fault, and none races this on the same pages.
            seg.map_pages(from, to - from);
            *io = to;
            self.backed.store(to, Ordering::Release);
        }
    }
}

impl Drop for Ahead {
    fn drop(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        if fork::current() != self.fork_gen {
            // A forked child's copy: the thread is the parent's (a child
            // has only the thread that forked), and its locks are the
            // parent's state: touch neither.
            std::mem::forget(thread);
            return;
        }
        lock(&self.shared.ctl).stop = true;
        self.shared.wake.notify_one();
        // At most one unit (UNIT bytes backed and mapped) away.
        let _ = thread.join();
    }
}
