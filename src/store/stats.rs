//! What the writer counts: [`StoreStats`].

use crate::error::Blocker;

/// Counters of the writer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreStats {
    /// Successful puts.
    pub puts: u64,
    /// `get_cached` / `add_reference` hits.
    pub hits: u64,
    /// Objects reclaimed.
    pub evictions: u64,
    /// Puts that failed with `Full`.
    pub full_errors: u64,
    /// Live objects (cleared ones still held by a guard included).
    pub objects: u64,
    /// Bytes the live objects' slots span.
    pub bytes_in_use: u64,
    /// Largest object slot a put could take now.
    pub largest_free_block: u64,
    /// Dead readers found and released.
    pub dead_readers_reaped: u64,
    /// Stale handles met by readers (summed over the reader table).
    pub stale_reads: u64,
    /// Puts placed in the part of a sparse ring already backed because
    /// /dev/shm had no room for new pages.
    pub nospace_fallbacks: u64,
    /// Bytes of new pages that puts backed themselves, inside the put (a
    /// sparse store whose background backer was behind, blocked or off:
    /// [`StoreConfig::back_ahead`](crate::StoreConfig::back_ahead)); what
    /// the backer backed ahead of them is not counted.
    pub backed_in_put: u64,
    /// Keys in the shared key index now (0 without one).
    pub indexed: u64,
    /// Puts whose key the shared key index had no room for (readers miss
    /// them; [`StoreConfig::key_index`](crate::StoreConfig::key_index)).
    pub unindexed: u64,
    /// The oldest object that may not be reclaimed now (a reader owes it
    /// a read, holds it, or the writer protects it), and who blocks.
    pub oldest_unread: Option<Box<Blocker>>,
}
