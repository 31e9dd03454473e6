//! [`Lease`]: an object kept from reclamation by a reader that has not
//! read it.

use super::share::Share;

use super::attached::Attached;
use super::handle::ObjectHandle;
use crate::atomics::SlotPtr;

/// An object kept in the store, unread: one hold in its slot, as a
/// [`ReadGuard`](crate::ReadGuard)'s, with no view and no read to
/// acknowledge. The writer never reclaims the object while the lease
/// lives, and allocates around it. Made by
/// [`StoreReader::lease`](crate::StoreReader::lease) or
/// [`StoreReader::lease_key`](crate::StoreReader::lease_key); ended by
/// [`Lease::release`] or drop.
///
/// A lease is its reader process's: if the process dies, the kernel drops
/// its reader lock and the writer ignores its leases (the hold words
/// carry the reader's attach generation). A lease leaked with
/// `mem::forget` keeps the object until the process exits. Like a guard,
/// a lease owns a share of its reader's attachment and may outlive the
/// `StoreReader`. In a forked child a lease is the parent's: dropping it
/// there releases nothing.
///
/// ```
/// use pinshm::{ObjectStore, StoreConfig, StoreReader};
/// # let name = format!("pinshm-doc-lease-{}", std::process::id());
/// let cfg = StoreConfig::new(1 << 20, 1 << 16, 1).name(&name).cache(true).key_index(64);
/// let mut store = ObjectStore::create(cfg)?;
/// store.put("image-7", b"encoder output")?;
/// let reader = StoreReader::attach(&store.handle())?;
/// let lease = reader.lease_key("image-7")?.expect("stored and indexed");
/// // ... the workers are told to load it; it stays until:
/// let h = lease.handle();
/// lease.release();
/// assert_eq!(&*reader.get(h)?, b"encoder output");
/// # Ok::<(), pinshm::Error>(())
/// ```
#[derive(Debug)]
#[must_use = "a lease keeps its object only while it lives"]
pub struct Lease {
    reader: Share<Attached>,
    slot: SlotPtr,
    handle: ObjectHandle,
}

// SAFETY: `slot` points into the mapping that `reader` keeps alive; a
// lease touches nothing but its slot's hold word, with an atomic RMW, when
// it goes. `Attached` is `Send + Sync`.
unsafe impl Send for Lease {}
// SAFETY: through `&Lease` only the plain handle is read.
unsafe impl Sync for Lease {}

impl Lease {
    pub(super) fn new(reader: Share<Attached>, slot: SlotPtr, handle: ObjectHandle) -> Lease {
        Lease {
            reader,
            slot,
            handle,
        }
    }

    /// The handle of the leased object (good for `get` while the lease lives).
    pub fn handle(&self) -> ObjectHandle {
        self.handle
    }

    /// Ends the lease (as dropping it does).
    pub fn release(self) {}
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.reader.release_hold(&self.slot);
    }
}
