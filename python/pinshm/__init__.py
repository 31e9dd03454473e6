"""pinshm: a single-writer, many-reader object store and a broadcast
channel in named shared memory (/dev/shm), with zero-copy reads.

The native module is ``pinshm._pinshm``; everything public in it is
re-exported here: the classes, the exceptions, the release gate, and the
tools behind ``python -m pinshm`` (``cuda_status``; ``inspect_segment``
and ``gc_segments`` come typed from ``pinshm.segments``). ``signature_bytes`` (a vLLM handle signature's bytes) is
the vLLM drop-in's and stays in ``pinshm._pinshm``; a test checks that
nothing else is left out.
"""

from ._pinshm import (
    Broadcast,
    BroadcastHandle,
    BroadcastReader,
    CancelledError,
    FullError,
    InUseError,
    InvalidArgumentError,
    KeyNotFoundError,
    Lease,
    MessageView,
    NoSpaceError,
    NotFoundError,
    ObjectHandle,
    ObjectStore,
    PendingSave,
    PinshmError,
    PrivateView,
    ReadGuard,
    StaleError,
    StoreHandle,
    StoreReader,
    TensorReservation,
    UntrustedError,
    WaitTimeoutError,
    WriterGoneError,
    WrongKindError,
    __version__,
    cuda_status,
    flush_releases,
    has_release_gate,
    set_release_gate,
)
from .segments import gc_segments, inspect_segment

__all__ = [
    "Broadcast",
    "BroadcastHandle",
    "BroadcastReader",
    "CancelledError",
    "FullError",
    "InUseError",
    "InvalidArgumentError",
    "KeyNotFoundError",
    "Lease",
    "MessageView",
    "NoSpaceError",
    "NotFoundError",
    "ObjectHandle",
    "ObjectStore",
    "PendingSave",
    "PinshmError",
    "ReadGuard",
    "PrivateView",
    "StaleError",
    "StoreHandle",
    "StoreReader",
    "TensorReservation",
    "WaitTimeoutError",
    "UntrustedError",
    "WriterGoneError",
    "WrongKindError",
    "__version__",
    "cuda_status",
    "flush_releases",
    "gc_segments",
    "has_release_gate",
    "inspect_segment",
    "set_release_gate",
]
