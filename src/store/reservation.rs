//! [`Reservation`]: a slot whose bytes the caller writes by any means (a
//! device-to-host copy queued by another runtime, torch's say), published
//! when the caller says the bytes are complete.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::handle::ObjectHandle;
use super::keys::PendingCopy;
use super::writer::ObjectStore;
use crate::codec::{self, TENSOR_HEADER_LEN};
use crate::copy::KeepAlive;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::ObjectKind;

/// A reserved, unpublished slot: no reader can see it and the writer does
/// not reuse it while the reservation lives. Write its bytes through
/// [`Reservation::bytes_mut`] (or the pointer, from a copy engine of your
/// own), then publish it with [`ObjectStore::publish`]. Given back
/// unpublished ([`ObjectStore::abort`], or dropped), its key is free at
/// once for another put; its slot is freed by `abort` at once, after a
/// drop in turn.
///
/// ```
/// use pinshm::{ObjectStore, StoreConfig, StoreReader, codec::DType};
/// # let name = format!("pinshm-doc-reserve-{}", std::process::id());
/// let mut store = ObjectStore::create(StoreConfig::new(1 << 20, 1 << 16, 1).name(&name))?;
/// let mut r = store.reserve_tensor("t", DType::F32, &[2])?;
/// r.bytes_mut().copy_from_slice(bytemuck::cast_slice(&[1.0f32, 2.0]));
/// let h = store.publish(r)?;
/// let reader = StoreReader::attach(&store.handle())?;
/// assert_eq!(reader.get_tensor(h)?.as_slice::<f32>()?, &[1.0, 2.0]);
/// # Ok::<(), pinshm::Error>(())
/// ```
#[derive(Debug)]
#[must_use = "the object is published only by ObjectStore::publish"]
pub struct Reservation {
    id: u64,
    store: u64,
    data: *mut u8,
    len: usize,
    state: Arc<Writing>,
    /// The mapping stays while the reservation can write into it, even
    /// past the store.
    _keep: KeepAlive,
}

// SAFETY: `data` points into the mapping `_keep` holds; only the holder of
// `&mut Reservation` writes through it.
unsafe impl Send for Reservation {}

/// What the store sees of a reservation (its pending copy).
#[derive(Debug)]
struct Writing {
    /// The caller may still be writing the bytes.
    open: AtomicBool,
    /// Given up while still open ([`Reservation::abandon`]): never
    /// published, its key free at once.
    abandoned: AtomicBool,
}

impl PendingCopy for Writing {
    fn is_done(&self) -> bool {
        !self.open.load(Ordering::Acquire)
    }
    fn wait(&self) -> Result<()> {
        Ok(())
    }
    fn abandoned(&self) -> bool {
        // Published reservations are not pending any more; a closed one
        // still pending was dropped.
        self.is_done()
    }
    fn given_up(&self) -> bool {
        self.is_done() || self.abandoned.load(Ordering::Acquire)
    }
}

impl Reservation {
    /// The bytes to write (a tensor's payload, after its header; all of a
    /// [`ObjectStore::reserve_bytes`]).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `data..data+len` lies in a slot reserved for this put
        // (checked by the writer's reserve), in a mapping `_keep` keeps; it
        // is unpublished, so no reader reads it, and the writer does not
        // reuse it while `open` is set, which only our drop or publish
        // clears. `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.data, self.len) }
    }

    /// The start of the bytes, for a copy engine that writes them itself
    /// (valid, and written by nobody else, while the reservation lives).
    /// An asynchronous copy into them must have finished before the
    /// reservation is published or dropped: the slot may be read, or
    /// reclaimed and reused, from then on.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.data
    }

    /// How many bytes to write.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the reservation was made by `store` (what
    /// [`ObjectStore::publish`] checks first).
    pub fn belongs_to(&self, store: &ObjectStore) -> bool {
        self.store == store.identity()
    }

    /// Whether there are no bytes to write (an empty tensor).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Gives the put up without dropping the reservation (for a binding
    /// whose views of the bytes may outlive the abort): its key is free
    /// for another put at once, and [`ObjectStore::publish`] refuses it.
    /// The bytes stay writable, seen by nobody, until the reservation
    /// drops; its slot is reclaimed only after that.
    pub fn abandon(&mut self) {
        self.state.abandoned.store(true, Ordering::Release);
    }

    /// Whether [`Reservation::abandon`] was called.
    pub fn is_abandoned(&self) -> bool {
        self.state.abandoned.load(Ordering::Acquire)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.state.open.store(false, Ordering::Release);
    }
}

impl ObjectStore {
    /// Reserves a slot for a tensor of `dtype` and `shape` under `key`, its
    /// header written; its payload is the caller's to write. Errors as a
    /// put (`DuplicateKey`, `TooLarge`, `Full`, `NoSpace`).
    pub fn reserve_tensor(
        &mut self,
        key: &str,
        dtype: DType,
        shape: &[u64],
    ) -> Result<Reservation> {
        let len = codec::payload_len(dtype, shape)?;
        let total = len
            .checked_add(TENSOR_HEADER_LEN)
            .ok_or_else(|| Error::InvalidTensor("tensor size overflows".into()))?;
        self.reserve_object(key, total, ObjectKind::Tensor, TENSOR_HEADER_LEN, |obj| {
            codec::write_tensor_header(obj, dtype, shape, len)
        })
    }

    /// Reserves a slot of `len` bytes under `key`, for the caller to write
    /// by any means (torch's multi-threaded `copy_`, a copy engine): once
    /// published it is what `put(key, bytes)` of those bytes stores, read
    /// as any put's (`get`, `get_private`). Errors as a put.
    ///
    /// ```
    /// use pinshm::{ObjectStore, StoreConfig, StoreReader};
    /// # let name = format!("pinshm-doc-reserve-bytes-{}", std::process::id());
    /// let mut store = ObjectStore::create(StoreConfig::new(1 << 20, 1 << 16, 1).name(&name))?;
    /// let mut r = store.reserve_bytes("b", 5)?;
    /// r.bytes_mut().copy_from_slice(b"bytes");
    /// let h = store.publish(r)?;
    /// let reader = StoreReader::attach(&store.handle())?;
    /// assert_eq!(&*reader.get(h)?, b"bytes");
    /// # Ok::<(), pinshm::Error>(())
    /// ```
    pub fn reserve_bytes(&mut self, key: &str, len: usize) -> Result<Reservation> {
        self.reserve_object(key, len, ObjectKind::Raw, 0, |_| {})
    }

    /// A pending object of `total` bytes and `kind`, its first `head`
    /// bytes written by `write_head`; the caller writes the rest.
    fn reserve_object(
        &mut self,
        key: &str,
        total: usize,
        kind: ObjectKind,
        head: usize,
        write_head: impl FnOnce(&mut [u8]),
    ) -> Result<Reservation> {
        debug_assert!(head <= total, "a reservation's head lies inside it");
        let state = Arc::new(Writing {
            open: AtomicBool::new(true),
            abandoned: AtomicBool::new(false),
        });
        let mut data = std::ptr::null_mut();
        let pending = Arc::clone(&state) as Arc<dyn PendingCopy>;
        let id = self.begin_pending(key, total, kind, |p| {
            // SAFETY: p spans the `total` bytes of the reserved, unpublished object.
            let obj = unsafe { std::slice::from_raw_parts_mut(p, total) };
            write_head(&mut obj[..head]);
            // SAFETY: the rest starts after the head, inside the object
            // (`head <= total`: both callers' heads are part of their totals).
            data = unsafe { p.add(head) };
            Ok(pending)
        })?;
        Ok(Reservation {
            id,
            store: self.identity(),
            data,
            len: total - head,
            state,
            _keep: self.mapping(),
        })
    }

    /// Publishes a reservation whose bytes are complete: readers may get
    /// it from now on. `Stale` if the store was cleared meanwhile;
    /// `PutNotPending` if it is another store's (check first with
    /// [`Reservation::belongs_to`]: it is dropped here, so aborted in its
    /// own store).
    pub fn publish(&mut self, r: Reservation) -> Result<ObjectHandle> {
        if !r.belongs_to(self) {
            return Err(Error::PutNotPending {
                id: r.id,
                reason: "it belongs to another store",
            });
        }
        let id = r.id;
        if r.is_abandoned() {
            drop(r);
            // Its key was free already; its slot goes now.
            self.free_given_up(id);
            return Err(Error::PutNotPending {
                id,
                reason: "it was abandoned",
            });
        }
        // Dropping it closes it: the pending copy is done, and published here.
        drop(r);
        self.finish_pending(id)
    }

    /// Gives a reservation back unpublished: its key is free for another
    /// put, and its slot is reclaimed, at once (dropping it frees the key
    /// at once too, the slot in turn). Nothing may still be writing its
    /// bytes (a copy into them must have completed or failed). Another
    /// store's reservation is dropped (so given back to its own store).
    ///
    /// ```
    /// use pinshm::{ObjectStore, StoreConfig, codec::DType};
    /// # let name = format!("pinshm-doc-abort-{}", std::process::id());
    /// let mut store = ObjectStore::create(StoreConfig::new(1 << 20, 1 << 16, 1).name(&name))?;
    /// let r = store.reserve_tensor("t", DType::F32, &[2])?;
    /// store.abort(r); // the copy into it failed, say
    /// assert!(!store.is_pending("t"));
    /// store.put("t", b"saved again")?;
    /// # Ok::<(), pinshm::Error>(())
    /// ```
    pub fn abort(&mut self, r: Reservation) {
        let (id, ours) = (r.id, r.belongs_to(self));
        drop(r);
        if ours && self.is_owner() {
            self.free_given_up(id);
        }
    }
}
