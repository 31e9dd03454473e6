//! [`ReadGuard`]: a zero-copy view of one object, holding its slot.

use std::ops::Deref;

use super::handle::ObjectHandle;
use super::reader::StoreReader;
use crate::atomics::SlotPtr;
use crate::layout::ObjectKind;

/// A zero-copy view of an object in the ring. Dropping it acknowledges the
/// read; while it lives the slot cannot be reused. Guards are not limited
/// in number, and the writer allocates around the objects they hold.
///
/// Across `fork`: the guard is the parent's. In the child every segment
/// mapping is made inaccessible at the fork (see `crate::sys::fork`), so
/// reading an inherited guard's bytes faults (SIGSEGV) instead of returning
/// bytes that the parent's release let the writer replace; dropping it in
/// the child releases nothing.
///
/// A guard cannot outlive its reader:
///
/// ```compile_fail
/// use pinshm::{ObjectStore, StoreConfig, StoreReader};
/// let mut store = ObjectStore::create(StoreConfig::new(1 << 20, 1 << 16, 1)).unwrap();
/// let h = store.put("k", b"v").unwrap();
/// let guard = {
///     let reader = StoreReader::attach(&store.handle()).unwrap();
///     reader.get(h).unwrap()
/// };
/// ```
#[derive(Debug)]
pub struct ReadGuard<'r> {
    pub(super) reader: &'r StoreReader,
    pub(super) slot: SlotPtr,
    pub(super) handle: ObjectHandle,
    pub(super) data: *const u8,
    pub(super) len: usize,
    pub(super) kind: ObjectKind,
}

impl ReadGuard<'_> {
    /// The handle this guard reads.
    pub fn handle(&self) -> ObjectHandle {
        self.handle
    }

    /// What the object is (raw bytes, a tensor, an item).
    pub fn kind(&self) -> ObjectKind {
        self.kind
    }
}

impl Deref for ReadGuard<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `data..data+len` was bounds-checked against the data region
        // at get (in the read-write mapping; a read-only views mapping spans
        // the same segment at the same offsets); the reader's hold on the slot keeps the writer from
        // reusing it until the guard drops, and a published object's
        // bytes are never written again, so nobody writes them meanwhile.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }
}

impl AsRef<[u8]> for ReadGuard<'_> {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl Drop for ReadGuard<'_> {
    fn drop(&mut self) {
        self.reader.ack_held(&self.slot, self.handle);
        self.reader.release_hold(&self.slot);
    }
}
