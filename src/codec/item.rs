//! Items: named tensors plus string metadata in one object.

use serde::{Deserialize, Serialize};

use super::tensor::{payload_len, TensorRef};
use super::{CODEC_VERSION, ITEM_MAGIC, ITEM_PREFIX_LEN};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::{round_up, SLOT_ALIGN};

/// One field of an item, as stored in its header.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
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
#[non_exhaustive]
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

    /// The fields' tensors, in order.
    pub(crate) fn tensors(&self) -> impl Iterator<Item = &TensorRef<'a>> {
        self.fields.iter().map(|(_, t)| t)
    }

    /// Lays the item out.
    pub(crate) fn layout(&self) -> Result<ItemLayout> {
        let mut l = ItemLayout::new();
        for (k, v) in &self.meta {
            l = l.meta(k.clone(), v.clone());
        }
        for (name, t) in &self.fields {
            l = l.field(name.clone(), t.dtype(), t.shape().to_vec());
        }
        l.finish()
    }
}

/// The shape of an item to be written in place: names, dtypes and shapes,
/// with every payload offset computed. Built by [`ItemLayout::new`] …
/// [`ItemLayoutBuilder::finish`]; finished, it cannot be extended.
#[derive(Clone, Debug)]
pub struct ItemLayout {
    header: ItemHeader,
    encoded: Vec<u8>,
    total: usize,
}

/// Names, dtypes and shapes of an item being described; [`finish`](Self::finish)
/// lays it out.
#[derive(Clone, Debug, Default)]
#[must_use = "call finish() to lay the item out"]
pub struct ItemLayoutBuilder {
    header: ItemHeader,
}

impl ItemLayout {
    /// An empty description, to add metadata and fields to.
    #[allow(clippy::new_ret_no_self)]
    pub fn new() -> ItemLayoutBuilder {
        ItemLayoutBuilder::default()
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

    /// Writes the item's prefix and header into `out`'s first bytes.
    pub(crate) fn write_header(&self, out: &mut [u8]) {
        out[0..4].copy_from_slice(&ITEM_MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&CODEC_VERSION.to_le_bytes());
        out[6..8].fill(0);
        out[8..12].copy_from_slice(&(self.encoded.len() as u32).to_le_bytes());
        out[12..16].fill(0);
        out[ITEM_PREFIX_LEN..ITEM_PREFIX_LEN + self.encoded.len()].copy_from_slice(&self.encoded);
    }
}

impl ItemLayoutBuilder {
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
    pub fn finish(mut self) -> Result<ItemLayout> {
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
                return Ok(ItemLayout {
                    header: self.header,
                    encoded,
                    total: at,
                });
            }
            header_guess = encoded.len();
        }
    }
}

/// The fields of an item being written in place.
#[derive(Debug)]
pub struct ItemSlots<'a> {
    layout: &'a ItemLayout,
    object: &'a mut [u8],
}

impl<'a> ItemSlots<'a> {
    /// The fields of `layout` over `object` (at least `layout.len()` bytes).
    pub(crate) fn new(layout: &'a ItemLayout, object: &'a mut [u8]) -> Self {
        debug_assert!(object.len() >= layout.len());
        ItemSlots { layout, object }
    }

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::ItemView;

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
        assert_eq!(ItemView::parse(&buf).unwrap().to_header(), l.header);
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
