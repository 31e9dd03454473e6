//! Layer 4: what an object is. Raw bytes; tensors (dtype, shape, aligned
//! payload, read in place as a [`TensorView`]); multi-field items (named
//! tensors plus string metadata, like a multimodal item) in one slot.
//!
//! ## Object layouts (codec version 1), offsets from the payload start
//!
//! Tensor (slot kind [`KIND_TENSOR`]):
//! ```text
//! 0    TensorHeader (128 B): magic "PTNS", version, dtype, ndim, shape[8]
//! 128  payload: product(shape) × dtype size bytes, row-major
//! ```
//! Item (slot kind [`KIND_ITEM`]):
//! ```text
//! 0    ItemPrefix (16 B): magic "PITM", version, header_len
//! 16   header: MessagePack of ItemHeader { meta, fields: [{name, dtype, shape, offset, len}] }
//! ...  payloads, each at a 64-byte aligned offset
//! ```
//! The item header is MessagePack (rmp-serde, named fields) so Python can read
//! it with `msgpack.unpackb`. Everything read back is validated against the
//! object's length before a view is formed: a corrupt header is an error.

use std::borrow::Cow;

use bytemuck::{Pod, Zeroable};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::layout::{round_up, SLOT_ALIGN};
use crate::store::{ObjectHandle, ObjectStore, ReadGuard, StoreReader};

/// Slot kind of raw bytes.
pub const KIND_RAW: u32 = 0;
/// Slot kind of a tensor.
pub const KIND_TENSOR: u32 = 1;
/// Slot kind of an item.
pub const KIND_ITEM: u32 = 2;
/// Bumped on every change to the tensor or item layout.
pub const CODEC_VERSION: u16 = 1;
/// Most dimensions a tensor may have.
pub const MAX_DIMS: usize = 8;

const TENSOR_MAGIC: u32 = u32::from_le_bytes(*b"PTNS");
const ITEM_MAGIC: u32 = u32::from_le_bytes(*b"PITM");
/// Bytes before a tensor's payload.
pub const TENSOR_HEADER_LEN: usize = 128;
const ITEM_PREFIX_LEN: usize = 16;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
#[allow(missing_docs)]
pub enum DType {
    U8 = 0,
    I8 = 1,
    I16 = 2,
    U16 = 3,
    I32 = 4,
    U32 = 5,
    I64 = 6,
    U64 = 7,
    F16 = 8,
    BF16 = 9,
    F32 = 10,
    F64 = 11,
    Bool = 12,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 | DType::Bool => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    /// Every dtype.
    pub const ALL: [DType; 13] = [
        DType::U8,
        DType::I8,
        DType::I16,
        DType::U16,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::Bool,
    ];

    /// The dtype with this code, if any.
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(code as usize).copied()
    }
}

/// A Rust element type a tensor payload can be viewed as.
pub trait Element: Pod {
    /// The dtype it matches.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => { $(impl Element for $t { const DTYPE: DType = DType::$d; })* };
}
element!(u8 => U8, i8 => I8, i16 => I16, u16 => U16, i32 => I32, u32 => U32, i64 => I64,
    u64 => U64, half::f16 => F16, half::bf16 => BF16, f32 => F32, f64 => F64);

/// Payload bytes of a tensor of `dtype` and `shape`, or an error on overflow.
pub fn payload_len(dtype: DType, shape: &[u64]) -> Result<usize> {
    if shape.len() > MAX_DIMS {
        return Err(Error::InvalidTensor(format!(
            "{} dimensions; at most {MAX_DIMS}",
            shape.len()
        )));
    }
    shape
        .iter()
        .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d))
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| Error::InvalidTensor(format!("shape {shape:?} overflows")))
}

/// A tensor to put: dtype, shape, contiguous row-major bytes.
#[derive(Clone, Debug)]
pub struct TensorRef<'a> {
    dtype: DType,
    shape: Cow<'a, [u64]>,
    data: &'a [u8],
}

impl<'a> TensorRef<'a> {
    /// A tensor over `data`, whose length must be `product(shape) × dtype.size()`.
    pub fn new(dtype: DType, shape: impl Into<Cow<'a, [u64]>>, data: &'a [u8]) -> Result<Self> {
        let shape = shape.into();
        let want = payload_len(dtype, &shape)?;
        if want != data.len() {
            return Err(Error::InvalidTensor(format!(
                "shape {shape:?} of {dtype:?} needs {want} bytes, got {}",
                data.len()
            )));
        }
        Ok(TensorRef { dtype, shape, data })
    }

    /// A tensor over a typed slice.
    pub fn from_slice<T: Element>(data: &'a [T], shape: impl Into<Cow<'a, [u64]>>) -> Result<Self> {
        Self::new(T::DTYPE, shape, bytemuck::cast_slice(data))
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Shape.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// Payload bytes.
    pub fn data(&self) -> &[u8] {
        self.data
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
struct TensorHeader {
    magic: u32,
    version: u16,
    dtype: u8,
    ndim: u8,
    reserved: [u32; 2],
    payload_len: u64,
    shape: [u64; MAX_DIMS],
    reserved2: [u64; 5],
}

/// A zero-copy view of a tensor in a slot. From [`StoreReader::get_tensor`]
/// it holds the object's read: dropping it acknowledges the read.
#[derive(Debug)]
pub struct TensorView<'a> {
    dtype: DType,
    ndim: usize,
    shape: [u64; MAX_DIMS],
    data: &'a [u8],
    _guard: Option<ReadGuard<'a>>,
}

impl<'a> TensorView<'a> {
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Shape (empty for a 0-d tensor).
    pub fn shape(&self) -> &[u64] {
        &self.shape[..self.ndim]
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len() / self.dtype.size()
    }

    /// Payload bytes, in place.
    pub fn bytes(&self) -> &[u8] {
        self.data
    }

    /// The payload as `&[T]`, in place. Errors (never panics) when `T` does
    /// not match the dtype or the payload is not aligned for `T`.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        if T::DTYPE != self.dtype {
            return Err(Error::DTypeMismatch {
                expected: self.dtype,
                requested: T::DTYPE,
            });
        }
        bytemuck::try_cast_slice(self.data).map_err(|e| {
            Error::InvalidTensor(format!("cannot view payload as {:?}: {e}", T::DTYPE))
        })
    }

    /// Bool tensors as bytes that are each 0 or 1 (checked).
    pub fn as_bools(&self) -> Result<&[bool]> {
        if self.dtype != DType::Bool {
            return Err(Error::DTypeMismatch {
                expected: self.dtype,
                requested: DType::Bool,
            });
        }
        if self.data.iter().any(|&b| b > 1) {
            return Err(Error::InvalidTensor(
                "bool tensor holds a byte other than 0 or 1".into(),
            ));
        }
        // SAFETY: every byte is 0 or 1, the two valid bit patterns of bool,
        // which has size and alignment 1.
        Ok(unsafe {
            std::slice::from_raw_parts(self.data.as_ptr() as *const bool, self.data.len())
        })
    }

    pub(crate) fn parse(object: &'a [u8]) -> Result<TensorView<'a>> {
        let corrupt = |m: &str| Error::CorruptObject(format!("tensor: {m}"));
        let head = object
            .get(..size_of::<TensorHeader>())
            .ok_or_else(|| corrupt("shorter than its header"))?;
        let h: TensorHeader = bytemuck::pod_read_unaligned(head);
        if h.magic != TENSOR_MAGIC {
            return Err(corrupt("bad magic"));
        }
        if h.version != CODEC_VERSION {
            return Err(corrupt(&format!(
                "codec version {} (this build reads {CODEC_VERSION})",
                h.version
            )));
        }
        let dtype = DType::from_code(h.dtype)
            .ok_or_else(|| corrupt(&format!("unknown dtype code {}", h.dtype)))?;
        let ndim = h.ndim as usize;
        if ndim > MAX_DIMS {
            return Err(corrupt(&format!("{ndim} dimensions")));
        }
        let len = payload_len(dtype, &h.shape[..ndim]).map_err(|_| corrupt("shape overflows"))?;
        if len as u64 != h.payload_len {
            return Err(corrupt("payload length does not match shape"));
        }
        let data = object
            .get(TENSOR_HEADER_LEN..)
            .and_then(|p| p.get(..len))
            .ok_or_else(|| corrupt("payload runs past the object"))?;
        Ok(TensorView {
            dtype,
            ndim,
            shape: h.shape,
            data,
            _guard: None,
        })
    }
}

pub(crate) fn write_tensor_header(out: &mut [u8], dtype: DType, shape: &[u64], len: usize) {
    let mut h = TensorHeader::zeroed();
    h.magic = TENSOR_MAGIC;
    h.version = CODEC_VERSION;
    h.dtype = dtype as u8;
    h.ndim = shape.len() as u8;
    h.payload_len = len as u64;
    h.shape[..shape.len()].copy_from_slice(shape);
    out[..size_of::<TensorHeader>()].copy_from_slice(bytemuck::bytes_of(&h));
}

/// One field of an item, as stored in its header.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldSpec {
    /// Field name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// Payload offset from the object start (64-byte aligned).
    #[serde(default)]
    pub offset: u64,
    /// Payload bytes.
    #[serde(default)]
    pub len: u64,
}

/// The serde-encoded header of an item.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ItemHeader {
    /// String metadata (modality, hash, ...), in order.
    pub meta: Vec<(String, String)>,
    /// Fields, in order.
    pub fields: Vec<FieldSpec>,
}

/// An item to put: ordered named tensors plus string metadata.
#[derive(Clone, Debug, Default)]
pub struct Item<'a> {
    meta: Vec<(String, String)>,
    fields: Vec<(String, TensorRef<'a>)>,
}

impl<'a> Item<'a> {
    /// An empty item.
    pub fn new() -> Self {
        Item::default()
    }

    /// Adds a metadata entry.
    pub fn meta(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.meta.push((key.into(), value.into()));
        self
    }

    /// Adds a field.
    pub fn field(mut self, name: impl Into<String>, t: TensorRef<'a>) -> Self {
        self.fields.push((name.into(), t));
        self
    }

    fn layout(&self) -> Result<ItemLayout> {
        let mut l = ItemLayout::new();
        for (k, v) in &self.meta {
            l = l.meta(k.clone(), v.clone());
        }
        for (name, t) in &self.fields {
            l = l.field(name.clone(), t.dtype, t.shape.to_vec());
        }
        l.finish()
    }
}

/// The shape of an item to be written in place: names, dtypes and shapes,
/// with payload offsets computed by [`ItemLayout::finish`].
#[derive(Clone, Debug, Default)]
pub struct ItemLayout {
    header: ItemHeader,
    encoded: Vec<u8>,
    total: usize,
}

impl ItemLayout {
    /// An empty layout.
    pub fn new() -> Self {
        ItemLayout::default()
    }

    /// Adds a metadata entry.
    pub fn meta(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.header.meta.push((key.into(), value.into()));
        self
    }

    /// Adds a field of `dtype` and `shape`.
    pub fn field(mut self, name: impl Into<String>, dtype: DType, shape: Vec<u64>) -> Self {
        self.header.fields.push(FieldSpec {
            name: name.into(),
            dtype,
            shape,
            offset: 0,
            len: 0,
        });
        self
    }

    /// Computes offsets and encodes the header. The header's size depends on
    /// the offsets it holds, so this iterates until both agree.
    pub fn finish(mut self) -> Result<Self> {
        for f in &self.header.fields {
            if self
                .header
                .fields
                .iter()
                .filter(|g| g.name == f.name)
                .count()
                > 1
            {
                return Err(Error::InvalidTensor(format!(
                    "field '{}' appears twice",
                    f.name
                )));
            }
        }
        let lens: Vec<usize> = self
            .header
            .fields
            .iter()
            .map(|f| payload_len(f.dtype, &f.shape))
            .collect::<Result<_>>()?;
        let mut header_guess = 0;
        loop {
            let mut at = round_up(ITEM_PREFIX_LEN + header_guess, SLOT_ALIGN);
            for (f, &len) in self.header.fields.iter_mut().zip(&lens) {
                f.offset = at as u64;
                f.len = len as u64;
                at = at
                    .checked_add(round_up(len, SLOT_ALIGN))
                    .ok_or_else(|| Error::InvalidTensor("item size overflows".into()))?;
            }
            let encoded = rmp_serde::to_vec_named(&self.header)
                .map_err(|e| Error::InvalidTensor(format!("cannot encode item header: {e}")))?;
            // Offsets were laid out assuming a header of `header_guess` bytes.
            if round_up(ITEM_PREFIX_LEN + encoded.len(), SLOT_ALIGN)
                <= round_up(ITEM_PREFIX_LEN + header_guess, SLOT_ALIGN)
            {
                self.total = at;
                self.encoded = encoded;
                return Ok(self);
            }
            header_guess = encoded.len();
        }
    }

    /// Object bytes the item takes.
    pub fn len(&self) -> usize {
        self.total
    }

    /// Whether the layout has no fields and no metadata.
    pub fn is_empty(&self) -> bool {
        self.header.fields.is_empty() && self.header.meta.is_empty()
    }

    /// The header that will be stored.
    pub fn header(&self) -> &ItemHeader {
        &self.header
    }

    pub(crate) fn write_header(&self, out: &mut [u8]) {
        out[0..4].copy_from_slice(&ITEM_MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&CODEC_VERSION.to_le_bytes());
        out[6..8].fill(0);
        out[8..12].copy_from_slice(&(self.encoded.len() as u32).to_le_bytes());
        out[12..16].fill(0);
        out[ITEM_PREFIX_LEN..ITEM_PREFIX_LEN + self.encoded.len()].copy_from_slice(&self.encoded);
    }
}

/// The fields of an item being written in place.
#[derive(Debug)]
pub struct ItemSlots<'a> {
    layout: &'a ItemLayout,
    object: &'a mut [u8],
}

impl ItemSlots<'_> {
    /// Number of fields.
    pub fn len(&self) -> usize {
        self.layout.header.fields.len()
    }

    /// Whether there are no fields.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Field `i`'s payload, to fill.
    pub fn field_mut(&mut self, i: usize) -> &mut [u8] {
        let f = &self.layout.header.fields[i];
        &mut self.object[f.offset as usize..(f.offset + f.len) as usize]
    }

    /// A field's payload by name.
    pub fn by_name(&mut self, name: &str) -> Option<&mut [u8]> {
        let i = self
            .layout
            .header
            .fields
            .iter()
            .position(|f| f.name == name)?;
        Some(self.field_mut(i))
    }

    /// Every field's payload at once (they do not overlap), in field order.
    pub fn all_mut(&mut self) -> Vec<&mut [u8]> {
        let mut out = Vec::with_capacity(self.len());
        let mut rest: &mut [u8] = self.object;
        let mut consumed = 0usize;
        for f in &self.layout.header.fields {
            let tail = std::mem::take(&mut rest);
            let (_, from_field) = tail.split_at_mut(f.offset as usize - consumed);
            let (field, after) = from_field.split_at_mut(f.len as usize);
            consumed = (f.offset + f.len) as usize;
            out.push(field);
            rest = after;
        }
        out
    }
}

/// A zero-copy view of an item: its header decoded, each field a
/// [`TensorView`] over the slot. Dropping it acknowledges the read.
#[derive(Debug)]
pub struct ItemView<'r> {
    header: ItemHeader,
    guard: ReadGuard<'r>,
}

impl ItemView<'_> {
    /// The decoded header.
    pub fn header(&self) -> &ItemHeader {
        &self.header
    }

    /// A metadata value.
    pub fn meta(&self, key: &str) -> Option<&str> {
        self.header
            .meta
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Field names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.header.fields.iter().map(|f| f.name.as_str())
    }

    /// A field by name, in place.
    pub fn field(&self, name: &str) -> Result<TensorView<'_>> {
        let f = self
            .header
            .fields
            .iter()
            .find(|f| f.name == name)
            .ok_or_else(|| Error::NoSuchField {
                name: name.to_owned(),
            })?;
        let mut shape = [0u64; MAX_DIMS];
        shape[..f.shape.len()].copy_from_slice(&f.shape);
        Ok(TensorView {
            dtype: f.dtype,
            ndim: f.shape.len(),
            shape,
            // Checked in `parse_item`.
            data: &self.guard[f.offset as usize..(f.offset + f.len) as usize],
            _guard: None,
        })
    }

    /// The handle this view reads.
    pub fn handle(&self) -> ObjectHandle {
        self.guard.handle()
    }
}

fn parse_item(object: &[u8]) -> Result<ItemHeader> {
    let corrupt = |m: String| Error::CorruptObject(format!("item: {m}"));
    let prefix = object
        .get(..ITEM_PREFIX_LEN)
        .ok_or_else(|| corrupt("shorter than its prefix".into()))?;
    if prefix[0..4] != ITEM_MAGIC.to_le_bytes() {
        return Err(corrupt("bad magic".into()));
    }
    let version = u16::from_le_bytes([prefix[4], prefix[5]]);
    if version != CODEC_VERSION {
        return Err(corrupt(format!(
            "codec version {version} (this build reads {CODEC_VERSION})"
        )));
    }
    let hlen = u32::from_le_bytes(prefix[8..12].try_into().expect("4 bytes")) as usize;
    let encoded = object
        .get(ITEM_PREFIX_LEN..)
        .and_then(|r| r.get(..hlen))
        .ok_or_else(|| corrupt(format!("header of {hlen} bytes runs past the object")))?;
    let header: ItemHeader = rmp_serde::from_slice(encoded)
        .map_err(|e| corrupt(format!("header does not decode: {e}")))?;
    let data_start = (ITEM_PREFIX_LEN + hlen) as u64;
    for f in &header.fields {
        let len = payload_len(f.dtype, &f.shape)
            .map_err(|e| corrupt(format!("field '{}': {e}", f.name)))?;
        let end = f.offset.checked_add(f.len);
        if len as u64 != f.len
            || f.offset % SLOT_ALIGN as u64 != 0
            || f.offset < data_start
            || end.is_none_or(|e| e > object.len() as u64)
        {
            return Err(corrupt(format!(
                "field '{}' (offset {}, {} bytes, shape {:?}) does not fit the object of {} bytes",
                f.name,
                f.offset,
                f.len,
                f.shape,
                object.len()
            )));
        }
    }
    Ok(header)
}

fn wrong_kind(found: u32, want: u32) -> Error {
    Error::WrongKind {
        expected: want,
        found,
    }
}

impl ObjectStore {
    /// Stores a tensor: a 128-byte header, then the payload, 64-byte aligned.
    pub fn put_tensor(&mut self, key: &str, t: &TensorRef<'_>) -> Result<ObjectHandle> {
        self.put_tensor_with(key, t.dtype, t.shape(), |p| p.copy_from_slice(t.data))
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
        self.put_kind(key, total, KIND_TENSOR, |obj| {
            write_tensor_header(obj, dtype, shape, len);
            fill(&mut obj[TENSOR_HEADER_LEN..]);
        })
    }

    /// Stores an item as one object (one slot, one handle, one flag).
    pub fn put_item(&mut self, key: &str, item: &Item<'_>) -> Result<ObjectHandle> {
        let layout = item.layout()?;
        self.put_item_with(key, &layout, |slots| {
            for (dst, (_, t)) in slots.all_mut().into_iter().zip(&item.fields) {
                dst.copy_from_slice(t.data);
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
        if layout.total == 0 {
            return Err(Error::InvalidTensor(
                "item layout not finished: call ItemLayout::finish".into(),
            ));
        }
        self.put_kind(key, layout.total, KIND_ITEM, |obj| {
            layout.write_header(obj);
            fill(&mut ItemSlots {
                layout,
                object: obj,
            });
        })
    }
}

impl StoreReader {
    /// A tensor, in place. The read is acknowledged when the view drops.
    pub fn get_tensor(&self, h: ObjectHandle) -> Result<TensorView<'_>> {
        let guard = self.get(h)?;
        if guard.kind() != KIND_TENSOR {
            return Err(wrong_kind(guard.kind(), KIND_TENSOR));
        }
        let (ptr, len) = (guard.as_ptr(), guard.len());
        // SAFETY: the bytes are the guard's, which moves into the view and
        // keeps the slot alive (and unwritten) as long as the view lives;
        // moving the guard does not move the bytes, which live in the mapping.
        let object: &[u8] = unsafe { std::slice::from_raw_parts(ptr, len) };
        let mut view = TensorView::parse(object)?;
        view._guard = Some(guard);
        Ok(view)
    }

    /// An item, in place: header decoded, fields viewed without copying.
    pub fn get_item(&self, h: ObjectHandle) -> Result<ItemView<'_>> {
        let guard = self.get(h)?;
        if guard.kind() != KIND_ITEM {
            return Err(wrong_kind(guard.kind(), KIND_ITEM));
        }
        let header = parse_item(&guard)?;
        Ok(ItemView { header, guard })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn tensor_header_layout_is_pinned() {
        assert_eq!(size_of::<TensorHeader>(), TENSOR_HEADER_LEN);
        assert_eq!(offset_of!(TensorHeader, magic), 0);
        assert_eq!(offset_of!(TensorHeader, version), 4);
        assert_eq!(offset_of!(TensorHeader, dtype), 6);
        assert_eq!(offset_of!(TensorHeader, ndim), 7);
        assert_eq!(offset_of!(TensorHeader, payload_len), 16);
        assert_eq!(offset_of!(TensorHeader, shape), 24);
        assert_eq!(CODEC_VERSION, 1);
        assert_eq!(ITEM_PREFIX_LEN, 16);
        for (i, d) in DType::ALL.iter().enumerate() {
            assert_eq!(*d as u8 as usize, i, "dtype codes are stable");
        }
    }

    #[test]
    fn item_layout_offsets_are_aligned_and_after_the_header() {
        let l = ItemLayout::new()
            .meta("modality", "image")
            .field("a", DType::F32, vec![3, 5])
            .field("b", DType::U8, vec![1])
            .field("c", DType::I64, vec![0])
            .finish()
            .unwrap();
        let mut prev_end = (ITEM_PREFIX_LEN + l.encoded.len()) as u64;
        for f in &l.header.fields {
            assert_eq!(f.offset % 64, 0);
            assert!(f.offset >= prev_end);
            prev_end = f.offset + f.len;
        }
        assert!(l.len() as u64 >= prev_end);
        let mut buf = vec![0u8; l.len()];
        l.write_header(&mut buf);
        assert_eq!(parse_item(&buf).unwrap(), l.header);
    }

    #[test]
    fn duplicate_field_names_are_rejected() {
        let e = ItemLayout::new()
            .field("a", DType::U8, vec![1])
            .field("a", DType::U8, vec![1])
            .finish()
            .unwrap_err();
        assert!(e.to_string().contains("twice"));
    }
}
