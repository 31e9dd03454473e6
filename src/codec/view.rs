//! Reading items in place: [`ItemView`] borrows names and metadata from the
//! header in the object's bytes, through the strict MessagePack reader in
//! `msgpack`, and checks every field against the object once.

use std::fmt;

use super::item::{FieldSpec, ItemHeader};
use super::msgpack::{Malformed, Parsed, Reader};
use super::tensor::{payload_len, TensorView};
use super::{CODEC_VERSION, ITEM_MAGIC, ITEM_PREFIX_LEN, MAX_DIMS};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::SLOT_ALIGN;

/// One field of an item, borrowed from the header in the object's bytes:
/// the allocation-free counterpart of [`FieldSpec`]. From [`ItemView::fields`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct FieldRef<'a>(Field<&'a str>);

/// A decoded field, its name as `N`: raw bytes while walking (lookups by
/// name compare bytes, so the hot path skips UTF-8 checks that `parse`
/// already made), `&str` once handed out.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Field<N> {
    name: N,
    dtype: DType,
    ndim: u8,
    // Inline, like `TensorView`'s: a Vec per field is what the read path
    // must not allocate.
    shape: [u64; MAX_DIMS],
    offset: u64,
    len: u64,
}

impl<'a> FieldRef<'a> {
    /// Field name.
    pub fn name(&self) -> &'a str {
        self.0.name
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }

    /// Shape (empty for a 0-d tensor).
    pub fn shape(&self) -> &[u64] {
        &self.0.shape[..usize::from(self.0.ndim)]
    }

    /// Payload offset from the object start (64-byte aligned).
    pub fn offset(&self) -> u64 {
        self.0.offset
    }

    /// Payload bytes.
    pub fn len(&self) -> u64 {
        self.0.len
    }

    /// Whether the payload has no bytes (a dimension of 0).
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// An owned copy, as the header stores it.
    pub fn to_spec(&self) -> FieldSpec {
        FieldSpec {
            name: self.0.name.to_owned(),
            dtype: self.0.dtype,
            shape: self.shape().to_vec(),
            offset: self.0.offset,
            len: self.0.len,
        }
    }
}

impl fmt::Debug for FieldRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FieldRef")
            .field("name", &self.0.name)
            .field("dtype", &self.0.dtype)
            .field("shape", &self.shape())
            .field("offset", &self.0.offset)
            .field("len", &self.0.len)
            .finish()
    }
}

/// A zero-copy view of an item's bytes: names and metadata borrowed from the
/// header in place, each field a [`TensorView`] over the object. Over a slot
/// it comes from [`ReadGuard::item`](crate::ReadGuard::item) or
/// [`StoreReader::get_item`](crate::StoreReader::get_item).
///
/// [`parse`](Self::parse) checks the whole header once and keeps only where
/// its two arrays start; the accessors walk them again in place. Nothing on
/// the read path allocates: an owned decode cost 0.5 to 1.8 µs per read,
/// more than twice the rest of `get_item`.
#[derive(Clone, Copy)]
pub struct ItemView<'a> {
    object: &'a [u8],
    /// The MessagePack header, inside `object`.
    header: &'a [u8],
    at: HeaderAt,
}

/// Where a validated header's two arrays start, and their lengths: all a
/// view keeps, so that it needs no allocation.
#[derive(Clone, Copy, Debug)]
struct HeaderAt {
    meta: usize,
    meta_n: usize,
    fields: usize,
    fields_n: usize,
}

impl<'a> ItemView<'a> {
    /// Reads an item object, checking every field against its length: the
    /// dtype and shape give the stored length, and the payload is 64-byte
    /// aligned, after the header and inside the object.
    ///
    /// The header must be what [`ItemLayout`](crate::codec::ItemLayout) writes
    /// (rmp-serde, named fields) or an equivalent encoding, as Python's
    /// `msgpack.packb` of the same dicts: map keys in any order, each
    /// exactly once, no unknown keys; integers unsigned, in any width;
    /// strings as str (not bin), valid UTF-8, in any width; arrays and maps
    /// in any width; the dtype as its variant name (`"F32"`); meta entries
    /// as `[key, value]`; at most 8 dimensions; nothing after the top-level
    /// map. Anything else is [`Error::CorruptObject`], never a panic.
    pub fn parse(object: &'a [u8]) -> Result<Self> {
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
        let hlen = u32::from_le_bytes([prefix[8], prefix[9], prefix[10], prefix[11]]) as usize;
        let header = object
            .get(ITEM_PREFIX_LEN..)
            .and_then(|r| r.get(..hlen))
            .ok_or_else(|| corrupt(format!("header of {hlen} bytes runs past the object")))?;
        let data_start = (ITEM_PREFIX_LEN + hlen) as u64;
        let at = walk_header(header, |f| {
            check_field(f, data_start, object.len()).map_err(corrupt)
        })?;
        Ok(ItemView { object, header, at })
    }

    /// Metadata entries `(key, value)`, in order.
    pub fn meta_entries(&self) -> impl ExactSizeIterator<Item = (&'a str, &'a str)> {
        Walk {
            r: Reader::at(self.header, self.at.meta),
            left: self.at.meta_n,
            read: read_meta,
        }
    }

    /// A metadata value (the first entry with this key).
    pub fn meta(&self, key: &str) -> Option<&'a str> {
        self.meta_entries().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// The fields as the header describes them, in order.
    pub fn fields(&self) -> impl ExactSizeIterator<Item = FieldRef<'a>> {
        Walk {
            r: Reader::at(self.header, self.at.fields),
            left: self.at.fields_n,
            read: read_named_field,
        }
    }

    /// Field names, in order.
    pub fn names(&self) -> impl Iterator<Item = &'a str> {
        self.fields().map(|f| f.0.name)
    }

    /// A field by name (the first with this name), in place.
    pub fn field(&self, name: &str) -> Result<TensorView<'a>> {
        let mut walk = Walk {
            r: Reader::at(self.header, self.at.fields),
            left: self.at.fields_n,
            read: read_field,
        };
        let f = walk
            .find(|f| f.name == name.as_bytes())
            .ok_or_else(|| Error::NoSuchField {
                name: name.to_owned(),
            })?;
        // In bounds: `parse` checked it; `get` so that a broken invariant is
        // an error rather than a panic.
        let data = usize::try_from(f.offset)
            .ok()
            .zip(usize::try_from(f.len).ok())
            .and_then(|(o, l)| self.object.get(o..o.checked_add(l)?))
            .ok_or_else(|| Error::CorruptObject(format!("item: field '{name}' out of bounds")))?;
        Ok(TensorView::from_parts(
            f.dtype,
            &f.shape[..usize::from(f.ndim)],
            data,
        ))
    }

    /// An owned copy of the header (allocates; the accessors above do not).
    pub fn to_header(&self) -> ItemHeader {
        ItemHeader {
            meta: self
                .meta_entries()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            fields: self.fields().map(|f| f.to_spec()).collect(),
        }
    }
}

impl fmt::Debug for ItemView<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not the object's bytes: they may be megabytes of payload.
        f.debug_struct("ItemView")
            .field("meta", &DebugIter(|| self.meta_entries()))
            .field("fields", &DebugIter(|| self.fields()))
            .field("object_len", &self.object.len())
            .finish()
    }
}

/// Formats what a fresh iterator yields as a list.
struct DebugIter<F>(F);

impl<F, I> fmt::Debug for DebugIter<F>
where
    F: Fn() -> I,
    I: Iterator,
    I::Item: fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries((self.0)()).finish()
    }
}

/// Re-walks an array of a header `parse` already validated. A decode error
/// cannot happen there; should it, the walk ends rather than panics.
struct Walk<'a, T> {
    r: Reader<'a>,
    left: usize,
    read: fn(&mut Reader<'a>) -> Parsed<T>,
}

impl<T> Iterator for Walk<'_, T> {
    type Item = T;

    fn next(&mut self) -> Option<T> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let item = (self.read)(&mut self.r).ok();
        if item.is_none() {
            self.left = 0;
        }
        item
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl<T> ExactSizeIterator for Walk<'_, T> {}

/// Decodes the whole header, calling `check` on each field, and returns
/// where its arrays lie. Keys in any order, each once; no unknown keys;
/// nothing after the top-level map (what rmp-serde writes is one map of
/// `meta` then `fields`).
fn walk_header<'a>(
    header: &'a [u8],
    mut check: impl FnMut(&FieldRef<'a>) -> Result<()>,
) -> Result<HeaderAt> {
    let undecodable = |m: Malformed| {
        Error::CorruptObject(format!(
            "item: header does not decode: {} at byte {}",
            m.what, m.at
        ))
    };
    let mut r = Reader::new(header);
    let (mut meta, mut fields) = (None, None);
    for _ in 0..r.map_len().map_err(undecodable)? {
        let key_at = r.pos();
        // Keys compare as bytes: one that matches is ASCII, so valid UTF-8.
        let (slot, found) = match r.raw_str().map_err(undecodable)? {
            b"meta" => {
                let n = r.array_len().map_err(undecodable)?;
                let at = r.pos();
                for _ in 0..n {
                    read_meta(&mut r).map_err(undecodable)?;
                }
                (&mut meta, (at, n))
            }
            b"fields" => {
                let n = r.array_len().map_err(undecodable)?;
                let at = r.pos();
                for _ in 0..n {
                    check(&read_named_field(&mut r).map_err(undecodable)?)?;
                }
                (&mut fields, (at, n))
            }
            _ => {
                return Err(undecodable(Malformed {
                    what: "unknown key",
                    at: key_at,
                }))
            }
        };
        if slot.replace(found).is_some() {
            return Err(undecodable(Malformed {
                what: "duplicate key",
                at: key_at,
            }));
        }
    }
    if r.remaining() != 0 {
        return Err(undecodable(r.err("bytes after the header")));
    }
    let missing = |what| undecodable(Malformed { what, at: 0 });
    let (meta, meta_n) = meta.ok_or_else(|| missing("no key 'meta'"))?;
    let (fields, fields_n) = fields.ok_or_else(|| missing("no key 'fields'"))?;
    Ok(HeaderAt {
        meta,
        meta_n,
        fields,
        fields_n,
    })
}

/// One metadata entry: a 2-array of strings (rmp-serde's tuple).
fn read_meta<'a>(r: &mut Reader<'a>) -> Parsed<(&'a str, &'a str)> {
    let at = r.pos();
    if r.array_len()? != 2 {
        return Err(Malformed {
            what: "meta entry is not a [key, value] pair",
            at,
        });
    }
    Ok((r.str()?, r.str()?))
}

/// One field: a map of `name`, `dtype`, `shape`, `offset`, `len`, in any
/// order, each once. `offset` and `len` are `#[serde(default)]` in
/// `FieldSpec`, but a default of 0 could never pass `check_field` (offset 0
/// is inside the prefix), so requiring them rejects nothing valid.
fn read_field<'a>(r: &mut Reader<'a>) -> Parsed<Field<&'a [u8]>> {
    fn once<T>(slot: &mut Option<T>, v: T, at: usize) -> Parsed<()> {
        match slot.replace(v) {
            None => Ok(()),
            Some(_) => Err(Malformed {
                what: "duplicate key in a field",
                at,
            }),
        }
    }
    let start = r.pos();
    let (mut name, mut dtype, mut shape, mut offset, mut len) = (None, None, None, None, None);
    for _ in 0..r.map_len()? {
        let at = r.pos();
        match r.raw_str()? {
            b"name" => once(&mut name, r.raw_str()?, at)?,
            b"dtype" => once(&mut dtype, read_dtype(r)?, at)?,
            b"shape" => once(&mut shape, read_shape(r)?, at)?,
            b"offset" => once(&mut offset, r.uint()?, at)?,
            b"len" => once(&mut len, r.uint()?, at)?,
            _ => {
                return Err(Malformed {
                    what: "unknown key in a field",
                    at,
                })
            }
        }
    }
    let missing = |what| Malformed { what, at: start };
    let (ndim, shape) = shape.ok_or(missing("field without 'shape'"))?;
    Ok(Field {
        name: name.ok_or(missing("field without 'name'"))?,
        dtype: dtype.ok_or(missing("field without 'dtype'"))?,
        ndim,
        shape,
        offset: offset.ok_or(missing("field without 'offset'"))?,
        len: len.ok_or(missing("field without 'len'"))?,
    })
}

/// A field, its name checked as UTF-8.
fn read_named_field<'a>(r: &mut Reader<'a>) -> Parsed<FieldRef<'a>> {
    let at = r.pos();
    let f = read_field(r)?;
    let name = std::str::from_utf8(f.name).map_err(|_| Malformed {
        what: "field name is not UTF-8",
        at,
    })?;
    Ok(FieldRef(Field {
        name,
        dtype: f.dtype,
        ndim: f.ndim,
        shape: f.shape,
        offset: f.offset,
        len: f.len,
    }))
}

/// A dtype as serde writes a unit variant: its name as a string (compared
/// as bytes: every name is ASCII).
fn read_dtype(r: &mut Reader<'_>) -> Parsed<DType> {
    let at = r.pos();
    Ok(match r.raw_str()? {
        b"U8" => DType::U8,
        b"I8" => DType::I8,
        b"I16" => DType::I16,
        b"U16" => DType::U16,
        b"I32" => DType::I32,
        b"U32" => DType::U32,
        b"I64" => DType::I64,
        b"U64" => DType::U64,
        b"F16" => DType::F16,
        b"BF16" => DType::BF16,
        b"F32" => DType::F32,
        b"F64" => DType::F64,
        b"Bool" => DType::Bool,
        _ => {
            return Err(Malformed {
                what: "unknown dtype",
                at,
            })
        }
    })
}

/// A shape: at most `MAX_DIMS` unsigned integers, kept inline.
fn read_shape(r: &mut Reader<'_>) -> Parsed<(u8, [u64; MAX_DIMS])> {
    let at = r.pos();
    let n = r.array_len()?;
    if n > MAX_DIMS {
        return Err(Malformed {
            what: "shape has more than 8 dimensions",
            at,
        });
    }
    let mut shape = [0u64; MAX_DIMS];
    for d in &mut shape[..n] {
        *d = r.uint()?;
    }
    Ok((n as u8, shape))
}

/// A field's stored length agrees with its dtype and shape, and its payload
/// is 64-byte aligned, after the header and inside the object.
fn check_field(
    f: &FieldRef<'_>,
    data_start: u64,
    object_len: usize,
) -> std::result::Result<(), String> {
    let len =
        payload_len(f.dtype(), f.shape()).map_err(|e| format!("field '{}': {e}", f.name()))?;
    let end = f.offset().checked_add(f.len());
    if len as u64 != f.len()
        || f.offset() % SLOT_ALIGN as u64 != 0
        || f.offset() < data_start
        || end.is_none_or(|e| e > object_len as u64)
    {
        return Err(format!(
            "field '{}' (offset {}, {} bytes, shape {:?}) does not fit the object of {} bytes",
            f.name(),
            f.offset(),
            f.len(),
            f.shape(),
            object_len
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
