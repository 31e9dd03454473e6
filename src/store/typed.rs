//! Tensor and item puts and gets: the store joined to the codec. Every put
//! here is a thin layer over the writer's one reserve → fill → publish path;
//! every typed read is a view parsed from a [`ReadGuard`].

use super::guard::ReadGuard;
use super::handle::ObjectHandle;
use super::reader::StoreReader;
use super::writer::ObjectStore;
use crate::codec::{
    payload_len, write_tensor_header, FieldRef, Item, ItemHeader, ItemLayout, ItemSlots, ItemView,
    TensorRef, TensorView, TENSOR_HEADER_LEN,
};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::layout::ObjectKind;

impl ObjectStore {
    /// Stores a tensor: a 128-byte header, then the payload, 64-byte aligned.
    pub fn put_tensor(&mut self, key: &str, t: &TensorRef<'_>) -> Result<ObjectHandle> {
        self.put_tensor_with(key, t.dtype(), t.shape(), |p| p.copy_from_slice(t.data()))
    }

    /// Stores a tensor whose payload `fill` writes in place (a device→host
    /// copy, say).
    pub fn put_tensor_with<F: FnOnce(&mut [u8])>(
        &mut self,
        key: &str,
        dtype: DType,
        shape: &[u64],
        fill: F,
    ) -> Result<ObjectHandle> {
        let len = payload_len(dtype, shape)?;
        let total = len
            .checked_add(TENSOR_HEADER_LEN)
            .ok_or_else(|| Error::InvalidTensor("tensor size overflows".into()))?;
        self.put_kind(key, total, ObjectKind::Tensor, |obj| {
            write_tensor_header(obj, dtype, shape, len);
            fill(&mut obj[TENSOR_HEADER_LEN..]);
        })
    }

    /// Stores an item as one object (one slot, one handle, one flag).
    pub fn put_item(&mut self, key: &str, item: &Item<'_>) -> Result<ObjectHandle> {
        let layout = item.layout()?;
        self.put_item_with(key, &layout, |slots| {
            for (dst, t) in slots.all_mut().into_iter().zip(item.tensors()) {
                dst.copy_from_slice(t.data());
            }
        })
    }

    /// Stores an item whose field payloads `fill` writes in place.
    pub fn put_item_with<F: FnOnce(&mut ItemSlots<'_>)>(
        &mut self,
        key: &str,
        layout: &ItemLayout,
        fill: F,
    ) -> Result<ObjectHandle> {
        self.put_kind(key, layout.len(), ObjectKind::Item, |obj| {
            layout.write_header(obj);
            fill(&mut ItemSlots::new(layout, obj));
        })
    }
}

impl ReadGuard {
    /// The object as a tensor, in place (borrowing this guard).
    pub fn tensor(&self) -> Result<TensorView<'_>> {
        self.expect_kind(ObjectKind::Tensor)?;
        TensorView::parse(self)
    }

    /// The object as an item, in place (borrowing this guard).
    pub fn item(&self) -> Result<ItemView<'_>> {
        self.expect_kind(ObjectKind::Item)?;
        ItemView::parse(self)
    }

    fn expect_kind(&self, expected: ObjectKind) -> Result<()> {
        if self.kind() != expected {
            return Err(Error::WrongKind {
                expected,
                found: self.kind(),
            });
        }
        Ok(())
    }

    /// The object's bytes, unbound from the borrow of the guard.
    ///
    /// # Safety
    /// The slice must not be used after this guard is dropped (store it
    /// beside the guard, in a struct that drops both together and lends it
    /// out only for borrows of itself).
    unsafe fn bytes_for_guard_life(&self) -> &'static [u8] {
        // SAFETY: the bytes live in the mapping, not in the guard, so moving
        // the guard does not move them; they stay valid and unwritten while
        // the guard lives (the guard is one count in its reader's hold word
        // of the slot, and the writer reuses no slot with a live hold),
        // which the caller promises outlasts every use of the slice.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len()) }
    }
}

/// A tensor in place that owns its read: [`TensorView`]'s accessors, and
/// dropping it acknowledges the read. From [`StoreReader::get_tensor`].
///
/// Not `Deref<Target = TensorView>`: a `TensorView` is `Copy`, and a copy
/// of the stored one would outlive the guard. Here every
/// view borrows the guard:
///
/// ```compile_fail
/// # use pinshm::{StoreReader, store::ObjectHandle};
/// # fn f(reader: &StoreReader, h: ObjectHandle) -> pinshm::Result<()> {
/// let view = reader.get_tensor(h)?.view(); // guard dropped here
/// println!("{:?}", view.bytes());
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct TensorGuard {
    /// Over the guard's bytes: lent out only as `TensorView<'_>` of a
    /// borrow of `self`, never as stored.
    view: TensorView<'static>,
    guard: ReadGuard,
}

impl TensorGuard {
    /// The handle this view reads.
    pub fn handle(&self) -> ObjectHandle {
        self.guard.handle()
    }

    /// The view, borrowing this guard.
    pub fn view(&self) -> TensorView<'_> {
        self.view
    }

    /// Element type: [`TensorView::dtype`].
    pub fn dtype(&self) -> DType {
        self.view.dtype()
    }

    /// Shape: [`TensorView::shape`].
    pub fn shape(&self) -> &[u64] {
        self.view.shape()
    }

    /// Number of elements: [`TensorView::numel`].
    pub fn numel(&self) -> usize {
        self.view.numel()
    }

    /// Payload bytes, in place: [`TensorView::bytes`].
    pub fn bytes(&self) -> &[u8] {
        self.view().bytes()
    }

    /// The payload as `&[T]`, in place: [`TensorView::as_slice`].
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        self.view().as_slice()
    }

    /// Bool tensors: [`TensorView::as_bools`].
    pub fn as_bools(&self) -> Result<&[bool]> {
        self.view().as_bools()
    }
}

/// An item in place that owns its read: [`ItemView`]'s accessors, and
/// dropping it acknowledges the read. From [`StoreReader::get_item`].
///
/// Not `Deref<Target = ItemView>`: the stored view's names, metadata and
/// fields would outlive the guard and read a slot the writer may reuse. Here they borrow the
/// guard:
///
/// ```compile_fail
/// # use pinshm::{StoreReader, store::ObjectHandle};
/// # fn f(reader: &StoreReader, h: ObjectHandle) -> pinshm::Result<()> {
/// let modality = reader.get_item(h)?.meta("modality"); // guard dropped here
/// println!("{modality:?}");
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct ItemGuard {
    /// Over the guard's bytes: lent out only as `ItemView<'_>` of a borrow
    /// of `self`, never as stored.
    view: ItemView<'static>,
    guard: ReadGuard,
}

impl ItemGuard {
    /// The handle this view reads.
    pub fn handle(&self) -> ObjectHandle {
        self.guard.handle()
    }

    /// The view, borrowing this guard.
    pub fn view(&self) -> ItemView<'_> {
        self.view
    }

    /// A metadata value: [`ItemView::meta`].
    pub fn meta(&self, key: &str) -> Option<&str> {
        self.view().meta(key)
    }

    /// Metadata entries, in order: [`ItemView::meta_entries`].
    pub fn meta_entries(&self) -> impl ExactSizeIterator<Item = (&str, &str)> {
        self.view().meta_entries()
    }

    /// Field names, in order: [`ItemView::names`].
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.view().names()
    }

    /// The fields, in order: [`ItemView::fields`].
    pub fn fields(&self) -> impl ExactSizeIterator<Item = FieldRef<'_>> {
        self.view().fields()
    }

    /// A field by name, in place: [`ItemView::field`].
    pub fn field(&self, name: &str) -> Result<TensorView<'_>> {
        self.view().field(name)
    }

    /// An owned copy of the header: [`ItemView::to_header`].
    pub fn to_header(&self) -> ItemHeader {
        self.view.to_header()
    }
}

impl StoreReader {
    /// A tensor, in place: `get(h)` then [`ReadGuard::tensor`], owning the
    /// read. The read is acknowledged when the view drops.
    pub fn get_tensor(&self, h: ObjectHandle) -> Result<TensorGuard> {
        let guard = self.get(h)?;
        guard.expect_kind(ObjectKind::Tensor)?;
        // SAFETY: the view is stored beside its guard and dropped with it.
        let view = TensorView::parse(unsafe { guard.bytes_for_guard_life() })?;
        Ok(TensorGuard { view, guard })
    }

    /// An item, in place: `get(h)` then [`ReadGuard::item`], owning the read.
    pub fn get_item(&self, h: ObjectHandle) -> Result<ItemGuard> {
        let guard = self.get(h)?;
        guard.expect_kind(ObjectKind::Item)?;
        // SAFETY: the view is stored beside its guard and dropped with it.
        let view = ItemView::parse(unsafe { guard.bytes_for_guard_life() })?;
        Ok(ItemGuard { view, guard })
    }
}
