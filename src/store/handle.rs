//! What travels between processes: [`ObjectHandle`] (one object) and
//! [`StoreHandle`] (one store, what a reader attaches by).

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::geometry::validate_store;
use crate::layout;
use crate::sys::segment::Segment;
use crate::sys::trust::Trust;

/// Where an object lives: what travels from the writer to the readers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ObjectHandle {
    /// Offset of the slot in the data region.
    pub address: u64,
    /// The object's id, never reused within a segment's life.
    pub monotonic_id: u64,
    /// Epoch at put time (new at create and at every `clear_hard`).
    pub epoch: u64,
}

/// Everything a reader process needs to attach.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StoreHandle {
    /// Segment name (without the leading `/`).
    pub name: String,
    /// The segment's creation nonce.
    pub nonce: u64,
    /// Ring bytes.
    pub capacity: u64,
    /// Largest object.
    pub max_object_size: u64,
    /// Reader slots.
    pub n_readers: u32,
    /// Layout version of the writer.
    pub layout_version: u32,
}

impl StoreHandle {
    /// The handle of the live segment `name`, read from its validated header.
    pub fn of(name: &str) -> Result<StoreHandle> {
        let seg = Segment::open_read_only(name, Trust::Owner)?;
        let geo = validate_store(&seg, name)?;
        Ok(StoreHandle {
            name: seg.name().to_owned(),
            nonce: geo.header().read().nonce,
            capacity: geo.capacity,
            max_object_size: geo.max_object_size,
            n_readers: geo.n_readers,
            layout_version: layout::LAYOUT_VERSION,
        })
    }
}
