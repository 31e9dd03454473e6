//! Tensors: a 128-byte header, then the row-major payload.

use std::borrow::Cow;

use bytemuck::{Pod, Zeroable};

use super::{CODEC_VERSION, MAX_DIMS, TENSOR_HEADER_LEN, TENSOR_MAGIC};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

/// Payload bytes of a tensor of `dtype` and `shape`, or an error on overflow.
pub(crate) fn payload_len(dtype: DType, shape: &[u64]) -> Result<usize> {
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

/// A zero-copy view of a tensor's bytes: dtype, shape and the payload in
/// place. Over a slot it comes from [`ReadGuard::tensor`](crate::ReadGuard::tensor)
/// or [`StoreReader::get_tensor`](crate::StoreReader::get_tensor).
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    dtype: DType,
    ndim: usize,
    shape: [u64; MAX_DIMS],
    data: &'a [u8],
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
    pub fn bytes(&self) -> &'a [u8] {
        self.data
    }

    /// The payload as `&[T]`, in place. Errors (never panics) when `T` does
    /// not match the dtype or the payload is not aligned for `T`.
    pub fn as_slice<T: Element>(&self) -> Result<&'a [T]> {
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
    pub fn as_bools(&self) -> Result<&'a [bool]> {
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

    /// Reads a tensor object (header and payload), checking every header
    /// field against the object's length.
    pub fn parse(object: &'a [u8]) -> Result<TensorView<'a>> {
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
        })
    }

    /// A view over a payload already checked against `dtype` and `shape`.
    pub(crate) fn from_parts(dtype: DType, shape: &[u64], data: &'a [u8]) -> Self {
        let mut s = [0u64; MAX_DIMS];
        s[..shape.len()].copy_from_slice(shape);
        TensorView {
            dtype,
            ndim: shape.len(),
            shape: s,
            data,
        }
    }
}

/// Writes a tensor header for `len` payload bytes into `out`'s first 128 bytes.
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
        assert_eq!(super::super::ITEM_PREFIX_LEN, 16);
        for (i, d) in DType::ALL.iter().enumerate() {
            assert_eq!(*d as u8 as usize, i, "dtype codes are stable");
        }
    }
}
