"""Type stubs of the native module pinshm._pinshm."""

import builtins
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import (
    Any,
    Callable,
    ClassVar,
    Literal,
    Optional,
    Protocol,
    TypeVar,
    final,
)

from typing_extensions import Buffer

_T = TypeVar("_T")

__all__ = [
    "__version__",
    "PinshmError",
    "StaleError",
    "FullError",
    "NoSpaceError",
    "WaitTimeoutError",
    "KeyNotFoundError",
    "WrongKindError",
    "InvalidArgumentError",
    "WriterGoneError",
    "CancelledError",
    "ObjectHandle",
    "StoreHandle",
    "BroadcastHandle",
    "ObjectStore",
    "StoreReader",
    "ReadGuard",
    "Lease",
    "TensorReservation",
    "Broadcast",
    "BroadcastReader",
    "MessageView",
    "signature_bytes",
    "set_release_gate",
    "has_release_gate",
    "flush_releases",
    "inspect_segment",
    "cuda_status",
]

__version__: str

class PinshmError(Exception): ...
class StaleError(PinshmError, ValueError): ...
class FullError(PinshmError, MemoryError): ...
class NoSpaceError(PinshmError, MemoryError): ...
class WaitTimeoutError(PinshmError, builtins.TimeoutError): ...
class KeyNotFoundError(PinshmError, KeyError): ...
class WrongKindError(PinshmError, TypeError): ...
class InvalidArgumentError(PinshmError, ValueError): ...
class WriterGoneError(PinshmError): ...
class CancelledError(PinshmError): ...

def signature_bytes(signature: object) -> Optional[bytes]:
    """The 32 bytes of a vLLM handle signature (a list of 32 ints in
    0..=255, no bools), or None for anything else."""

# A PyO3 class: it cannot be subclassed.
@final
class ObjectHandle:
    def __new__(cls, address: int, monotonic_id: int, epoch: int) -> ObjectHandle: ...
    @property
    def address(self) -> int: ...
    @property
    def monotonic_id(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

# A PyO3 class: it cannot be subclassed.
@final
class StoreHandle:
    def __new__(
        cls,
        name: str,
        nonce: int,
        capacity: int,
        max_object_size: int,
        n_readers: int,
        layout_version: int,
    ) -> StoreHandle: ...
    @staticmethod
    def of(name: str) -> StoreHandle: ...
    @property
    def name(self) -> str: ...
    @property
    def nonce(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def max_object_size(self) -> int: ...
    @property
    def n_readers(self) -> int: ...
    @property
    def layout_version(self) -> int: ...

# A PyO3 class: it cannot be subclassed.
@final
class BroadcastHandle:
    def __new__(
        cls, name: str, nonce: int, layout_version: int, n_readers: int, slots: int, slot_size: int
    ) -> BroadcastHandle: ...
    @property
    def name(self) -> str: ...
    @property
    def nonce(self) -> int: ...
    @property
    def layout_version(self) -> int: ...
    @property
    def n_readers(self) -> int: ...
    @property
    def slots(self) -> int: ...
    @property
    def slot_size(self) -> int: ...

# A PyO3 class: it cannot be subclassed.
@final
class ObjectStore:
    def __new__(
        cls,
        capacity: int,
        max_object_size: int,
        n_readers: int,
        name: Optional[str] = None,
        aggregate_reads: bool = False,
        *,
        reserve: bool = True,
        prefault: Optional[bool] = None,
        eviction: Literal["fifo", "second_chance"] = "second_chance",
        pin: Literal["auto", "off", "require"] = "auto",
        shm_headroom: int = 0,
        cache: bool = False,
        key_index: int = 0,
    ) -> ObjectStore: ...
    def put(self, key: str, data: Buffer) -> ObjectHandle: ...
    def put_parts(self, key: str, parts: Iterable[Buffer]) -> ObjectHandle:
        """Stores the bytes of every part, one after the other, as ONE object
        (what `put(key, b"".join(parts))` stores), copied once each, straight
        into the slot. Errors as `put`; a part that is not one contiguous
        buffer raises its exporter's error (ValueError or BufferError),
        naming the part."""
    def put_tensor(self, key: str, array: Any) -> ObjectHandle: ...
    def put_item(self, key: str, fields: Mapping[str, Any], meta: Optional[Mapping[str, str]] = None) -> ObjectHandle:
        """Stores a multimodal item as one object: `fields` maps names to
        C-contiguous numpy arrays (little-endian integers, floats, bool),
        kept in the mapping's order; `meta` maps str to str (the item format
        stores string metadata only: convert numbers yourself). The format
        is Rust's `put_item`'s, so Rust readers read it too."""
    def reserve_tensor(self, key: str, dtype: str, shape: Sequence[int]) -> TensorReservation:
        """Reserves a slot for a tensor of `dtype` (torch's names: "float32",
        "bfloat16", ...) and `shape` under `key`, its bytes to be written in
        place (through the reservation's writable buffer); `publish` it
        then. Errors as `put`."""
    def publish(self, reservation: TensorReservation) -> ObjectHandle:
        """Publishes a reservation whose bytes are written. BufferError while
        an export of it is alive; ValueError if published or aborted."""
    def is_cached(self, key: str) -> bool: ...
    def get_cached(self, key: str) -> Optional[ObjectHandle]: ...
    def add_reference(self, key: str) -> None:
        """One more reference to `key`: each reader owes one more read."""
    def lookup(self, key: str) -> Optional[ObjectHandle]: ...
    def keys(self) -> list[tuple[str, ObjectHandle]]: ...
    def __len__(self) -> int: ...
    def peek(self, handle: ObjectHandle) -> bytes: ...
    def protect(self, key: str) -> None: ...
    def release_protections(self) -> None: ...
    def free_unused(self) -> int: ...
    def clear(self) -> None: ...
    def clear_hard(self) -> None: ...
    def signature(self, key: str) -> Optional[bytes]: ...
    def verify(self, key: str, handle: ObjectHandle, signature: bytes) -> bool: ...
    def stats(self) -> dict[str, Optional[int | str]]: ...
    SLOT_ALIGN: ClassVar[int]
    @staticmethod
    def slot_len(n_readers: int, payload: int) -> int: ...
    @staticmethod
    def largest_object(capacity: int, n_readers: int) -> int: ...
    def handle(self) -> StoreHandle: ...
    @property
    def name(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...
    def __enter__(self: _T) -> _T: ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

# A PyO3 class: it cannot be subclassed.
@final
class ReadGuard:
    """A held read: exports the object's bytes (read-only) through the buffer protocol.

    Each export holds the read through its owner (`view.obj`), so the read
    ends when the guard is released and every export is gone. `release()`
    raises BufferError while an export (or an object keeping its
    `view.obj`) is alive. In a child forked after the guard was made,
    reading it (`bytes`, new exports) raises PinshmError; exports made
    before the fork are not protected there. A `with` block left by an
    exception never raises BufferError from `__exit__`: it drops the
    guard's hold and lets live exports keep the read."""

    @property
    def handle(self) -> ObjectHandle: ...
    @property
    def released(self) -> bool: ...
    def release(self) -> None: ...
    def tensor_meta(self) -> tuple[str, tuple[int, ...], int]:
        """`(dtype, shape, offset)` of the tensor read: its dtype's name
        (torch's), its shape, and where its elements start in the guard's
        bytes. WrongKindError if it is not a tensor."""
    def __bytes__(self) -> bytes: ...
    def __len__(self) -> int: ...
    # The buffer protocol (C slots): Python 3.12+ shows it as these two
    # dunders, 3.11 does not (see python/stubtest-allowlist.txt).
    def __buffer__(self, flags: int) -> memoryview: ...
    def __release_buffer__(self, view: memoryview) -> None: ...
    def __enter__(self: _T) -> _T: ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]] = None,
        exc: Optional[BaseException] = None,
        tb: Optional[TracebackType] = None,
    ) -> bool: ...

# A PyO3 class: it cannot be subclassed.
@final
class Lease:
    """An object kept in the store, unread, until `release()` (or the end
    of a `with` block, or garbage collection). A dead process's leases
    count for nothing."""

    @property
    def handle(self) -> ObjectHandle: ...
    @property
    def released(self) -> bool: ...
    def release(self) -> None: ...
    def __enter__(self: _T) -> _T: ...
    def __exit__(self, *_exc: object) -> bool: ...

# A PyO3 class: it cannot be subclassed.
@final
class TensorReservation:
    """A reserved slot (`ObjectStore.reserve_tensor`): write the tensor's
    bytes through the (writable) buffer protocol, then `ObjectStore.publish`.
    Dropped unpublished (`abort()` or garbage collection), the slot is
    reclaimed in turn."""

    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    def abort(self) -> None: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int) -> memoryview: ...
    def __release_buffer__(self, view: memoryview) -> None: ...

# A PyO3 class: it cannot be subclassed.
@final
class StoreReader:
    @staticmethod
    def attach(
        store_handle: StoreHandle,
        index: Optional[int] = None,
        *,
        pin: Literal["auto", "off", "require"] = "auto",
        read_only_views: bool = False,
    ) -> StoreReader: ...
    @staticmethod
    def attach_by_name(
        name: str,
        *,
        pin: Literal["auto", "off", "require"] = "auto",
        read_only_views: bool = False,
    ) -> StoreReader: ...
    def get(self, handle: ObjectHandle) -> ReadGuard: ...
    def lookup(self, key: str) -> Optional[ObjectHandle]:
        """The handle of `key`'s object from the store's shared key index
        (`key_index=` at create), without the writer; None on a miss. Never
        another key's object. PinshmError if the store has no key index."""
    def lease(self, handle: ObjectHandle) -> Lease:
        """Keeps the object from being reclaimed, unread, until the lease
        is released. StaleError if it is gone."""
    def lease_key(self, key: str) -> Optional[Lease]:
        """Looks `key` up and leases its object in one step; None on a miss."""
    @property
    def is_pinned(self) -> bool: ...
    def get_tensor(self, handle: ObjectHandle) -> Any:
        """A read-only numpy array over the slot (no copy) that holds the read
        until it is garbage collected. `torch.from_dlpack(array)` shares the
        slot too (no copy) and holds the read as long as the tensor lives;
        torch has no read-only tensors, so never write to that tensor (it
        would change the object every reader sees)."""
    def get_item(self, handle: ObjectHandle) -> tuple[dict[str, Any], dict[str, str]]:
        """An item (from `put_item`, here or in Rust) as `(fields, meta)`:
        `fields` maps each name, in the item's order, to a read-only numpy
        array over the slot (no copy); `meta` maps str to str. The arrays
        hold the read until the last of them is garbage collected.
        TypeError if the object is not an item, or a field is bfloat16."""
    def get_copy(self, handle: ObjectHandle) -> bytes: ...
    def get_copy_into(self, handle: ObjectHandle, buffer: Buffer) -> int: ...
    def acknowledge(self, handle: ObjectHandle) -> None:
        """Acknowledges one read of `handle` without reading it."""
    def validate(self, handle: ObjectHandle) -> None: ...
    def verify(self, key: str, handle: ObjectHandle, signature: bytes) -> bool: ...
    @property
    def epoch(self) -> int: ...
    @property
    def index(self) -> int: ...
    @property
    def name(self) -> str: ...
    def close(self) -> None: ...
    def __enter__(self: _T) -> _T: ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

# A PyO3 class: it cannot be subclassed.
@final
class Broadcast:
    def __new__(
        cls,
        n_readers: int,
        slots: int,
        slot_size: int,
        name: Optional[str] = None,
        *,
        reserve: bool = False,
    ) -> Broadcast: ...
    def send(self, data: Buffer, timeout: Optional[float] = None) -> None: ...
    def unlink(self) -> None:
        """Removes the channel's name from /dev/shm now; the channel keeps
        working for the readers already attached (no new reader can attach).
        Call it once every reader has attached, and a crash of any process
        leaves nothing behind. Idempotent."""
    def try_send(self, data: Buffer) -> bool: ...
    def send_parts(self, parts: Iterable[Buffer], timeout: Optional[float] = None) -> None:
        """One message of the parts' bytes in order, gathered straight into the slot."""
        ...
    def cancel(self) -> None: ...
    def blocking_readers(self) -> list[tuple[int, Optional[int]]]: ...
    @property
    def attached_readers(self) -> int: ...
    def handle(self) -> BroadcastHandle: ...
    @property
    def sent(self) -> int: ...
    @property
    def name(self) -> str: ...
    def close(self) -> None: ...
    def __enter__(self: _T) -> _T: ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

# A PyO3 class: it cannot be subclassed.
@final
class MessageView:
    """A channel message in place: exports its bytes (read-only) through the buffer protocol.

    While it (or an export of it) lives, the writer cannot reuse its slot.
    `release()` raises BufferError while an export is alive; in a forked
    child reading it raises PinshmError."""

    @property
    def seq(self) -> int: ...
    @property
    def released(self) -> bool: ...
    def release(self) -> None: ...
    def __bytes__(self) -> bytes: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int) -> memoryview: ...
    def __release_buffer__(self, view: memoryview) -> None: ...
    def __enter__(self: _T) -> _T: ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]] = None,
        exc: Optional[BaseException] = None,
        tb: Optional[TracebackType] = None,
    ) -> bool: ...

# A PyO3 class: it cannot be subclassed.
@final
class BroadcastReader:
    @staticmethod
    def attach(handle: BroadcastHandle, index: Optional[int] = None) -> BroadcastReader: ...
    def recv(self, timeout: Optional[float] = None) -> MessageView:
        """The next message in place (no copy), held until released."""
        ...
    def recv_bytes(self, timeout: Optional[float] = None) -> bytes:
        """The next message as a copy."""
        ...
    def try_recv(self) -> Optional[MessageView]: ...
    def try_recv_bytes(self) -> Optional[bytes]: ...
    def cancel(self) -> None:
        """Ends a blocked recv (another thread) at once, and every later one, with CancelledError."""
        ...
    @property
    def index(self) -> int: ...
    @property
    def name(self) -> str: ...
    def close(self) -> None: ...
    def __enter__(self: _T) -> _T: ...
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

class _Event(Protocol):
    def query(self) -> bool: ...

def set_release_gate(gate: Optional[Callable[[], Optional[_Event]]]) -> None:
    """Sets (None: clears) the release gate: called when a read's last view
    goes; it returns None (release now) or an event whose `query()` says
    when a device copy from the slot has completed (a torch.cuda.Event
    recorded on the current stream, say). The read is acknowledged, and
    its slot given back, only then: pending reads are polled, never waited
    for, by a release thread of this process (about every millisecond
    while any is pending, so a completed read is released with no further
    call), on gets, by `flush_releases()` and by `StoreReader.close()`. A
    pending read keeps its reader attached, closed or not, until its event
    completes. Copies out (`get_copy`, `get_copy_into`) are never gated."""

def _exit_door_passing() -> int:
    """Threads of this fork generation between the exit door and the GIL (tests)."""
    ...

def has_release_gate() -> bool:
    """Whether a release gate is set (`set_release_gate`)."""

def flush_releases() -> int:
    """Ends every pending gated read whose event has completed; returns how
    many are still pending. Waits for a poll under way (the release
    thread's), never for an event."""

def inspect_segment(name: str, handles: Optional[Iterable[tuple[int, int]]] = None) -> dict[str, Any]:
    """Segment `name` (as in /dev/shm/NAME), read-only, through the crate's
    inspector (the Rust `pinshm-inspect`'s): header fields, `readers` and
    `slots` (lists of dicts, with `holds` and `reads_owed` per slot), the
    oldest `blocker` (None: nothing in use), the text `report`, and in
    `explanations` what happened to each `(address, id)` of `handles`."""

def cuda_status() -> dict[str, Any]:
    """`feature` (built with CUDA support), `driver` (libcuda loads) and
    `driver_version` (`major * 1000 + minor * 10`, or None)."""
