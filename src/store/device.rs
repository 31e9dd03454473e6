//! Device puts and gets: the store joined to a [`CopyEngine`]. The object
//! of a device put becomes visible only when its copy has completed; the
//! slot of a device get is held until its copy has completed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::guard::ReadGuard;
use super::handle::ObjectHandle;
use super::reader::StoreReader;
use super::writer::{ObjectStore, PendingCopy};
use crate::codec::{self, ItemLayout, TENSOR_HEADER_LEN};
use crate::copy::{check_pack, wait_all, CopyEngine, DeviceBuffer, KeepAlive, PackDesc, Ticket};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::ObjectKind;

/// The store's view of a put in flight: its tickets, and whether the
/// caller still holds the [`PendingPut`].
#[derive(Debug)]
struct PutInFlight {
    tickets: Vec<Ticket>,
    token_alive: AtomicBool,
}

impl PendingCopy for PutInFlight {
    fn is_done(&self) -> bool {
        // A poll that cannot tell is "not done": the slot stays pending.
        self.tickets.iter().all(|t| t.poll().unwrap_or(false))
    }
    fn wait(&self) -> Result<()> {
        wait_all(self.tickets.iter().cloned())
    }
    fn abandoned(&self) -> bool {
        !self.token_alive.load(Ordering::Acquire)
    }
    fn given_up(&self) -> bool {
        // A copy that failed is never published: its key may go before
        // the caller finishes the put (`wait` does not block once done).
        self.abandoned() || (self.is_done() && self.wait().is_err())
    }
}

/// A put whose copy into its slot is in flight. Finish it with
/// [`ObjectStore::finish_put`] (or poll with [`ObjectStore::try_finish_put`]);
/// dropped unfinished, its key is free at once and the slot is freed once
/// the copy stops. A copy that fails frees the key at once too.
#[derive(Debug)]
#[must_use = "the object is published only by finish_put"]
pub struct PendingPut {
    id: u64,
    store: u64,
    state: Arc<PutInFlight>,
}

impl Drop for PendingPut {
    fn drop(&mut self) {
        self.state.token_alive.store(false, Ordering::Release);
    }
}

impl ObjectStore {
    fn start_put(
        &mut self,
        key: &str,
        len: usize,
        kind: ObjectKind,
        start: impl FnOnce(*mut u8, KeepAlive) -> Result<Vec<Ticket>>,
    ) -> Result<PendingPut> {
        let mut state = None;
        // Every copy into the slot holds the mapping: it stays valid under
        // the copy even if this store is dropped and the token leaked.
        let keep: KeepAlive = self.mapping();
        let id = self.begin_pending(key, len, kind, |payload| {
            let s = Arc::new(PutInFlight {
                tickets: start(payload, keep)?,
                token_alive: AtomicBool::new(true),
            });
            state = Some(s.clone());
            Ok(s as Arc<dyn PendingCopy>)
        })?;
        Ok(PendingPut {
            id,
            store: self.identity(),
            state: state.expect("set by begin_pending on success"),
        })
    }

    /// Reserves a slot for `src.len()` bytes and starts copying `src` into
    /// it. The object becomes visible (gets its handle) only when
    /// [`ObjectStore::finish_put`] sees the copy complete.
    pub fn put_from_device<E: CopyEngine + ?Sized>(
        &mut self,
        key: &str,
        src: &DeviceBuffer,
        engine: &E,
    ) -> Result<PendingPut> {
        engine.check_device(src)?;
        self.start_put(key, src.len(), ObjectKind::Raw, |p, keep| {
            // SAFETY: the slot is reserved for this put and not published
            // until finish_put has waited for the ticket; `keep` holds the
            // mapping.
            Ok(vec![unsafe { engine.d2h_async(src, p, Some(keep))? }])
        })
    }

    /// As [`ObjectStore::put_from_device`] for a tensor of `dtype` and `shape`.
    pub fn put_tensor_from_device<E: CopyEngine + ?Sized>(
        &mut self,
        key: &str,
        dtype: DType,
        shape: &[u64],
        src: &DeviceBuffer,
        engine: &E,
    ) -> Result<PendingPut> {
        engine.check_device(src)?;
        let len = codec::payload_len(dtype, shape)?;
        if len != src.len() {
            return Err(Error::DeviceRange(format!(
                "tensor {shape:?} of {dtype:?} is {len} bytes, the device buffer {}",
                src.len()
            )));
        }
        self.start_put(
            key,
            len + TENSOR_HEADER_LEN,
            ObjectKind::Tensor,
            |p, keep| {
                // SAFETY: p spans the reserved, unpublished object.
                let obj = unsafe { std::slice::from_raw_parts_mut(p, len + TENSOR_HEADER_LEN) };
                codec::write_tensor_header(obj, dtype, shape, len);
                // SAFETY: as put_from_device; the payload starts after the header.
                Ok(vec![unsafe {
                    engine.d2h_async(src, p.add(TENSOR_HEADER_LEN), Some(keep))?
                }])
            },
        )
    }

    /// As [`ObjectStore::put_from_device`] for an item: one device buffer
    /// per field of `layout`, in order, each copied into its field.
    pub fn put_item_from_device<E: CopyEngine + ?Sized>(
        &mut self,
        key: &str,
        layout: &ItemLayout,
        srcs: &[&DeviceBuffer],
        engine: &E,
    ) -> Result<PendingPut> {
        let fields = &layout.header().fields;
        if srcs.len() != fields.len() {
            return Err(Error::DeviceRange(format!(
                "{} device buffers for {} fields",
                srcs.len(),
                fields.len()
            )));
        }
        for (f, s) in fields.iter().zip(srcs) {
            engine.check_device(s)?;
            if s.len() as u64 != f.len {
                return Err(Error::DeviceRange(format!(
                    "field '{}' is {} bytes, its device buffer {}",
                    f.name,
                    f.len,
                    s.len()
                )));
            }
        }
        self.start_put(key, layout.len(), ObjectKind::Item, |p, keep| {
            // SAFETY: p spans the reserved, unpublished object.
            layout.write_header(unsafe { std::slice::from_raw_parts_mut(p, layout.len()) });
            let mut tickets = Vec::with_capacity(srcs.len());
            for (f, s) in fields.iter().zip(srcs) {
                // SAFETY: as put_from_device, into the field's own range.
                match unsafe { engine.d2h_async(s, p.add(f.offset as usize), Some(keep.clone())) } {
                    Ok(t) => tickets.push(t),
                    Err(e) => {
                        // Copies already started must stop before the slot
                        // is given back.
                        let _ = wait_all(tickets);
                        return Err(e);
                    }
                }
            }
            Ok(tickets)
        })
    }

    /// Gathers many small or strided device tensors into one object of
    /// `len` bytes in one operation (one kernel launch on CUDA).
    ///
    /// # Safety
    /// Every piece of `descs` is device memory of `engine`'s device, kept
    /// alive and unwritten until the put is finished.
    pub unsafe fn put_packed_from_device<E: CopyEngine + ?Sized>(
        &mut self,
        key: &str,
        descs: &[PackDesc],
        len: usize,
        engine: &E,
    ) -> Result<PendingPut> {
        check_pack(descs, len)?;
        self.start_put(key, len, ObjectKind::Raw, |p, keep| {
            // SAFETY: the caller's contract for the pieces; the slot as in
            // put_from_device.
            Ok(vec![unsafe {
                engine.pack_async(descs, p, len, Some(keep))?
            }])
        })
    }

    /// Waits for a pending put's copy and publishes the object. Errors if
    /// the copy failed (the slot is then freed in turn) or the store was
    /// cleared meanwhile (`Stale`).
    pub fn finish_put(&mut self, p: PendingPut) -> Result<ObjectHandle> {
        self.check_token(&p)?;
        self.finish_pending(p.id)
    }

    /// Publishes a pending put if its copy has completed; `None` if not yet.
    pub fn try_finish_put(&mut self, p: &PendingPut) -> Result<Option<ObjectHandle>> {
        self.check_token(p)?;
        if !self.pending_done(p.id) {
            return Ok(None);
        }
        self.finish_pending(p.id).map(Some)
    }

    fn check_token(&self, p: &PendingPut) -> Result<()> {
        if p.store != self.identity() {
            return Err(Error::PutNotPending {
                id: p.id,
                reason: "it belongs to another store",
            });
        }
        Ok(())
    }
}

/// A copy out of a slot in flight. The slot is held (and the read not yet
/// acknowledged) until the copy has completed: [`PendingGet::wait`], or
/// drop, which waits too.
#[derive(Debug)]
#[must_use = "dropping a PendingGet blocks until its copy completes"]
pub struct PendingGet {
    tickets: Vec<Ticket>,
    guard: Option<ReadGuard>,
    len: usize,
}

impl PendingGet {
    /// Whether the copy has completed.
    pub fn poll(&self) -> Result<bool> {
        for t in &self.tickets {
            if !t.poll()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Waits for the copy, then acknowledges the read; returns bytes copied.
    pub fn wait(mut self) -> Result<usize> {
        let r = self.finish();
        r.map(|_| self.len)
    }

    fn finish(&mut self) -> Result<()> {
        let r = wait_all(self.tickets.drain(..));
        if matches!(r, Err(Error::DeviceLost { .. })) {
            // The copy may still read the slot: keep the hold for good.
            std::mem::forget(self.guard.take());
        }
        // Only now may the writer reuse the slot.
        self.guard.take();
        r
    }
}

impl Drop for PendingGet {
    fn drop(&mut self) {
        if self.guard.is_some() {
            if let Err(e) = self.finish() {
                tracing::debug!(%e, "copy out of a slot failed");
            }
        }
    }
}

impl StoreReader {
    /// Starts copying the object `h` into `dst` (from its start):
    /// `get(h)` then [`ReadGuard::to_device`].
    pub fn get_to_device<E: CopyEngine + ?Sized>(
        &self,
        h: ObjectHandle,
        dst: &DeviceBuffer,
        engine: &E,
    ) -> Result<PendingGet> {
        engine.check_device(dst)?;
        self.get(h)?.to_device(dst, engine)
    }

    /// Starts copying the payload of tensor `h` into `dst`:
    /// `get(h)` then [`ReadGuard::tensor_to_device`].
    pub fn get_tensor_to_device<E: CopyEngine + ?Sized>(
        &self,
        h: ObjectHandle,
        dst: &DeviceBuffer,
        engine: &E,
    ) -> Result<PendingGet> {
        engine.check_device(dst)?;
        self.get(h)?.tensor_to_device(dst, engine)
    }
}

impl ReadGuard {
    /// Starts copying the whole object into `dst` (from its start). The
    /// guard moves into the [`PendingGet`], which holds the slot until the
    /// copy has completed.
    pub fn to_device<E: CopyEngine + ?Sized>(
        self,
        dst: &DeviceBuffer,
        engine: &E,
    ) -> Result<PendingGet> {
        let len = self.len();
        self.copy_out(0, len, dst, engine)
    }

    /// Starts copying the payload of this tensor into `dst`.
    pub fn tensor_to_device<E: CopyEngine + ?Sized>(
        self,
        dst: &DeviceBuffer,
        engine: &E,
    ) -> Result<PendingGet> {
        let len = self.tensor()?.bytes().len();
        self.copy_out(TENSOR_HEADER_LEN, len, dst, engine)
    }

    fn copy_out<E: CopyEngine + ?Sized>(
        self,
        offset: usize,
        len: usize,
        dst: &DeviceBuffer,
        engine: &E,
    ) -> Result<PendingGet> {
        debug_assert!(offset + len <= self.len());
        engine.check_fits(len, dst)?;
        // The copy holds the mapping: were this PendingGet leaked and the
        // reader dropped, the memory under the copy stays valid (and the
        // reader's lock, hence its hold on the slot, stays held).
        let keep: KeepAlive = self.reader.map.clone();
        // SAFETY: the guard holds the slot (its hold keeps the writer from
        // reusing it) until PendingGet has waited for the ticket; `keep`
        // keeps the mapping valid under the copy whatever happens to it.
        let t = unsafe { engine.h2d_async(self.as_ptr().add(offset), len, dst, Some(keep))? };
        Ok(PendingGet {
            tickets: vec![t],
            guard: Some(self),
            len,
        })
    }
}
