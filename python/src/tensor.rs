//! Tensors as numpy arrays: dtype names both ways, and the layout of a
//! tensor object read in place.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use pinshm::codec::DType;

use crate::buffer::Buffer;

/// The numpy dtype string of `d` (little-endian, as pinshm stores).
pub(crate) fn numpy_dtype(d: DType) -> PyResult<&'static str> {
    Ok(match d {
        DType::U8 => "|u1",
        DType::I8 => "|i1",
        DType::I16 => "<i2",
        DType::U16 => "<u2",
        DType::I32 => "<i4",
        DType::U32 => "<u4",
        DType::I64 => "<i8",
        DType::U64 => "<u8",
        DType::F16 => "<f2",
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::Bool => "|b1",
        DType::BF16 => {
            return Err(PyTypeError::new_err(
                "a bfloat16 tensor has no numpy dtype: read its bytes with get()",
            ))
        }
        other => {
            return Err(PyTypeError::new_err(format!(
                "{other:?} has no numpy dtype in this build: read its bytes with get()"
            )))
        }
    })
}

/// Every dtype by its torch name (and numpy's, where they agree).
const NAMES: [(DType, &str); 13] = [
    (DType::U8, "uint8"),
    (DType::I8, "int8"),
    (DType::I16, "int16"),
    (DType::U16, "uint16"),
    (DType::I32, "int32"),
    (DType::U32, "uint32"),
    (DType::I64, "int64"),
    (DType::U64, "uint64"),
    (DType::F16, "float16"),
    (DType::BF16, "bfloat16"),
    (DType::F32, "float32"),
    (DType::F64, "float64"),
    (DType::Bool, "bool"),
];

/// The name of `d` (torch's: "float32", "bfloat16", ...).
pub(crate) fn dtype_name(d: DType) -> &'static str {
    NAMES
        .iter()
        .find(|(x, _)| *x == d)
        .map(|(_, n)| *n)
        .expect("every dtype is named")
}

/// The dtype named `s` (torch's names, with or without "torch.").
pub(crate) fn from_name(s: &str) -> PyResult<DType> {
    let s = s.strip_prefix("torch.").unwrap_or(s);
    NAMES
        .iter()
        .find(|(_, n)| *n == s)
        .map(|(d, _)| *d)
        .ok_or_else(|| {
            let names: Vec<_> = NAMES.iter().map(|(_, n)| *n).collect();
            PyValueError::new_err(format!(
                "dtype {s:?} cannot be stored as a tensor: one of {}",
                names.join(", ")
            ))
        })
}

/// The pinshm dtype of a numpy dtype string (`arr.dtype.str`).
pub(crate) fn from_numpy(s: &str) -> PyResult<DType> {
    Ok(match s {
        "|u1" => DType::U8,
        "|i1" => DType::I8,
        "<i2" => DType::I16,
        "<u2" => DType::U16,
        "<i4" => DType::I32,
        "<u4" => DType::U32,
        "<i8" => DType::I64,
        "<u8" => DType::U64,
        "<f2" => DType::F16,
        "<f4" => DType::F32,
        "<f8" => DType::F64,
        "|b1" => DType::Bool,
        _ => {
            return Err(PyValueError::new_err(format!(
                "numpy dtype {s:?} cannot be stored as a tensor (little-endian \
                 integers, floats and bool only)"
            )))
        }
    })
}

/// A numpy array to store: its pinshm dtype, its shape and its bytes
/// (borrowed from the array until this drops).
pub(crate) struct Field {
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<u64>,
    buf: Buffer,
}

impl Field {
    /// The dtype, shape and bytes of `array` (a C-contiguous numpy array of
    /// a little-endian integer, float or bool dtype).
    pub(crate) fn of(array: &Bound<'_, PyAny>) -> PyResult<Field> {
        let dtype: String = array.getattr("dtype")?.getattr("str")?.extract()?;
        Ok(Field {
            dtype: from_numpy(&dtype)?,
            shape: array.getattr("shape")?.extract()?,
            buf: Buffer::readable(array)?,
        })
    }

    /// The array's bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        self.buf.as_slice()
    }
}

/// Where a tensor's elements lie in its object.
pub(crate) struct Layout {
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<u64>,
    /// Offset of the first element from the start of the object.
    pub(crate) offset: usize,
    pub(crate) numel: usize,
}

/// The layout of the tensor object `object` (its header checked).
pub(crate) fn layout(object: &[u8]) -> pinshm::Result<Layout> {
    let view = pinshm::codec::TensorView::parse(object)?;
    Ok(Layout {
        dtype: view.dtype(),
        shape: view.shape().to_vec(),
        offset: view.bytes().as_ptr() as usize - object.as_ptr() as usize,
        numel: view.numel(),
    })
}

/// One field of an item object: where its elements lie.
pub(crate) struct ItemField {
    pub(crate) name: String,
    pub(crate) layout: Layout,
}

/// An item's metadata entries `(key, value)`, in order.
pub(crate) type Meta = Vec<(String, String)>;

/// The fields and metadata of the item object `object` (its header
/// checked: every field lies inside the object).
pub(crate) fn item_fields(object: &[u8]) -> pinshm::Result<(Vec<ItemField>, Meta)> {
    let view = pinshm::codec::ItemView::parse(object)?;
    let fields = view
        .fields()
        .map(|f| {
            // Checked by `parse`: offset + len lies inside the object (so
            // both fit a usize), and len is numel × the dtype's size.
            let offset = usize::try_from(f.offset()).unwrap_or(usize::MAX);
            let len = usize::try_from(f.len()).unwrap_or(usize::MAX);
            ItemField {
                name: f.name().to_owned(),
                layout: Layout {
                    dtype: f.dtype(),
                    shape: f.shape().to_vec(),
                    offset,
                    numel: len / f.dtype().size(),
                },
            }
        })
        .collect();
    let meta = view
        .meta_entries()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    Ok((fields, meta))
}
