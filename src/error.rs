//! The one error type of the crate.

use std::fmt;

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Who keeps the oldest object from being reclaimed (see [`Error::Full`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Blocker {
    /// Address of the oldest live object.
    pub address: u64,
    /// Its monotonic id.
    pub monotonic_id: u64,
    /// Its key (`None` after `clear`).
    pub key: Option<String>,
    /// Readers that still owe a read of it.
    pub unread_by: Vec<u32>,
    /// Readers that hold a guard or view on it.
    pub held_by: Vec<u32>,
    /// Whether the writer protects it (`ObjectStore::protect`).
    pub protected: bool,
}

impl fmt::Display for Blocker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the oldest object {}:{}",
            self.address, self.monotonic_id
        )?;
        if let Some(k) = &self.key {
            write!(f, " (key '{k}')")?;
        }
        let mut sep = " is";
        if !self.unread_by.is_empty() {
            write!(f, "{sep} still unread by reader(s) {:?}", self.unread_by)?;
            sep = " and";
        }
        if !self.held_by.is_empty() {
            write!(f, "{sep} held by a guard of reader(s) {:?}", self.held_by)?;
            sep = " and";
        }
        if self.protected {
            write!(
                f,
                "{sep} protected by the writer (release_protections ends it)"
            )?;
        }
        Ok(())
    }
}

/// Everything that can go wrong. Match on the variant; the message says what
/// happened and what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The handle names an object that is gone (reclaimed, overwritten,
    /// cleared, from another segment or epoch) or never existed. Treat it as
    /// a cache miss and fetch the object again. Returned by
    /// [`StoreReader::get`](crate::StoreReader::get) and friends.
    #[error("Data for address:id '{address}:{monotonic_id}' has been modified or is invalid.")]
    Stale {
        /// Address from the handle.
        address: u64,
        /// Monotonic id from the handle.
        monotonic_id: u64,
    },

    /// [`ObjectStore::put`](crate::ObjectStore::put) with a key that is
    /// stored already (use `get_cached` to re-reference it), or whose put
    /// is still in flight (`pending`: see
    /// [`ObjectStore::is_pending`](crate::ObjectStore::is_pending)).
    #[error(
        "key '{key}' {}",
        if *pending {
            "is being put (its copy is in flight: is_pending is true until it is published or given up)"
        } else {
            "already exists in the store; use get_cached to reference it again"
        }
    )]
    DuplicateKey {
        /// The key.
        key: String,
        /// Whether the key's put is in flight rather than published.
        pending: bool,
    },

    /// The object is larger than the store's `max_object_size`.
    #[error("object of {size} bytes exceeds max object size ({max} bytes)")]
    TooLarge {
        /// Bytes asked for.
        size: u64,
        /// The store's limit.
        max: u64,
    },

    /// No room after reclaiming every object all readers are done with.
    #[error("store full: {requested} bytes asked for, {free} of {capacity} free after reclaiming; {}",
        blocker.as_ref().map(|b| b.to_string()).unwrap_or_else(|| "no object blocks (the request is larger than the data region)".into()))]
    Full {
        /// Slot bytes asked for (payload plus slot header, aligned).
        requested: u64,
        /// Bytes free (not necessarily contiguous).
        free: u64,
        /// Ring capacity.
        capacity: u64,
        /// What keeps the oldest object alive.
        blocker: Option<Box<Blocker>>,
    },

    /// [`ObjectStore::add_reference`](crate::ObjectStore::add_reference) or
    /// [`ObjectStore::protect`](crate::ObjectStore::protect) of a key that is
    /// not stored.
    #[error("key '{key}' is not in the store")]
    KeyNotFound {
        /// The key.
        key: String,
    },

    /// [`StoreReader::lookup`](crate::StoreReader::lookup) (or another
    /// lookup by key) in a store created without a shared key index.
    #[error("store '{name}' has no key index: readers cannot look keys up (create it with StoreConfig::key_index)")]
    NoKeyIndex {
        /// The segment.
        name: String,
    },

    /// A configuration value that cannot work.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),

    /// A segment name POSIX shared memory cannot take.
    #[error("invalid segment name '{name}': use 1 to 250 characters, no '/' after the first")]
    InvalidName {
        /// The name.
        name: String,
    },

    /// Create found the name taken by a live segment.
    #[error(
        "shared memory segment '{name}' already exists; pick another name or remove the old one"
    )]
    AlreadyExists {
        /// The name.
        name: String,
    },

    /// Create found the name taken by a segment it must not replace.
    #[error("cannot create segment '{name}': {detail}")]
    InUse {
        /// The name.
        name: String,
        /// Who holds it.
        detail: String,
    },

    /// The writer of this segment has exited or died: objects already
    /// published stay readable, nothing new will come. Attach to the new
    /// writer's segment.
    #[error("the writer of segment '{name}' is gone")]
    WriterGone {
        /// The name.
        name: String,
    },

    /// A blocking call gave up after its timeout: the writer's next slot
    /// was still held by a reader (`send_timeout`), or no message came
    /// (`recv_timeout`). Nothing was sent or received; call again, or find
    /// out why the other side is slow.
    #[error("{op} timed out after {after:?}: {detail}")]
    Timeout {
        /// The call that gave up.
        op: &'static str,
        /// How long it waited.
        after: std::time::Duration,
        /// What it was waiting for.
        detail: String,
    },

    /// A blocking send or receive ended because another thread called
    /// [`Canceller::cancel`](crate::channel::Canceller::cancel) (a
    /// shutdown). Nothing was sent or received; every later wait of the
    /// same writer or reader ends the same way.
    #[error("{op} cancelled on channel '{name}': cancel() was called (a shutdown)")]
    Cancelled {
        /// The call that ended.
        op: &'static str,
        /// The channel's segment name.
        name: String,
    },

    /// A segment opened by name that this process must not trust: another
    /// user's, writable by others, or not a regular file (a FIFO). See
    /// `PINSHM_TRUSTED_UIDS` to read another user's segments on purpose.
    #[error("segment '{name}' is not trusted: {detail}")]
    Untrusted {
        /// The name.
        name: String,
        /// Whose it is, its mode, and what to do.
        detail: String,
    },

    /// Open found no segment of that name.
    #[error("no shared memory segment named '{name}' (has its writer exited?)")]
    NotFound {
        /// The name.
        name: String,
    },

    /// /dev/shm cannot hold the segment (at create, for a reserved one), or
    /// the pages a put or send is about to write (a sparse one). The store
    /// or channel is unchanged and works again once space is free.
    #[error("cannot allocate {requested} bytes of /dev/shm for segment '{name}': only {available} bytes free there; free some (or make /dev/shm larger), or make the segment smaller")]
    NoSpace {
        /// The name.
        name: String,
        /// Bytes asked for.
        requested: u64,
        /// Bytes free in /dev/shm when it failed.
        available: u64,
    },

    /// The segment's header does not describe a usable pinshm segment.
    #[error("segment '{name}' is not usable: {field}: {detail}")]
    BadHeader {
        /// The name.
        name: String,
        /// The header field at fault.
        field: &'static str,
        /// What was expected and what was found.
        detail: String,
    },

    /// The name now belongs to another segment than the handle's (the writer
    /// restarted). Get a fresh handle from the new writer.
    #[error("segment '{name}' was recreated since this handle was made (nonce {found:#x}, handle has {expected:#x}); get a new StoreHandle from the writer")]
    SegmentMismatch {
        /// The name.
        name: String,
        /// Nonce in the handle.
        expected: u64,
        /// Nonce in the segment.
        found: u64,
    },

    /// Every reader entry is taken by a live reader. (The variant's name
    /// predates the glossary's: a reader's row in the table is its reader
    /// entry; a slot holds an object.)
    #[error("all {n_readers} reader entries are taken by live readers")]
    NoReaderSlot {
        /// Reader entries in the segment.
        n_readers: u32,
    },

    /// `attach_as` named an entry a live reader holds (the name: as
    /// [`Error::NoReaderSlot`]'s).
    #[error("reader entry {index} is held by live process {pid}")]
    ReaderSlotTaken {
        /// The index.
        index: u32,
        /// Pid of its holder.
        pid: u32,
    },

    /// This reader's entry in the reader table is no longer its own (the
    /// table was overwritten): it reads nothing more. Attach again.
    #[error("reader {index} no longer holds its reader entry; attach again")]
    ReaderLeft {
        /// The index.
        index: u32,
    },

    /// This reader or store was made in a parent process before `fork()`:
    /// in the child it reads and changes nothing shared (the entry, the
    /// lock and the ring are the parent's). Attach or create anew in the
    /// child.
    #[error("this handle on segment '{name}' belongs to the parent process (made before fork); attach again in this process")]
    Forked {
        /// The segment name.
        name: String,
    },

    /// `attach_as` named an index past `n_readers`.
    #[error("reader index {index} out of range: the store has {n_readers} readers")]
    ReaderIndexOutOfRange {
        /// The index.
        index: u32,
        /// Reader entries in the segment.
        n_readers: u32,
    },

    /// A channel's reader holds a [`Message`](crate::channel::Message) in every
    /// slot, so the writer could never send it another: only
    /// [`BroadcastReader::recv`](crate::BroadcastReader::recv) and its
    /// variants return it. A store's reader has no such limit (holds are
    /// counted, not tabled); the name is older than that and stays, as a
    /// renamed variant would break every `match` on it.
    #[error("this reader already holds a message in each of the channel's {limit} slots; drop some before receiving more")]
    TooManyGuards {
        /// The channel's slots.
        limit: usize,
    },

    /// A tensor or item description that cannot be stored (shape and data
    /// disagree, too many dimensions, sizes overflow).
    #[error("invalid tensor: {0}")]
    InvalidTensor(String),

    /// An object's own header (tensor or item) does not describe bytes that
    /// fit the object: the segment was corrupted.
    #[error("corrupt object: {0}")]
    CorruptObject(String),

    /// `as_slice::<T>()` with a `T` of another dtype.
    #[error("tensor holds {expected:?}, not {requested:?}")]
    DTypeMismatch {
        /// The tensor's dtype.
        expected: crate::dtype::DType,
        /// The dtype asked for.
        requested: crate::dtype::DType,
    },

    /// `get_tensor` on an item, `get_item` on raw bytes, and so on.
    #[error("object is of kind {found:?}, not {expected:?}")]
    WrongKind {
        /// Kind asked for.
        expected: crate::layout::ObjectKind,
        /// Kind stored.
        found: crate::layout::ObjectKind,
    },

    /// `ItemView::field` with a name the item does not have.
    #[error("item has no field '{name}'")]
    NoSuchField {
        /// The name.
        name: String,
    },

    /// A device buffer or range that does not fit what it is copied to or from.
    #[error("device range: {0}")]
    DeviceRange(String),

    /// A device buffer of another device than the engine's.
    #[error(
        "device buffer belongs to device {buffer:#x}, the engine copies for device {engine:#x}"
    )]
    WrongDevice {
        /// The buffer's device.
        buffer: u64,
        /// The engine's device.
        engine: u64,
    },

    /// An asynchronous copy failed (or could not start).
    #[error("copy failed: {what}")]
    Copy {
        /// What failed.
        what: String,
        /// The driver's or engine's own error, where there is one.
        #[source]
        source: Option<BoxError>,
    },

    /// A device copy whose end cannot be confirmed (the driver failed to
    /// report it). The engine keeps the copy's memory alive for good, and
    /// the store never reuses its slot: it is retired, not freed. The
    /// device is usually unusable after this.
    #[error("device copy lost: {what}; its memory is kept for good")]
    DeviceLost {
        /// What failed.
        what: String,
        /// The driver's own error, where there is one.
        #[source]
        source: Option<BoxError>,
    },

    /// `PinMode::Require` without a way to pin.
    #[error("pinning required but not possible: {what}")]
    PinUnavailable {
        /// Why not.
        what: String,
        /// The driver's own error, where there is one.
        #[source]
        source: Option<BoxError>,
    },

    /// [`ObjectStore::finish_put`](crate::ObjectStore::finish_put) or
    /// [`try_finish_put`](crate::ObjectStore::try_finish_put) with a
    /// [`PendingPut`](crate::store::PendingPut) that is not pending in this store:
    /// finished already, or another store's. Nothing was changed.
    #[error("put {id} is not pending in this store: {reason}")]
    PutNotPending {
        /// The put's id.
        id: u64,
        /// Why.
        reason: &'static str,
    },

    /// An operating-system call failed.
    #[error("{op} on segment '{name}' failed: {source}")]
    Os {
        /// The call.
        op: &'static str,
        /// The segment name.
        name: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// A lower layer's error kept as the source of an [`Error`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

impl Error {
    /// An [`Error::Copy`] with no underlying error.
    pub(crate) fn copy(what: impl Into<String>) -> Error {
        Error::Copy {
            what: what.into(),
            source: None,
        }
    }

    /// An [`Error::Copy`] caused by `source`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn copy_from(what: impl Into<String>, source: impl Into<BoxError>) -> Error {
        Error::Copy {
            what: what.into(),
            source: Some(source.into()),
        }
    }

    /// An [`Error::PinUnavailable`], with its cause where there is one.
    pub(crate) fn pin_unavailable(what: impl Into<String>, source: Option<BoxError>) -> Error {
        Error::PinUnavailable {
            what: what.into(),
            source,
        }
    }

    /// Whether this is [`Error::Stale`], the error callers treat as a miss.
    pub fn is_stale(&self) -> bool {
        matches!(self, Error::Stale { .. })
    }
}
