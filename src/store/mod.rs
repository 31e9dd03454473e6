//! Objects on slots: the writer ([`ObjectStore`]), the readers
//! ([`StoreReader`]) with their zero-copy [`ReadGuard`]s, and the glue that
//! joins the store to the codec (`typed`) and to copy engines (`device`).

mod config;
mod device;
mod guard;
mod mapping;
mod reader;
mod reclaim;
mod signature;
mod typed;
mod writer;

pub use config::{Eviction, ObjectHandle, ReaderOptions, StoreConfig, StoreHandle, StoreStats};
pub use device::{PendingGet, PendingPut};
pub use guard::ReadGuard;
pub use reader::StoreReader;
pub use signature::{Signature, SIGNATURE_LEN};
pub use typed::{ItemGuard, TensorGuard};
pub use writer::ObjectStore;
