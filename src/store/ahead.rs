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
//! the segment). The writer never waits for the backer, and never takes a
//! lock the backer holds:
//! - What is allocated is a prefix of the segment, `0..claimed`. Whoever
//!   allocates pages, the backer or the writer, allocates a run that
//!   starts at or below `claimed` as it last loaded it, then raises
//!   `claimed` to the run's end (`fetch_max`, Release): the prefix stays a
//!   prefix, and the writer's [`Backing`] (a prefix one) records it.
//! - The headroom ([`StoreConfig::shm_headroom`](crate::StoreConfig::shm_headroom))
//!   with two parties checking /dev/shm and allocating at once: each adds
//!   the bytes it is about to allocate to `inflight` before its check and
//!   takes them off after its `fallocate`, and asks /dev/shm for the
//!   headroom plus whatever `inflight` already held (the other party's run
//!   in progress). The adds are RMWs of one word, so of two runs in
//!   flight at once the later one counts the earlier; and a run whose
//!   `fallocate` ended before the other's add is in that one's `statvfs`.
//!   Together they never go below the headroom.
//! - The writer, before it writes a span, loads `claimed` (Acquire): a
//!   span below it costs no system call. A span past it (the backer is
//!   behind, starved, blocked, or off) is allocated by the writer itself,
//!   exactly as without a backer: a full /dev/shm is `NoSpace` from that
//!   put, never SIGBUS.
//! - Once the put is published (at once, if the writer had to allocate
//!   pages itself), the writer asks for `step` bytes past the end of the
//!   span (`want`, then an unpark): the backer works between puts, not
//!   under their copy. It runs at the lowest priority (nice 19), so that
//!   waking it never preempts the writer's thread and it takes only CPU
//!   that nothing else wants much; on a busy machine it falls behind, and
//!   puts allocate their own pages.
//! - The backer works in units of [`UNIT`] bytes: allocate, publish, then
//!   map them into the writer's page tables (mapping changes no byte).
//!   A unit the headroom or the kernel refuses is not tried again until
//!   the writer asks for more: a full /dev/shm costs the backer one
//!   `statvfs` per [`ASK_EVERY`] of the writer's progress, and the put
//!   that needs those pages reports the error.
//! - Memory: at most `step` (rounded up to a chunk) past the end of what
//!   the writer has used. The thread ends once the whole data region is
//!   allocated (the first lap), or after its unit in progress once the
//!   store goes (it keeps the mapping alive until then; the store's drop
//!   does not wait for it). A forked child has no such thread, and its
//!   copy of the store touches nothing of it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::Thread;

use super::mapping::Mapping;
use crate::error::Result;
use crate::sys::fork;
use crate::sys::segment::{self, Backing, Segment};

/// Bytes the backer allocates and maps per unit: what it may have in
/// flight when the store goes (about 0.3 ms of kernel work on the VM
/// measured).
pub(super) const UNIT: u64 = 256 << 10;

/// How far the writer's target must move before the writer wakes the
/// backer again (a wake is a system call; a step ahead is many of these).
const ASK_EVERY: u64 = 1 << 20;

/// The backer's nice value: the lowest priority, so that it never
/// preempts the writer's thread when it is woken.
const NICE: i32 = 19;

/// The writer's handle on its backer thread.
#[derive(Debug)]
pub(super) struct Ahead {
    shared: Arc<Shared>,
    thread: Thread,
    /// The fork generation the thread was started in.
    fork_gen: u64,
    /// Bytes to keep allocated past the end of the writer's last span.
    step: u64,
    /// The last `want` the writer asked for.
    asked: u64,
    /// The end of the last span the writer made ready for a put, to ask
    /// for once that put is published ([`Ahead::kick`]).
    last_end: u64,
}

#[derive(Debug)]
struct Shared {
    /// Keeps the segment mapped while the thread uses it.
    map: Arc<Mapping>,
    /// Where backing ahead stops: the end of the data region.
    end: u64,
    headroom: u64,
    /// `0..claimed` of the segment is allocated (a chunk multiple, or the
    /// segment's end). Raised with `fetch_max` (Release) after each run is
    /// allocated, by either party; loaded with Acquire.
    claimed: AtomicU64,
    /// Bytes being allocated now, by either party, between its headroom
    /// check and the end of its `fallocate` (AcqRel RMWs).
    inflight: AtomicU64,
    /// Allocate up to here (the writer's store, Release; the backer's
    /// load, Acquire, after an unpark).
    want: AtomicU64,
    /// The store is gone: stop after the unit in progress.
    stop: AtomicBool,
}

impl Ahead {
    /// Starts a backer for the sparse segment of `map`, whose prefix
    /// `0..backed` is allocated, to keep `step` bytes allocated ahead of
    /// the writer up to `end` (the data region's end), leaving `headroom`
    /// bytes of /dev/shm free. It starts at once, towards `start + step`
    /// (`start`: the data region's start): the first put of a new store
    /// finds its pages ready. `None` if no thread can be started (pages
    /// are then allocated inside the puts, as without a backer).
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
            claimed: AtomicU64::new(backed),
            inflight: AtomicU64::new(0),
            want: AtomicU64::new(want),
            stop: AtomicBool::new(false),
        });
        let spawned = std::thread::Builder::new()
            .name("pinshm-backer".into())
            .spawn({
                let shared = Arc::clone(&shared);
                move || shared.run()
            });
        match spawned {
            // Not joined: it ends by itself (see the module's doc).
            Ok(t) => Some(Ahead {
                shared,
                thread: t.thread().clone(),
                fork_gen: fork::current(),
                step,
                asked: want,
                last_end: 0,
            }),
            Err(e) => {
                tracing::debug!(%e, "no backer thread: pages are backed inside the puts");
                None
            }
        }
    }

    /// Makes `offset..offset + len` allocated before the writer writes it
    /// (as [`Backing::ensure`]), taking what the backer has done. Returns
    /// the bytes the writer allocated itself. A writer that had to asks the
    /// backer for a step more at once (it works on past the span while the
    /// writer fills it); one that did not asks once the put is published
    /// ([`Ahead::kick`]), so that the backer's page work, which costs
    /// memory bandwidth (zeroing) and a core, runs between puts rather than
    /// under their copy.
    pub(super) fn ensure(
        &mut self,
        backing: &mut Backing,
        seg: &Segment,
        offset: u64,
        len: u64,
    ) -> Result<u64> {
        let end = offset.saturating_add(len);
        backing.mark_prefix(self.shared.claimed.load(Ordering::Acquire));
        self.last_end = self.last_end.max(end);
        if end <= backing.backed() {
            return Ok(0);
        }
        let from = backing.backed();
        let to = end.next_multiple_of(Backing::CHUNK).min(seg.len() as u64);
        self.shared.allocate(seg, from, to)?;
        backing.mark_prefix(to);
        self.shared.claimed.fetch_max(to, Ordering::Release);
        self.ask(end);
        Ok(to - from)
    }

    /// A put is published: asks the backer for a step past the end of
    /// what the writer has used.
    pub(super) fn kick(&mut self) {
        self.ask(self.last_end);
    }

    /// Whether `backing` covers the whole data region: nothing is left
    /// to back ahead.
    pub(super) fn finished(&self, backing: &Backing) -> bool {
        backing.backed() >= self.shared.end
    }

    /// Asks the backer to allocate up to `step` bytes past `end`. Wakes it
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
        self.shared.want.store(target, Ordering::Release);
        if self.shared.claimed.load(Ordering::Relaxed) < target {
            self.thread.unpark();
        }
    }
}

impl Shared {
    /// The backer's loop: a unit at a time towards `want`, until the data
    /// region is allocated or the store stops it.
    fn run(&self) {
        lower_priority();
        let seg = self.map.seg();
        // A `want` that could not be reached; tried again only past it.
        let mut blocked_at = 0;
        loop {
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            let from = self.claimed.load(Ordering::Acquire);
            if from >= self.end {
                return;
            }
            let want = self.want.load(Ordering::Acquire);
            if want <= from || want <= blocked_at {
                // Woken by the writer's unpark (or spuriously): look again.
                std::thread::park();
                continue;
            }
            let to = want
                .min(from.saturating_add(UNIT))
                .next_multiple_of(Backing::CHUNK)
                .min(self.end.next_multiple_of(Backing::CHUNK))
                .min(seg.len() as u64);
            if !matches!(self.allocate(seg, from, to), Ok(true)) {
                // The headroom, a full /dev/shm, or no `fallocate` here.
                blocked_at = want;
                continue;
            }
            self.claimed.fetch_max(to, Ordering::Release);
            seg.map_pages(from, to - from);
        }
    }

    /// Allocates `from..to` of `seg` (`Ok(false)`: no `fallocate` here),
    /// leaving the headroom free of what either party allocates (the
    /// `inflight` protocol of the module's doc).
    fn allocate(&self, seg: &Segment, from: u64, to: u64) -> Result<bool> {
        let len = to - from;
        let others = self.inflight.fetch_add(len, Ordering::AcqRel);
        let r = if self.headroom > 0 {
            segment::check_headroom(seg, len, self.headroom.saturating_add(others))
                .and_then(|()| seg.allocate_pages(from, len))
        } else {
            seg.allocate_pages(from, len)
        };
        self.inflight.fetch_sub(len, Ordering::AcqRel);
        r
    }
}

/// Makes the calling thread the lowest priority it may be (nice 19): best
/// effort, a thread left at its priority still works.
fn lower_priority() {
    // SAFETY: plain system calls about the calling thread (Linux keeps a
    // nice value per thread; `who` is its id); they touch no memory of ours.
    let r = unsafe {
        let tid = nix::libc::gettid();
        nix::libc::setpriority(nix::libc::PRIO_PROCESS, tid as nix::libc::id_t, NICE)
    };
    if r != 0 {
        tracing::debug!("backer thread keeps its priority (setpriority failed)");
    }
}

impl Drop for Ahead {
    fn drop(&mut self) {
        if fork::current() != self.fork_gen {
            // A forked child's copy: the thread is the parent's (a child
            // has only the thread that forked). Nothing to tell it.
            return;
        }
        self.shared.stop.store(true, Ordering::Release);
        self.thread.unpark();
    }
}
