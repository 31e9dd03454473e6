//! [`CpuEngine`]: an emulated device whose memory is host memory and whose
//! copies run in order on one worker thread, like a CUDA stream.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};

use super::{
    check_pack, pack_cpu, unpack_cpu, Completion, CopyEngine, DeviceBuffer, DeviceId, KeepAlive,
    PackDesc, Ticket,
};
use crate::error::{Error, Result};

enum Job {
    /// Blocks the worker until the [`Pause`]'s sender is dropped.
    Pause(Receiver<()>),
    Copy {
        src: usize,
        dst: usize,
        len: usize,
    },
    Pack {
        descs: Vec<PackDesc>,
        dst: usize,
        len: usize,
    },
    Unpack {
        descs: Vec<PackDesc>,
        src: usize,
        len: usize,
    },
}

struct Work {
    job: Job,
    keep: Vec<KeepAlive>,
    done: Sender<Result<(), String>>,
}

/// An emulated device: "device memory" is host memory, copies run in order
/// on one worker thread (like a stream), optionally slowed down to let tests
/// observe copies in flight.
#[derive(Debug)]
pub struct CpuEngine {
    id: DeviceId,
    jobs: Option<Sender<Work>>,
    worker: Option<std::thread::JoinHandle<()>>,
}

/// Memory of a [`CpuEngine`] buffer.
struct CpuMem {
    _bytes: Box<[std::cell::UnsafeCell<u8>]>,
}
// SAFETY: the bytes are only reached through raw pointers under the copy
// protocol (a buffer is not written by two copies at once, by contract).
unsafe impl Sync for CpuMem {}

impl Default for CpuEngine {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuEngine {
    /// An engine whose copies run at memcpy speed.
    pub fn new() -> Self {
        Self::with_delay(Duration::ZERO)
    }

    /// An engine that waits `delay` before each copy (for tests).
    pub fn with_delay(delay: Duration) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let (tx, rx) = crossbeam_channel::unbounded::<Work>();
        let worker = std::thread::Builder::new()
            .name("pinshm-cpu-engine".into())
            .spawn(move || {
                for w in rx {
                    if !delay.is_zero() {
                        std::thread::sleep(delay);
                    }
                    let r = run_job(&w.job);
                    drop(w.keep);
                    let _ = w.done.send(r);
                }
            })
            .expect("spawn the CPU copy engine's worker thread");
        CpuEngine {
            id: (1 << 63) | NEXT.fetch_add(1, Ordering::Relaxed),
            jobs: Some(tx),
            worker: Some(worker),
        }
    }

    /// Pauses this engine's queue until the returned [`Pause`] is dropped:
    /// copies started meanwhile wait, in order, as behind a busy stream.
    /// For tests that must see copies in flight without relying on time.
    pub fn pause(&self) -> Result<Pause> {
        let (release, wait) = crossbeam_channel::bounded(0);
        let ticket = self.submit(Job::Pause(wait), Vec::new())?;
        Ok(Pause {
            _release: release,
            _ticket: ticket,
        })
    }

    fn submit(&self, job: Job, keep: Vec<KeepAlive>) -> Result<Ticket> {
        let (done, rx) = crossbeam_channel::bounded(1);
        self.jobs
            .as_ref()
            .expect("jobs sender lives until drop")
            .send(Work { job, keep, done })
            .map_err(|_| Error::copy("CPU engine worker is gone"))?;
        Ok(Ticket::new(CpuCompletion {
            rx,
            outcome: std::sync::OnceLock::new(),
        }))
    }
}

/// A paused [`CpuEngine`] queue (see [`CpuEngine::pause`]); dropping it
/// lets the queue run on.
#[derive(Debug)]
#[must_use = "the queue runs on as soon as the Pause is dropped"]
pub struct Pause {
    _release: Sender<()>,
    _ticket: Ticket,
}

fn run_job(job: &Job) -> Result<(), String> {
    // The submitter's contract (d2h_async / h2d_async / pack_async /
    // unpack_async) keeps every range valid and unshared until this job
    // reports completion.
    match *job {
        Job::Pause(ref wait) => {
            // Returns when the Pause drops its sender.
            let _ = wait.recv();
            Ok(())
        }
        // SAFETY: the submitter's contract: both ranges valid, unshared.
        Job::Copy { src, dst, len } => unsafe {
            std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len);
            Ok(())
        },
        Job::Pack {
            ref descs,
            dst,
            len,
            // SAFETY: the submitter's contract for the pieces and `dst`.
        } => unsafe {
            pack_cpu(descs, std::slice::from_raw_parts_mut(dst as *mut u8, len))
                .map_err(|e| e.to_string())
        },
        Job::Unpack {
            ref descs,
            src,
            len,
            // SAFETY: the submitter's contract for the pieces and `src`.
        } => unsafe {
            unpack_cpu(descs, std::slice::from_raw_parts(src as *const u8, len))
                .map_err(|e| e.to_string())
        },
    }
}

impl Drop for CpuEngine {
    fn drop(&mut self) {
        // Close the queue, let queued copies finish (their memory is still
        // borrowed by pending puts and gets), then join.
        self.jobs.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

#[derive(Debug)]
struct CpuCompletion {
    rx: Receiver<Result<(), String>>,
    outcome: std::sync::OnceLock<Result<(), String>>,
}

// SAFETY: the worker sends the outcome only after the job has run (and
// dropped its keep-alives only then); a closed channel means the job will
// never run. poll never fails.
unsafe impl Completion for CpuCompletion {
    fn poll(&self) -> Result<bool> {
        if self.outcome.get().is_none() {
            if let Ok(r) = self.rx.try_recv() {
                let _ = self.outcome.set(r);
            }
        }
        Ok(self.outcome.get().is_some())
    }

    fn wait(&self) -> Result<()> {
        let r = self.outcome.get_or_init(|| {
            self.rx
                .recv()
                .unwrap_or_else(|_| Err("CPU engine stopped before the copy ran".into()))
        });
        r.clone().map_err(Error::copy)
    }
}

// SAFETY: tickets carry CpuCompletions (see there); every job owns its
// keep-alives until it has run, whatever happens to its ticket; upload and
// download go through the same queue as the copies, so they run after them.
unsafe impl CopyEngine for CpuEngine {
    fn device(&self) -> DeviceId {
        self.id
    }

    fn alloc(&self, len: usize) -> Result<DeviceBuffer> {
        let mem: Box<[std::cell::UnsafeCell<u8>]> =
            (0..len).map(|_| std::cell::UnsafeCell::new(0)).collect();
        let ptr = mem.as_ptr() as u64;
        Ok(DeviceBuffer::owned(
            ptr,
            len,
            self.id,
            Arc::new(CpuMem { _bytes: mem }),
        ))
    }

    fn upload(&self, src: &[u8], dst: &DeviceBuffer) -> Result<()> {
        self.check_fits(src.len(), dst)?;
        // SAFETY: dst is this engine's host-backed buffer with room for src;
        // src stays borrowed (valid, unwritten) until wait returns below.
        let t = unsafe { self.h2d_async(src.as_ptr(), src.len(), dst, None)? };
        t.wait()
    }

    fn download(&self, src: &DeviceBuffer, dst: &mut [u8]) -> Result<()> {
        self.check_device(src)?;
        if dst.len() < src.len {
            return Err(Error::DeviceRange(format!(
                "{} bytes into {}",
                src.len,
                dst.len()
            )));
        }
        // SAFETY: dst has room for src.len bytes and stays mutably borrowed
        // (nobody else touches it) until wait returns below.
        let t = unsafe { self.d2h_async(src, dst.as_mut_ptr(), None)? };
        t.wait()
    }

    unsafe fn d2h_async(
        &self,
        src: &DeviceBuffer,
        dst: *mut u8,
        keep: Option<KeepAlive>,
    ) -> Result<Ticket> {
        self.check_device(src)?;
        self.submit(
            Job::Copy {
                src: src.ptr as usize,
                dst: dst as usize,
                len: src.len,
            },
            src.keep.iter().cloned().chain(keep).collect(),
        )
    }

    unsafe fn h2d_async(
        &self,
        src: *const u8,
        len: usize,
        dst: &DeviceBuffer,
        keep: Option<KeepAlive>,
    ) -> Result<Ticket> {
        self.check_fits(len, dst)?;
        self.submit(
            Job::Copy {
                src: src as usize,
                dst: dst.ptr as usize,
                len,
            },
            dst.keep.iter().cloned().chain(keep).collect(),
        )
    }

    unsafe fn pack_async(
        &self,
        descs: &[PackDesc],
        dst: *mut u8,
        len: usize,
        keep: Option<KeepAlive>,
    ) -> Result<Ticket> {
        check_pack(descs, len)?;
        self.submit(
            Job::Pack {
                descs: descs.to_vec(),
                dst: dst as usize,
                len,
            },
            keep.into_iter().collect(),
        )
    }

    unsafe fn unpack_async(
        &self,
        src: *const u8,
        len: usize,
        descs: &[PackDesc],
        keep: Option<KeepAlive>,
    ) -> Result<Ticket> {
        check_pack(descs, len)?;
        self.submit(
            Job::Unpack {
                descs: descs.to_vec(),
                src: src as usize,
                len,
            },
            keep.into_iter().collect(),
        )
    }
}
