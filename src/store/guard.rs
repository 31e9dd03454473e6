//! [`ReadGuard`]: a zero-copy view of one object, holding its slot.

use std::ops::Deref;

use super::attached::Attached;
use super::handle::ObjectHandle;
use super::share::Share;
use crate::atomics::SlotPtr;
use crate::error::Result;
use crate::layout::ObjectKind;
use crate::sys::private::CowMap;

/// A zero-copy view of an object in the ring. Dropping it acknowledges the
/// read; while it lives the slot cannot be reused. Guards are not limited
/// in number, and the writer allocates around the objects they hold.
///
/// A guard owns what it reads through: a share of its reader's attachment
/// (the mapping, the reader's entry and liveness lock). It may outlive the
/// [`StoreReader`](crate::StoreReader) that made it, and be sent to or
/// shared with other threads; the reader leaves the table only when the
/// reader and its last guard are gone:
///
/// ```
/// use pinshm::{ObjectStore, StoreConfig, StoreReader};
/// # let name = format!("pinshm-doc-guard-outlives-{}", std::process::id());
/// let mut store = ObjectStore::create(StoreConfig::new(1 << 20, 1 << 16, 1).name(&name)).unwrap();
/// let h = store.put("k", b"v").unwrap();
/// let guard = {
///     let reader = StoreReader::attach(&store.handle()).unwrap();
///     reader.get(h).unwrap()
/// };
/// assert_eq!(&*guard, b"v");
/// ```
///
/// A guard leaked with `mem::forget` keeps its reader attached (entry, lock,
/// mapping) until the process exits: the writer never reuses its slot, and
/// allocates around it.
///
/// Across `fork`: the guard is the parent's. In the child every segment
/// mapping is made inaccessible at the fork (see `crate::sys::fork`), so
/// reading an inherited guard's bytes faults (SIGSEGV) instead of returning
/// bytes that the parent's release let the writer replace; dropping it in
/// the child releases nothing.
#[derive(Debug)]
pub struct ReadGuard {
    pub(super) reader: Share<Attached>,
    pub(super) slot: SlotPtr,
    pub(super) handle: ObjectHandle,
    pub(super) data: *const u8,
    pub(super) len: usize,
    pub(super) kind: ObjectKind,
}

// SAFETY: `slot` and `data` point into the mapping that `reader` keeps
// alive; through them a guard only reads payload bytes that nobody writes
// while it holds the slot, and its drop writes only atomics (acknowledge,
// unhold: read-modify-writes, so guards of one reader dropped on several
// threads at once lose no update). `Attached` is `Send + Sync`.
unsafe impl Send for ReadGuard {}
// SAFETY: through `&ReadGuard` only the read-only payload and plain values
// are read.
unsafe impl Sync for ReadGuard {}

impl ReadGuard {
    /// The handle this guard reads.
    pub fn handle(&self) -> ObjectHandle {
        self.handle
    }

    /// What the object is (raw bytes, a tensor, an item).
    pub fn kind(&self) -> ObjectKind {
        self.kind
    }

    /// The object as a [`PrivateView`]: the same bytes, writable, and
    /// private to this process (copy-on-write), still held by this guard.
    /// Costs a mapping of the object's pages, no copy of its bytes.
    /// `Error::Forked` for a guard inherited across `fork` (its hold is the
    /// parent's: the slot may be reused under the child).
    pub fn into_private(self) -> Result<PrivateView> {
        self.reader.check_owner()?;
        let map = &self.reader.map;
        let cow = map.seg().map_cow(map.offset_of(self.data), self.len)?;
        Ok(PrivateView { cow, guard: self })
    }
}

/// An object's bytes as this process's own writable copy that costs no copy
/// until written: a private copy-on-write mapping of the object's pages,
/// which reads the slot until a page is written, and copies only the pages
/// written, into memory no other process sees. What is written here never
/// reaches the slot, nor any other reader, nor another view of the object
/// in this process. The view holds the slot (a [`ReadGuard`] inside it) for
/// as long as it lives, so the pages it has not written never change, and
/// the read is acknowledged when it drops.
///
/// ```
/// use pinshm::{ObjectStore, StoreConfig, StoreReader};
/// # let name = format!("pinshm-doc-private-{}", std::process::id());
/// let mut store = ObjectStore::create(StoreConfig::new(1 << 20, 1 << 16, 1).name(&name)).unwrap();
/// let h = store.put("k", b"shared").unwrap();
/// let reader = StoreReader::attach(&store.handle()).unwrap();
/// let mut mine = reader.get_private(h).unwrap();
/// mine[..4].copy_from_slice(b"MINE");
/// assert_eq!(&*mine, b"MINEed");
/// assert_eq!(&*reader.get(h).unwrap(), b"shared");
/// ```
///
/// Across `fork` it is the parent's, as a guard is: in the child its pages
/// are inaccessible (reading them faults).
#[derive(Debug)]
pub struct PrivateView {
    /// Unmapped before the guard lets the slot go (fields drop in order).
    cow: CowMap,
    guard: ReadGuard,
}

impl PrivateView {
    /// The handle this view reads.
    pub fn handle(&self) -> ObjectHandle {
        self.guard.handle
    }

    /// What the object is (raw bytes, a tensor, an item).
    pub fn kind(&self) -> ObjectKind {
        self.guard.kind
    }

    /// The first byte: `len()` bytes there are this view's to read and
    /// write while it lives (for a foreign owner of the memory, such as a
    /// Python buffer export). Accesses through it must not overlap a
    /// borrow from `Deref` or `DerefMut`: whoever takes the pointer
    /// orders its own reads and writes, and makes no reference meanwhile.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.cow.as_mut_ptr()
    }
}

impl Deref for PrivateView {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `cow` maps exactly `len` bytes (checked inside the
        // segment when mapped) for as long as it lives; its pages are this
        // process's (a write goes to a private copy), and what it has not
        // written is the held slot's, which no other process writes
        // meanwhile. Within this process only `DerefMut` (which `&self`
        // excludes) and users of `as_mut_ptr` (who promise not to overlap
        // a borrow) write them.
        unsafe { std::slice::from_raw_parts(self.cow.as_mut_ptr(), self.cow.len()) }
    }
}

impl std::ops::DerefMut for PrivateView {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `deref`; `&mut self` makes this the only reference into
        // the mapping, which is private and writable (a write copies the
        // page it lands on, for this mapping only).
        unsafe { std::slice::from_raw_parts_mut(self.cow.as_mut_ptr(), self.cow.len()) }
    }
}

impl Deref for ReadGuard {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `data..data+len` was bounds-checked against the data region
        // at get (in the read-write mapping; a read-only views mapping spans
        // the same segment at the same offsets), and `reader` keeps the
        // mapping alive; the reader's hold on the slot keeps the writer from
        // reusing it until the guard drops, and a published object's
        // bytes are never written again, so nobody writes them meanwhile.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }
}

impl AsRef<[u8]> for ReadGuard {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl Drop for ReadGuard {
    #[inline(always)]
    fn drop(&mut self) {
        self.reader.drop_guard(&self.slot, self.handle);
    }
}
