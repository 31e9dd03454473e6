//! pinshm's exceptions: one tree. Every error of the core is a
//! `PinshmError`, and also the builtin that callers already catch for it
//! (`StaleError` is a `ValueError`, `FullError` a `MemoryError`,
//! `WaitTimeoutError` a `TimeoutError`, ...), so both `except
//! pinshm.PinshmError` and `except ValueError` work.
//!
//! `create_exception!` gives a class one base. The classes with two are
//! made on first use by calling `type(name, (PinshmError, builtin), ns)`
//! (the stable ABI has no other way to pass two bases without raw FFI), and
//! exposed to Rust as marker types implementing `PyTypeInfo`, so that an
//! error is built lazily (`PyErr::new::<T, _>`) and [`to_py`] needs no GIL:
//! some callers run it with the GIL released.

use pyo3::create_exception;
use pyo3::exceptions::{
    PyException, PyFileExistsError, PyFileNotFoundError, PyKeyError, PyMemoryError, PyTimeoutError,
    PyTypeError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyTuple, PyType};
use pyo3::PyTypeInfo;

create_exception!(
    pinshm,
    PinshmError,
    PyException,
    "Base of every pinshm error. Most are also a builtin: see the subclasses."
);

/// The class `name`: a subclass of `PinshmError` and of `builtin`, in
/// module `pinshm`, made once per interpreter.
fn make_class<'py>(
    py: Python<'py>,
    name: &str,
    doc: &str,
    builtin: Bound<'py, PyType>,
) -> PyResult<Py<PyType>> {
    let bases = PyTuple::new(py, [py.get_type::<PinshmError>(), builtin])?;
    let ns = PyDict::new(py);
    ns.set_item("__doc__", doc)?;
    ns.set_item("__module__", "pinshm")?;
    let class = py.get_type::<PyType>().call1((name, bases, ns))?;
    Ok(class.downcast_into::<PyType>()?.unbind())
}

/// `exception!(Name, Builtin, "doc")`: a marker type for the class `Name`
/// (a `PinshmError` and a `Builtin`).
macro_rules! exception {
    ($name:ident, $builtin:ty, $doc:expr) => {
        #[doc = $doc]
        pub(crate) struct $name;

        // SAFETY: `type_object_raw` returns a type object that lives as
        // long as the interpreter: the class made by `make_class` (a heap
        // type, `type`'s result checked by `downcast_into`), owned by a
        // static cell that never drops nor replaces it. NAME and MODULE are
        // that class's name and module.
        unsafe impl PyTypeInfo for $name {
            const NAME: &'static str = stringify!($name);
            const MODULE: Option<&'static str> = Some("pinshm");

            fn type_object_raw(py: Python<'_>) -> *mut pyo3::ffi::PyTypeObject {
                static CLASS: GILOnceCell<Py<PyType>> = GILOnceCell::new();
                CLASS
                    .get_or_init(py, || {
                        make_class(py, stringify!($name), $doc, py.get_type::<$builtin>())
                            .expect("making a pinshm exception class")
                    })
                    .as_ptr()
                    .cast()
            }
        }
    };
}

exception!(
    StaleError,
    PyValueError,
    "The handle names an object that is gone or never existed: treat it as a cache miss."
);
exception!(
    FullError,
    PyMemoryError,
    "The data region is full of objects still owed reads or held by guards."
);
exception!(
    NoSpaceError,
    PyMemoryError,
    "/dev/shm has no room for the pages this put or send would write (or for a reserved segment): \
     the store or channel is unchanged and works again once space is free."
);
exception!(
    WaitTimeoutError,
    PyTimeoutError,
    "A send or receive gave up after its timeout (a builtin TimeoutError)."
);
exception!(
    KeyNotFoundError,
    PyKeyError,
    "The store holds no object under that key."
);
exception!(
    NotFoundError,
    PyFileNotFoundError,
    "No segment of that name exists (in /dev/shm): the writer has not created it yet, or it is gone."
);
exception!(
    WrongKindError,
    PyTypeError,
    "The object is not of the kind asked for (not a tensor, not an item, another dtype)."
);
exception!(
    InUseError,
    PyFileExistsError,
    "The segment's name is taken: by a live writer's segment, one being created, or a file that is not \
     a pinshm segment of this user's to replace (a builtin FileExistsError)."
);
exception!(
    InvalidArgumentError,
    PyValueError,
    "An argument pinshm refuses: a key already stored, an object larger than the data region, \
     a bad configuration or name, a reader index out of range, a malformed tensor."
);

create_exception!(
    pinshm,
    WriterGoneError,
    PinshmError,
    "The writer of the segment has exited or died: attach to its successor."
);
create_exception!(
    pinshm,
    CancelledError,
    PinshmError,
    "A blocking send or receive ended because cancel() was called (a shutdown)."
);

create_exception!(
    pinshm,
    UntrustedError,
    PinshmError,
    "A segment opened by name that this process must not trust: another user's (see PINSHM_TRUSTED_UIDS), writable by others, or not a regular file."
);

/// The Python exception for a pinshm error, with its message. Builds the
/// error lazily: callable with the GIL released.
pub(crate) fn to_py(e: pinshm::Error) -> PyErr {
    use pinshm::Error as E;
    let msg = e.to_string();
    match e {
        E::Stale { .. } => PyErr::new::<StaleError, _>(msg),
        E::Full { .. } => PyErr::new::<FullError, _>(msg),
        E::NoSpace { .. } => PyErr::new::<NoSpaceError, _>(msg),
        E::Timeout { .. } => PyErr::new::<WaitTimeoutError, _>(msg),
        E::WriterGone { .. } => WriterGoneError::new_err(msg),
        E::Cancelled { .. } => CancelledError::new_err(msg),
        E::Untrusted { .. } => UntrustedError::new_err(msg),
        E::KeyNotFound { .. } => PyErr::new::<KeyNotFoundError, _>(msg),
        E::NotFound { .. } => PyErr::new::<NotFoundError, _>(msg),
        E::InUse { .. } | E::AlreadyExists { .. } => PyErr::new::<InUseError, _>(msg),
        E::WrongKind { .. } | E::DTypeMismatch { .. } => PyErr::new::<WrongKindError, _>(msg),
        E::DuplicateKey { .. }
        | E::TooLarge { .. }
        | E::InvalidConfig(_)
        | E::InvalidName { .. }
        | E::ReaderIndexOutOfRange { .. }
        | E::InvalidTensor(_) => PyErr::new::<InvalidArgumentError, _>(msg),
        _ => PinshmError::new_err(msg),
    }
}

/// Adds every class to module `m`.
pub(crate) fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("PinshmError", py.get_type::<PinshmError>())?;
    m.add("StaleError", py.get_type::<StaleError>())?;
    m.add("FullError", py.get_type::<FullError>())?;
    m.add("NoSpaceError", py.get_type::<NoSpaceError>())?;
    m.add("WaitTimeoutError", py.get_type::<WaitTimeoutError>())?;
    m.add("KeyNotFoundError", py.get_type::<KeyNotFoundError>())?;
    m.add("NotFoundError", py.get_type::<NotFoundError>())?;
    m.add("WrongKindError", py.get_type::<WrongKindError>())?;
    m.add("InUseError", py.get_type::<InUseError>())?;
    m.add(
        "InvalidArgumentError",
        py.get_type::<InvalidArgumentError>(),
    )?;
    m.add("WriterGoneError", py.get_type::<WriterGoneError>())?;
    m.add("CancelledError", py.get_type::<CancelledError>())?;
    m.add("UntrustedError", py.get_type::<UntrustedError>())?;
    Ok(())
}
