//! Objects on slots: the writer ([`ObjectStore`]), the readers
//! ([`StoreReader`]) with their zero-copy [`ReadGuard`]s, and the glue that
//! joins the store to the codec (`typed`) and to copy engines (`device`).

mod ahead;
mod attached;
mod clear;
mod config;
mod device;
mod guard;
mod handle;
mod key_index;
mod keys;
mod lease;
mod mapping;
mod pending;
mod reader;
mod reclaim;
mod reservation;
mod share;
mod signature;
mod stats;
mod typed;
mod writer;

pub use crate::layout::ObjectKind;
pub use config::{Eviction, ReaderOptions, StoreConfig};
pub use device::{PendingGet, PendingPut};
pub use guard::{PrivateView, ReadGuard};
pub use handle::{ObjectHandle, StoreHandle};
pub use lease::Lease;
pub use reader::StoreReader;
pub use reservation::Reservation;
pub use signature::{Signature, SIGNATURE_LEN};
pub use stats::StoreStats;
pub use typed::{ItemGuard, TensorGuard};
pub use writer::ObjectStore;

/// Removes a test's segment when the test ends, by panic too (the unit
/// tests of this folder).
#[cfg(test)]
pub(crate) struct Unlink(pub(crate) String);

#[cfg(test)]
impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(format!("/dev/shm/{}", self.0));
    }
}
