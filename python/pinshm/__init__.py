"""pinshm: a single-writer, many-reader object store and a broadcast
channel in named shared memory (/dev/shm), with zero-copy reads.

The native module is ``pinshm._pinshm``; everything public is re-exported
here.
"""

from ._pinshm import (
    Broadcast,
    BroadcastHandle,
    BroadcastReader,
    CancelledError,
    FullError,
    InvalidArgumentError,
    KeyNotFoundError,
    Lease,
    MessageView,
    NoSpaceError,
    ObjectHandle,
    ObjectStore,
    PendingSave,
    PinshmError,
    ReadGuard,
    StaleError,
    StoreHandle,
    StoreReader,
    TensorReservation,
    WaitTimeoutError,
    WriterGoneError,
    WrongKindError,
    __version__,
    flush_releases,
    has_release_gate,
    set_release_gate,
)

__all__ = [
    "Broadcast",
    "BroadcastHandle",
    "BroadcastReader",
    "CancelledError",
    "FullError",
    "InvalidArgumentError",
    "KeyNotFoundError",
    "Lease",
    "MessageView",
    "NoSpaceError",
    "ObjectHandle",
    "ObjectStore",
    "PendingSave",
    "PinshmError",
    "ReadGuard",
    "StaleError",
    "StoreHandle",
    "StoreReader",
    "TensorReservation",
    "WaitTimeoutError",
    "WriterGoneError",
    "WrongKindError",
    "__version__",
    "flush_releases",
    "has_release_gate",
    "set_release_gate",
]
