//! What an object is, as bytes: pure formats over `&[u8]` that know nothing
//! of stores. Raw bytes; tensors (dtype, shape, aligned
//! payload, read in place as a [`TensorView`]); multi-field items (named
//! tensors plus string metadata, like a multimodal item) in one slot.
//!
//! ## Object layouts (codec version 1), offsets from the payload start
//!
//! Tensor (slot kind `ObjectKind::Tensor`):
//! ```text
//! 0    TensorHeader (128 B): magic "PTNS", version, dtype, ndim, shape[8]
//! 128  payload: product(shape) × dtype size bytes, row-major
//! ```
//! Item (slot kind `ObjectKind::Item`):
//! ```text
//! 0    ItemPrefix (16 B): magic "PITM", version, header_len
//! 16   header: MessagePack of ItemHeader { meta, fields: [{name, dtype, shape, offset, len}] }
//! ...  payloads, each at a 64-byte aligned offset
//! ```
//! The item header is MessagePack (rmp-serde, named fields) so Python can read
//! it with `msgpack.unpackb`. Rust reads it back with a strict borrowing
//! reader (`msgpack`, `view`) that allocates nothing, since it runs on every
//! `get_item`. Everything read back is validated against the object's length
//! before a view is formed: a corrupt header is an error.

mod item;
mod msgpack;
mod tensor;
mod view;

pub use crate::dtype::{DType, Element};
pub use item::{FieldSpec, Item, ItemHeader, ItemLayout, ItemLayoutBuilder, ItemSlots};
pub(crate) use tensor::payload_len;
pub(crate) use tensor::write_tensor_header;
pub use tensor::{TensorRef, TensorView};
pub use view::{FieldRef, ItemView};

/// Bumped on every change to the tensor or item layout.
pub(crate) const CODEC_VERSION: u16 = 1;
/// Most dimensions a tensor may have.
pub const MAX_DIMS: usize = 8;

pub(crate) const TENSOR_MAGIC: u32 = u32::from_le_bytes(*b"PTNS");
pub(crate) const ITEM_MAGIC: u32 = u32::from_le_bytes(*b"PITM");
/// Bytes before a tensor's payload.
pub(crate) const TENSOR_HEADER_LEN: usize = 128;
pub(crate) const ITEM_PREFIX_LEN: usize = 16;
