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
    "NotFoundError",
    "WrongKindError",
    "InvalidArgumentError",
    "InUseError",
    "UntrustedError",
    "WriterGoneError",
    "CancelledError",
    "ObjectHandle",
    "StoreHandle",
    "BroadcastHandle",
    "ObjectStore",
    "StoreReader",
    "ReadGuard",
    "PrivateView",
    "Lease",
    "TensorReservation",
    "PendingSave",
    "Broadcast",
    "BroadcastReader",
    "MessageView",
    "signature_bytes",
    "set_release_gate",
    "has_release_gate",
    "flush_releases",
    "cuda_status",
    "_exit_door_passing",
    "_remove_if_abandoned_file",
    "_inspect_segment",
    "_gc_segments",
    "_digest",
    "_Digest",
    "_sandbox",
    "_drop_uid",
]

__version__: str
"""The version of the pinshm crate this module was built from."""

class PinshmError(Exception):
    """Base of every pinshm error; most are also a builtin (see the subclasses).

    Raised as itself for the rest: a segment that is missing or not
    pinshm's, a name taken, every reader entry taken, an object made
    before a fork() used in the child (attach anew there). The message
    says what happened and what to do."""

class StaleError(PinshmError, ValueError):
    """The handle names an object that is gone (reclaimed, overwritten,
    cleared, of another segment or epoch) or never existed. Treat it as a
    cache miss: produce or fetch the object again."""

class FullError(PinshmError, MemoryError):
    """The data region is full of objects still owed reads, held (guards, views,
    leases) or protected; nothing was stored. The message names the oldest
    blocker. Retry once readers read or release, or go on uncached."""

class NoSpaceError(PinshmError, MemoryError):
    """/dev/shm has no room for the pages this put or send would write (or
    for a reserved segment at creation). The store or channel is unchanged
    and works again once space is free: free some, or use a smaller segment."""

class WaitTimeoutError(PinshmError, builtins.TimeoutError):
    """A send or receive (or `PendingSave.wait`) gave up after its timeout;
    nothing was sent or received. Call again, or find out why the other
    side is slow (`Broadcast.blocking_readers()`)."""

class KeyNotFoundError(PinshmError, KeyError):
    """The store holds no object under that key (`add_reference`,
    `protect`): put it first, or treat it as a miss."""

class NotFoundError(PinshmError, FileNotFoundError):
    """No segment of that name exists (`attach_by_name`, `StoreHandle.of`,
    `inspect_segment`): the writer has not created it yet, or it is gone."""

class WrongKindError(PinshmError, TypeError):
    """The object is not of the kind asked for (not a tensor, not an item,
    another dtype): read it with the call for its kind (`get()` for bytes)."""

class InvalidArgumentError(PinshmError, ValueError):
    """An argument pinshm refuses: a key already stored or pending (use
    `get_cached` to reference it again), an object larger than
    `max_object_size` or a message larger than `slot_size`, a bad
    configuration or segment name, a reader index out of range, a
    malformed tensor. Fix the argument; nothing was changed."""

class InUseError(PinshmError, FileExistsError):
    """A segment's name is taken: by a live writer's segment (its writer
    holds the lock), by one being created, or by a file that is not a
    pinshm segment of this user's to replace. Nothing was changed: pick
    another name, or remove the file if no process uses it."""

class UntrustedError(PinshmError):
    """A segment opened by name that this process must not trust: another
    user's (PINSHM_TRUSTED_UIDS names the uids to trust on purpose),
    writable by others, or not a regular file (a FIFO)."""

class WriterGoneError(PinshmError):
    """The writer of the segment has exited or died. What it published or
    sent before is still readable; nothing new will come: attach to its
    successor."""

class CancelledError(PinshmError):
    """A blocking send or receive ended because `cancel()` was called (a
    shutdown); nothing was sent or received, and every later wait of the
    same writer or reader ends the same way."""

def signature_bytes(signature: object) -> Optional[bytes]:
    """The 32 bytes of a vLLM handle signature (a list of 32 ints in
    0..=255, no bools), or None for anything else."""

# A PyO3 class: it cannot be subclassed.
@final
class ObjectHandle:
    """Where an object lives: `(address, monotonic_id, epoch)`, what the
    writer sends its readers instead of the bytes. Immutable, hashable and
    picklable; it names the object, it does not keep it (a `get` of a
    handle whose object is gone raises StaleError)."""

    def __new__(cls, address: int, monotonic_id: int, epoch: int) -> ObjectHandle:
        """A handle from its fields (as unpickling makes it): a handle known
        only by address and id, as vLLM sends them, is rebuilt with the
        reader's `epoch`."""
    @property
    def address(self) -> int:
        """Offset of the object's slot in the data region, in bytes."""
    @property
    def monotonic_id(self) -> int:
        """The object's id, never reused within a segment's life."""
    @property
    def epoch(self) -> int:
        """The store's epoch when the object was put (new at create and at
        every `clear_hard`)."""
    def __eq__(self, other: object) -> bool:
        """Whether `other` is a handle with the same three fields."""
    def __hash__(self) -> int:
        """A hash of the three fields: handles work as dict keys."""

# A PyO3 class: it cannot be subclassed.
@final
class StoreHandle:
    """Everything a reader process needs to attach to a store
    (`StoreReader.attach`): from `ObjectStore.handle()` or
    `StoreHandle.of(name)`. Immutable, hashable and picklable."""

    def __new__(
        cls,
        name: str,
        nonce: int,
        capacity: int,
        max_object_size: int,
        n_readers: int,
        layout_version: int,
    ) -> StoreHandle:
        """A handle from its fields (as unpickling makes it); prefer
        `ObjectStore.handle()` or `StoreHandle.of`, which read them from
        the store."""
    @staticmethod
    def of(name: str) -> StoreHandle:
        """The handle of the live store segment `name` (in /dev/shm), read
        from its header. PinshmError if there is no such segment or it is
        not a pinshm store."""
    @property
    def name(self) -> str:
        """Segment name (in /dev/shm)."""
    @property
    def nonce(self) -> int:
        """The segment's creation nonce: a store recreated under the same
        name has another, and attaching with the old handle raises
        PinshmError (get a new handle from the writer)."""
    @property
    def capacity(self) -> int:
        """Bytes of the data region (`capacity`)."""
    @property
    def max_object_size(self) -> int:
        """The largest object the store takes, in bytes."""
    @property
    def n_readers(self) -> int:
        """Reader entries in the segment: at most this many readers at once."""
    @property
    def layout_version(self) -> int:
        """The writer's segment layout version; a reader built for another
        refuses to attach (PinshmError)."""

# A PyO3 class: it cannot be subclassed.
@final
class BroadcastHandle:
    """Everything a reader process needs to attach to a broadcast channel
    (`BroadcastReader.attach`): from `Broadcast.handle()`. Immutable,
    hashable and picklable."""

    def __new__(
        cls, name: str, nonce: int, layout_version: int, n_readers: int, slots: int, slot_size: int
    ) -> BroadcastHandle:
        """A handle from its fields (as unpickling makes it); prefer
        `Broadcast.handle()`."""
    @property
    def name(self) -> str:
        """Segment name (in /dev/shm)."""
    @property
    def nonce(self) -> int:
        """The channel's nonce: a channel recreated under the same name has
        another (attaching with the old handle raises PinshmError)."""
    @property
    def layout_version(self) -> int:
        """The writer's channel layout version."""
    @property
    def n_readers(self) -> int:
        """Reader entries: every message is for this many readers."""
    @property
    def slots(self) -> int:
        """Message slots in the ring."""
    @property
    def slot_size(self) -> int:
        """The largest message, in bytes."""

# A PyO3 class: it cannot be subclassed.
@final
class ObjectStore:
    """The writer of a store: one per segment, in one process. Puts objects
    under keys into a data region in shared memory; readers in other processes
    (`StoreReader`) read them in place by handle. Close it (or use `with`)
    to unlink the segment. Calls in a forked child raise PinshmError."""

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
        back_ahead: Optional[int] = None,
        reap: bool = True,
    ) -> ObjectStore:
        """Creates the segment (`capacity` bytes of data region, objects up to
        `max_object_size` bytes, `n_readers` readers, 1 to 1024; `name` in
        /dev/shm, default unique) and becomes its writer. `aggregate_reads`:
        an object referenced k times is done after k × n_readers reads
        from any readers (vLLM's count), not k from each.

        `reserve` takes every page of /dev/shm now (`prefault`, default as
        `reserve`, also maps them in); `reserve=False` makes it sparse: a
        full /dev/shm then raises NoSpaceError from the put that needs the
        page, and `shm_headroom` (bytes) is left free there. `eviction`:
        "second_chance" (a hit keeps an object one more lap) or "fifo".
        `pin`: "auto" (pin a reserved segment where CUDA is there), "off",
        "require" (pin or raise). `cache=True`: objects owe no reads (not
        with `aggregate_reads`); `key_index=N`: room for N keys readers
        look up themselves (`StoreReader.lookup`). `back_ahead`: bytes a
        sparse store's background thread keeps backed past the last put,
        so a put into fresh pages needs no page allocation (None: the
        default, `DEFAULT_BACK_AHEAD`; 0: off). `reap` (default True):
        this process's reaper removes the segment after the process dies,
        SIGKILL included; False leaves it (a store that outlives its
        writer; `pinshm gc` removes it once its writer is gone).

        InvalidArgumentError for a bad configuration or name, ValueError
        for an unknown `eviction` or `pin`, NoSpaceError where /dev/shm
        cannot hold a reserved segment, PinshmError if the name is taken
        or pinning is required and impossible."""
    def put(self, key: str, data: Buffer) -> ObjectHandle:
        """Stores the bytes of `data` (any contiguous buffer: bytes,
        bytearray, memoryview, a C-contiguous numpy array) under `key`,
        copied once, into the slot; returns its handle. Each reader owes
        one read. InvalidArgumentError if `key` is stored or pending, or
        `data` is larger than `max_object_size`; FullError; NoSpaceError."""
    def put_parts(self, key: str, parts: Iterable[Buffer]) -> ObjectHandle:
        """Stores the bytes of every part, one after the other, as ONE object
        (what `put(key, b"".join(parts))` stores), copied once each, straight
        into the slot. Errors as `put`; a part that is not one contiguous
        buffer raises its exporter's error (ValueError or BufferError),
        naming the part."""
    def put_tensor(self, key: str, array: Any) -> ObjectHandle:
        """Stores a C-contiguous numpy array (little-endian integers,
        floats, bool) as a tensor: dtype and shape in a header, then the
        elements, 64-byte aligned, in the format Rust's `put_tensor`
        writes (`StoreReader.get_tensor` reads it). ValueError for another
        dtype; errors otherwise as `put`. Not `pinshm.device.put_tensor`,
        which takes a torch tensor on any device, can queue the copy
        (`wait=False`) and is a module function: the same object format,
        another contract."""
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
    def reserve_bytes(self, key: str, nbytes: int) -> TensorReservation:
        """Reserves a slot of `nbytes` bytes under `key`, written through the
        reservation's buffer by any means (torch's `copy_` on its intra-op
        threads, say), then `publish`ed: what `put(key, bytes)` of the same
        bytes stores. Its `dtype` reads "uint8", its `shape` `(nbytes,)`.
        Errors as `put`."""
    def publish(self, reservation: TensorReservation) -> ObjectHandle:
        """Publishes a reservation whose bytes are written. BufferError while
        an export of it is alive; ValueError if published or aborted."""
    def publish_after(
        self, reservation: TensorReservation, event: Optional[_Event], staged: Optional[Buffer] = None
    ) -> PendingSave:
        """Publishes a reservation once `event.query()` returns true (a
        device-to-host copy queued into it, not waited for): pinshm's
        poller thread, and every flush, queries the event; never published
        before. Until then the key is pending (`is_pending`): `is_cached`,
        `get_cached` and readers miss it, and a put of it raises. If
        `query()` raises, the reservation is aborted: key and slot free at
        once. `event=None` publishes now. `staged`: a buffer of the
        reservation's length that the copy writes instead of the slot
        (pinned staging, for a slot that is not pinned), copied into the
        slot once the event has completed. Errors as `publish`. `close()`
        discards saves still pending; `flush_pending()` publishes them."""
    def abort(self, reservation: TensorReservation) -> None:
        """Gives a reservation back unpublished: its key and its slot are
        free at once (the slot when its last view goes, if one is alive).
        Again, or after `publish`, does nothing."""
    def is_pending(self, key: str) -> bool:
        """Whether a save of `key` is in flight: reserved (or queued by
        `publish_after`), not yet published, nor aborted or failed."""
    def flush_pending(self, timeout: Optional[float] = None) -> int:
        """Waits until every save queued by `publish_after` is over (at most
        `timeout` seconds; None: no limit); returns how many are still
        pending."""
    def is_cached(self, key: str) -> bool:
        """Whether `key` is stored (False while its save is pending)."""
    def get_cached(self, key: str) -> Optional[ObjectHandle]:
        """The handle of `key`, counting one more reference (each reader
        owes one more read; in a cache, a hit only), or None if it is not
        stored. Ends a `protect` of the key."""
    def add_reference(self, key: str) -> None:
        """One more reference to `key`: each reader owes one more read."""
    def lookup(self, key: str) -> Optional[ObjectHandle]:
        """The handle of `key`, counting no reference, or None (vLLM's
        `key_index[key]`)."""
    def keys(self) -> list[tuple[str, ObjectHandle]]:
        """Every stored `(key, handle)`, in no particular order."""
    def __len__(self) -> int:
        """How many keys are stored."""
    def peek(self, handle: ObjectHandle) -> bytes:
        """A copy of the bytes of `handle`, read by the writer itself: no
        read is counted (vLLM's writer-side `get`). StaleError if `handle`
        is not a live object of this store."""
    def protect(self, key: str) -> None:
        """Keeps `key` from eviction until its next `get_cached` or
        `release_protections()` (vLLM's writer `touch`); adds no read.
        KeyNotFoundError if it is not stored."""
    def release_protections(self) -> None:
        """Ends every `protect`."""
    def free_unused(self) -> int:
        """Reclaims every object that every reader is done with (and nobody
        holds or protects); returns how many. A put reclaims what it needs
        by itself."""
    def clear(self) -> None:
        """Forgets every key (vLLM's soft clear): nothing is owed any more,
        and old handles read their own bytes until their slot is reused,
        then raise StaleError. Slots under a live guard are reused only
        once it is released."""
    def clear_hard(self) -> None:
        """Forgets every key and starts a new epoch: every old handle is
        stale at once. Slots under a live guard are freed once it is
        released."""
    def signature(self, key: str) -> Optional[bytes]:
        """The 32-byte signature of `key`'s handle (an HMAC-SHA256 with the
        store's secret, which readers check with `StoreReader.verify`), or
        None if `key` is not stored."""
    def verify(self, key: str, handle: ObjectHandle, signature: bytes) -> bool:
        """Whether `signature` signs `key` at `handle`, and `key` still maps
        to `handle`."""
    def stats(self) -> dict[str, Optional[int | str]]:
        """The writer's counters: `puts`, `hits`, `evictions`,
        `full_errors`, `objects`, `bytes_in_use`, `largest_free_block`,
        `dead_readers_reaped`, `stale_reads`, `nospace_fallbacks`,
        `indexed`, `unindexed` (ints), and `oldest_unread` (who blocks the
        oldest object, as text; None when nothing does)."""
    SLOT_ALIGN: ClassVar[int]
    """Slots start at, and a ring's capacity is a multiple of, this many
    bytes."""
    MAX_READERS: ClassVar[int]
    """The most readers a store serves (`n_readers` up to this, 1024)."""
    DEFAULT_BACK_AHEAD: ClassVar[int]
    """Bytes a sparse store's background thread keeps backed past the
    writer's last put by default (`back_ahead=None`; 0 turns it off)."""
    @staticmethod
    def slot_len(n_readers: int, payload: int) -> int:
        """Ring bytes one object of `payload` bytes takes with `n_readers`
        readers (slot header, read counters and alignment included): size a
        ring as a multiple of this. InvalidArgumentError for `n_readers`
        outside 1..=1024."""
    @staticmethod
    def largest_object(capacity: int, n_readers: int) -> int:
        """The largest `max_object_size` a ring of `capacity` bytes accepts
        with `n_readers` readers (0 when not even an empty object fits).
        InvalidArgumentError for `n_readers` outside 1..=1024."""
    def handle(self) -> StoreHandle:
        """What a reader process needs to attach (picklable: send it)."""
    def data_region(self) -> tuple[int, int]:
        """The writer's mapping of the store's data region as (address of
        its first byte, length in bytes): to register once with a transfer
        library (NIXL) that writes into reserved slots. A reservation lies
        inside it, at its buffer's address minus this one; write only the
        bytes of a reservation held, until it is published or aborted.
        PinshmError in a forked child."""
    @property
    def name(self) -> str:
        """The segment's name in /dev/shm."""
    @property
    def closed(self) -> bool:
        """Whether `close()` has run."""
    def unlink(self) -> None:
        """Removes the segment's name from /dev/shm now and keeps serving:
        readers already attached read on, new attaches by name fail, and
        nothing of the store is left once every process mapping it is gone,
        however each ends (SIGKILL included). Again does nothing."""
    def close(self) -> None:
        """Closes the store and unlinks its segment (readers already
        attached keep their mapping). Saves still pending are discarded,
        never published (`flush_pending()` first publishes them). Again,
        or in a forked child, does nothing. Later calls raise ValueError."""
    def __enter__(self: _T) -> _T:
        """The store itself."""
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool:
        """Closes the store (`close()`); never suppresses the exception."""

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
    def handle(self) -> ObjectHandle:
        """The handle this guard reads."""
    @property
    def released(self) -> bool:
        """Whether the guard's own hold is released (exports of it may
        still hold the read)."""
    def release(self) -> None:
        """Releases the read (acknowledging it; with a release gate set,
        once its event completes). BufferError while exports of the guard
        are alive: delete arrays and tensors, `memoryview.release()` the
        views, then release. Again does nothing."""
    def tensor_meta(self) -> tuple[str, tuple[int, ...], int]:
        """`(dtype, shape, offset)` of the tensor read: its dtype's name
        (torch's), its shape, and where its elements start in the guard's
        bytes. WrongKindError if it is not a tensor."""
    def __bytes__(self) -> bytes:
        """A copy of the object's bytes. ValueError once released."""
    def __len__(self) -> int:
        """The object's size in bytes."""
    # The buffer protocol (C slots): Python 3.12+ shows it as these two
    # dunders, 3.11 does not (see python/stubtest-allowlist.txt).
    def __buffer__(self, flags: int) -> memoryview:
        """A read-only export of the slot's bytes (no copy) that holds the
        read while it lives. BufferError once released."""
    def __release_buffer__(self, view: memoryview) -> None:
        """Ends an export (the read ends with the last one and the guard)."""
    def __enter__(self: _T) -> _T:
        """The guard itself."""
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]] = None,
        exc: Optional[BaseException] = None,
        tb: Optional[TracebackType] = None,
    ) -> bool:
        """Releases the read (`release()`); left by an exception, drops the
        guard's hold instead, never raising BufferError. Never suppresses."""

# A PyO3 class: it cannot be subclassed.
@final
class PrivateView:
    """An object's bytes, writable and private to this process
    (`StoreReader.get_private`): a copy-on-write mapping of the object's
    pages that reads the slot (no copy) until a page is written, then
    copies that page only, into memory no other process sees. A write
    never reaches the slot, another reader, or another view. Every export
    (`memoryview`, `numpy.frombuffer`, `torch.frombuffer`) keeps the view,
    and so the slot's hold, alive; the read is acknowledged when the last
    goes. Not pinned: a device copy from it is pageable. In a child forked
    after it was made its bytes fault and new exports raise PinshmError."""

    @property
    def handle(self) -> ObjectHandle:
        """The handle this view reads."""
    def __len__(self) -> int:
        """The object's size in bytes."""
    # The buffer protocol (C slots), as ReadGuard's.
    def __buffer__(self, flags: int) -> memoryview:
        """A writable export of the view's private bytes (no copy)."""
    def __release_buffer__(self, view: memoryview) -> None:
        """Ends an export (the view lives while any consumer keeps it)."""

# A PyO3 class: it cannot be subclassed.
@final
class Lease:
    """An object kept in the store, unread, until `release()` (or the end
    of a `with` block, or garbage collection). A dead process's leases
    count for nothing."""

    @property
    def handle(self) -> ObjectHandle:
        """The handle of the leased object (`StoreReader.get` reads it)."""
    @property
    def released(self) -> bool:
        """Whether the lease has ended."""
    def release(self) -> None:
        """Ends the lease; again does nothing. In a forked child the lease
        is the parent's: there this forgets it and releases nothing."""
    def __enter__(self: _T) -> _T:
        """The lease itself."""
    def __exit__(self, *_exc: object) -> bool:
        """Ends the lease (`release()`); never suppresses the exception."""

# A PyO3 class: it cannot be subclassed.
@final
class TensorReservation:
    """A reserved slot (`ObjectStore.reserve_tensor`): write the tensor's
    bytes through the (writable) buffer protocol, then `ObjectStore.publish`
    (or `publish_after`). Given back unpublished (`abort()`,
    `ObjectStore.abort`, or garbage collection), its key is free at once;
    its slot is reclaimed (at once by `ObjectStore.abort`, else in turn)."""

    @property
    def key(self) -> str:
        """The key it is reserved under."""
    @property
    def dtype(self) -> str:
        """The tensor's dtype name (torch's: "float32", "bfloat16", ...)."""
    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape."""
    def abort(self) -> None:
        """Gives the slot back unpublished; again does nothing. The key is
        free for another put at once; views still alive keep the slot
        (their bytes seen by nobody) until they go, then it is reclaimed
        in turn (`ObjectStore.abort` frees it at once)."""
    def __len__(self) -> int:
        """Bytes to write (0 once published or aborted)."""
    def __buffer__(self, flags: int) -> memoryview:
        """A writable export of the reserved bytes (no copy); nobody reads
        them before `publish`, which raises BufferError while an export is
        alive. BufferError once published or aborted."""
    def __release_buffer__(self, view: memoryview) -> None:
        """Ends an export."""

# A PyO3 class: it cannot be subclassed.
@final
class PendingSave:
    """A save whose copy may still be in flight (`ObjectStore.publish_after`,
    `pinshm.device.put_tensor(..., wait=False)`): pending until its event
    completes, then published. Dropping it changes nothing."""

    @property
    def key(self) -> str:
        """The key saved."""
    @property
    def state(self) -> Literal["pending", "published", "failed", "discarded"]:
        """One of "pending" (the copy may be in flight), "published",
        "failed" (the copy failed or the store was cleared: nothing
        published, key and slot free) or "discarded" (the store was closed
        first)."""
    @property
    def done(self) -> bool:
        """Whether the save is over (published, failed or discarded)."""
    @property
    def handle(self) -> Optional[ObjectHandle]:
        """The handle, once published; None before, or if it failed or was
        discarded."""
    @property
    def error(self) -> Optional[str]:
        """Why it failed, if it did; else None."""
    def wait(self, timeout: Optional[float] = None) -> ObjectHandle:
        """Waits until the save is over (at most `timeout` seconds) and
        returns its handle: PinshmError if it failed or was discarded,
        WaitTimeoutError if still pending."""

# A PyO3 class: it cannot be subclassed.
@final
class StoreReader:
    """One reader of a store, attached into a reader entry until closed.
    Reads objects in place (`get`, `get_tensor`, `get_item`) or as copies
    (`get_copy`); each read of an object acknowledges one read owed. Usable
    from several threads (serialised); made before a fork(), its calls in
    the child raise PinshmError."""

    @staticmethod
    def attach(
        store_handle: StoreHandle,
        index: Optional[int] = None,
        *,
        pin: Literal["auto", "off", "require"] = "auto",
        read_only_views: bool = False,
    ) -> StoreReader:
        """Attaches to the store of `store_handle` as reader `index`
        (default: the first free entry). `pin`: "auto" (pin this process's
        mapping of a reserved segment where CUDA is there), "off" or
        "require". `read_only_views`: views come from a read-only mapping,
        so a write through one (`torch.frombuffer` ignores the flag) faults
        instead of changing what other readers read. InvalidArgumentError
        for an index past `n_readers`; PinshmError if the segment is gone
        or recreated (get a new handle) or the entry is taken."""
    @staticmethod
    def attach_by_name(
        name: str,
        *,
        pin: Literal["auto", "off", "require"] = "auto",
        read_only_views: bool = False,
    ) -> StoreReader:
        """Attaches to the store segment `name` into the first free entry,
        its geometry read from the segment's header (`pin` and
        `read_only_views` as for `attach`). PinshmError if there is no such
        store or no free entry."""
    def get(self, handle: ObjectHandle) -> ReadGuard:
        """A zero-copy read of the object: a `ReadGuard` exporting its bytes
        through the buffer protocol, holding the slot until it and its
        exports are released. StaleError if the object is gone (a miss)."""
    def get_private(self, handle: ObjectHandle) -> PrivateView:
        """The object as this process's own writable copy that copies
        nothing until written (a `PrivateView`), holding the slot while it
        (or any export of it) lives: a tensor a consumer may change in place
        without changing what other readers read. StaleError if it is gone."""
    def lookup(self, key: str) -> Optional[ObjectHandle]:
        """The handle of `key`'s object from the store's shared key index
        (`key_index=` at create), without the writer; None on a miss. Never
        another key's object. A hit gives the object a second chance, as
        `get_key` does. PinshmError if the store has no key index."""
    def lease(self, handle: ObjectHandle) -> Lease:
        """Keeps the object from being reclaimed, unread, until the lease
        is released. StaleError if it is gone."""
    def lease_key(self, key: str) -> Optional[Lease]:
        """Looks `key` up and leases its object in one step; None on a miss."""
    @property
    def is_pinned(self) -> bool:
        """Whether this process's mapping of the store is page-locked (CUDA
        host-registered): then a tensor over a slot is pinned memory, and
        `.to(device, non_blocking=True)` from it is a DMA."""
    @property
    def pinning(self) -> Optional[dict[str, Any]]:
        """How this process's mapping was pinned while attaching, or None:
        "bytes", "chunks" (registration calls of at most 64 GiB) and
        "seconds" (about 0.1 per GiB)."""
    def get_tensor(self, handle: ObjectHandle) -> Any:
        """A read-only numpy array over the slot (no copy) that holds the read
        until it is garbage collected. `torch.from_dlpack(array)` shares the
        slot too (no copy) and holds the read as long as the tensor lives;
        torch has no read-only tensors, so never write to that tensor (it
        would change the object every reader sees). WrongKindError if the
        object is not a tensor; TypeError for bfloat16 (numpy has none:
        read it with `get()`); StaleError if it is gone. Zero copy, unlike
        `pinshm.device.get_tensor`, which copies to a device."""
    def get_item(self, handle: ObjectHandle) -> tuple[dict[str, Any], dict[str, str]]:
        """An item (from `put_item`, here or in Rust) as `(fields, meta)`:
        `fields` maps each name, in the item's order, to a read-only numpy
        array over the slot (no copy); `meta` maps str to str. The arrays
        hold the read until the last of them is garbage collected.
        TypeError if the object is not an item, or a field is bfloat16."""
    def get_copy(self, handle: ObjectHandle) -> bytes:
        """A copy of the object's bytes; the read is acknowledged on return
        (never gated by `set_release_gate`). StaleError if it is gone."""
    def get_copy_into(self, handle: ObjectHandle, buffer: Buffer) -> int:
        """Copies the object's bytes into the start of `buffer` (any
        writable contiguous buffer) and returns how many were written;
        the read is acknowledged (never gated). ValueError if `buffer` is
        smaller than the object (the read still counts); StaleError."""
    def acknowledge(self, handle: ObjectHandle) -> None:
        """Acknowledges one read of `handle` without reading it."""
    def validate(self, handle: ObjectHandle) -> None:
        """Checks that `handle` names a live object of this store,
        acknowledging nothing (vLLM's reader `touch`): StaleError if not."""
    def data_region(self) -> tuple[int, int]:
        """This process's mapping of the store's data region as (address
        of its first byte, length in bytes): to register once with a
        transfer library (NIXL) that reads payloads out of it. A payload
        lies inside it, at its guard's address minus this one. Valid while
        the reader (or a guard or lease it made) lives; read only what a
        guard or lease holds. PinshmError in a forked child."""
    def verify(self, key: str, handle: ObjectHandle, signature: bytes) -> bool:
        """Whether `signature` signs `key` at `handle` with this store's
        secret (`ObjectStore.signature`)."""
    @property
    def epoch(self) -> int:
        """The segment's current epoch, which every handle issued since the
        last hard clear carries: rebuild a handle known only by address and
        id (as vLLM sends them) with it."""
    def live_readers(self) -> list[tuple[int, int]]:
        """The segment's reader table as the writer counts it: `(entry
        index, pid)` of every entry attached by a process that still runs
        (its entry's lock held), this reader's own included, in index
        order. For a coordinator that waits until its workers read a
        segment; a snapshot, stale when it returns."""
    @property
    def index(self) -> int:
        """This reader's index (its reader entry)."""
    @property
    def name(self) -> str:
        """The store's segment name."""
    def close(self) -> None:
        """Detaches. Guards still held keep the reader attached until the
        last is released, and so do reads waiting for their release gate's
        events (released by the release thread once they complete). Again
        does nothing. Later calls raise ValueError."""
    def __enter__(self: _T) -> _T:
        """The reader itself."""
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool:
        """Detaches (`close()`); never suppresses the exception."""

# A PyO3 class: it cannot be subclassed.
@final
class Broadcast:
    """The writer of a broadcast channel: every message reaches every one
    of `n_readers` readers (`BroadcastReader`), in order, through a ring of
    `slots` slots in shared memory. A send waits while the slot it needs is
    still held by a reader. Calls in a forked child raise PinshmError."""

    def __new__(
        cls,
        n_readers: int,
        slots: int,
        slot_size: int,
        name: Optional[str] = None,
        *,
        reserve: bool = False,
        reap: bool = True,
    ) -> Broadcast:
        """Creates a channel for `n_readers` readers (1 to 64) with `slots`
        slots of messages up to `slot_size` bytes (`name` in /dev/shm,
        default unique). Sparse unless `reserve`: a full /dev/shm raises
        NoSpaceError from the send that needs the page, never SIGBUS.
        `reap` (default True): this process's reaper removes the segment
        after the process dies, SIGKILL included; False leaves it.
        InvalidArgumentError for a bad configuration or name; PinshmError
        if the name is taken."""
    def send(self, data: Buffer, timeout: Optional[float] = None) -> None:
        """Sends the bytes of `data` (any contiguous buffer) to every
        reader, waiting (GIL released) while the slot it needs is held;
        `timeout` in seconds (None: no limit). WaitTimeoutError past it,
        CancelledError after `cancel()`, InvalidArgumentError for a
        message larger than `slot_size`, NoSpaceError (sparse channel,
        /dev/shm full)."""
    def unlink(self) -> None:
        """Removes the channel's name from /dev/shm now; the channel keeps
        working for the readers already attached (no new reader can attach).
        Call it once every reader has attached, and a crash of any process
        leaves nothing behind. Idempotent."""
    def try_send(self, data: Buffer) -> bool:
        """Sends `data` if its slot is free now and returns True; False
        (nothing sent) if it would wait. Errors otherwise as `send`."""
    def send_parts(self, parts: Iterable[Buffer], timeout: Optional[float] = None) -> None:
        """One message of the parts' bytes in order, gathered straight into the slot.

        Each part is any contiguous buffer; no joined copy is made. Waits
        and raises as `send` does."""
        ...
    def cancel(self) -> None:
        """Makes a `send` blocked in another thread, and every later send
        (`try_send` too), raise CancelledError at once. For a shutdown; it
        cannot be undone. Readers still receive what was sent."""
    def blocking_readers(self) -> list[tuple[int, Optional[int]]]:
        """The readers holding up the next send, as `(index, pid)` (pid
        None: that index never attached); empty when a send would not
        wait. For a log line; the answer may be stale at once."""
    @property
    def attached_readers(self) -> int:
        """How many reader indices have attached since the channel was
        made, each counted once (attached still, left or dead): wait for
        `n_readers` before `unlink()`."""
    def handle(self) -> BroadcastHandle:
        """What a reader process needs to attach (picklable: send it)."""
    @property
    def sent(self) -> int:
        """Messages sent so far."""
    @property
    def name(self) -> str:
        """The channel's segment name."""
    def close(self) -> None:
        """Closes the channel: readers receive what was sent, then
        WriterGoneError. Again, or in a forked child, does nothing. Later
        calls raise ValueError."""
    def __enter__(self: _T) -> _T:
        """The channel itself."""
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool:
        """Closes the channel (`close()`); never suppresses the exception."""

# A PyO3 class: it cannot be subclassed.
@final
class MessageView:
    """A channel message in place: exports its bytes (read-only) through the buffer protocol.

    While it (or an export of it) lives, the writer cannot reuse its slot.
    `release()` raises BufferError while an export is alive; in a forked
    child reading it raises PinshmError."""

    @property
    def seq(self) -> int:
        """The message's sequence number (0 for the channel's first)."""
    @property
    def released(self) -> bool:
        """Whether the view's own hold is released (exports of it may still
        hold the message)."""
    def release(self) -> None:
        """Releases the message, so the writer may reuse its slot.
        BufferError while exports of the view are alive; again does
        nothing."""
    def __bytes__(self) -> bytes:
        """A copy of the message's bytes. ValueError once released."""
    def __len__(self) -> int:
        """The message's size in bytes."""
    def __buffer__(self, flags: int) -> memoryview:
        """A read-only export of the message's bytes (no copy) that holds
        the message while it lives. BufferError once released."""
    def __release_buffer__(self, view: memoryview) -> None:
        """Ends an export (the message is released with the last one and
        the view)."""
    def __enter__(self: _T) -> _T:
        """The view itself."""
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]] = None,
        exc: Optional[BaseException] = None,
        tb: Optional[TracebackType] = None,
    ) -> bool:
        """Releases the message (`release()`); left by an exception, drops
        the view's hold instead, never raising BufferError. Never
        suppresses."""

# A PyO3 class: it cannot be subclassed.
@final
class BroadcastReader:
    """One reader of a broadcast channel: receives every message sent after
    the channel was made, in order, in place (`recv`) or as bytes
    (`recv_bytes`). Made before a fork(), its calls in the child raise
    PinshmError."""

    @staticmethod
    def attach(handle: BroadcastHandle, index: Optional[int] = None) -> BroadcastReader:
        """Attaches to the channel of `handle` as reader `index` (default:
        the first free one). InvalidArgumentError for an index past
        `n_readers`; PinshmError if the channel is gone or recreated, or
        no index is free (or the one asked for is taken)."""
    def recv(self, timeout: Optional[float] = None) -> MessageView:
        """The next message in place (no copy), held until released.

        A `MessageView`: while it or an export of it lives, the writer
        cannot reuse its slot (a channel has few: release it soon). Waits
        (GIL released) at most `timeout` seconds (None: no limit):
        WaitTimeoutError past it, CancelledError after `cancel()`,
        WriterGoneError once the writer is gone and all it sent was
        received; PinshmError if this reader holds a view in every slot."""
        ...
    def recv_bytes(self, timeout: Optional[float] = None) -> bytes:
        """The next message as a copy.

        The slot is released before it returns. Waits and raises as `recv`
        does."""
        ...
    def try_recv(self) -> Optional[MessageView]:
        """The next message in place (as `recv`) if one is there, else None."""
    def ready(self) -> bool:
        """Whether `recv` would return at once (a message this reader has
        not received, or the writer closed the channel). A peek: takes
        nothing."""
    def wait_ready(self, timeout: float) -> bool:
        """Waits (GIL released, on the channel's futex, never spinning)
        until `ready()` would say True, for at most `timeout` seconds;
        False when the time is up. Takes nothing."""
    def try_recv_bytes(self) -> Optional[bytes]:
        """The next message as a copy if one is there, else None."""
    def cancel(self) -> None:
        """Ends a blocked recv (another thread) at once, and every later one, with CancelledError."""
        ...
    def wait_stats(self) -> dict[str, int]:
        """How this reader's receives found their messages so far: counts
        under "ready", "spin", "early", "window" (around a predicted
        arrival), "sleep" (a futex wake-up) and "gave_up" (a timed-out or
        cancelled step)."""
    @property
    def index(self) -> int:
        """This reader's index."""
    @property
    def name(self) -> str:
        """The channel's segment name."""
    def close(self) -> None:
        """Detaches, once every `MessageView` of it is released too. Again,
        or in a forked child, does nothing. Later calls raise ValueError."""
    def __enter__(self: _T) -> _T:
        """The reader itself."""
    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool:
        """Detaches (`close()`); never suppresses the exception."""

class _Event(Protocol):
    """What pinshm polls for a device copy's end: a `torch.cuda.Event`, or
    anything with `query()`."""

    def query(self) -> bool:
        """Whether the copy has completed. For a save, raising means the
        copy failed (the save is aborted); for a gated read, the error is
        reported and the read released."""

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
    """Ends every pending gated read whose event has completed (and
    publishes every save, `ObjectStore.publish_after`, whose event has);
    returns how many of both are still pending. Waits for a poll under
    way (the release thread's), never for an event."""

def _inspect_segment(name: str, handles: Optional[Iterable[tuple[int, int]]] = None) -> dict[str, Any]:
    """The raw form of `pinshm.inspect_segment` (which returns it typed,
    `pinshm.segments.Snapshot`): the same fields as a dict."""

def _digest(data: Buffer) -> bytes:
    """The BLAKE3 digest (32 bytes) of a buffer's bytes, the GIL released
    (the remote encoder cache's digest of an output)."""

def _sandbox(read: list[str], write: list[str]) -> dict[str, Any]:
    """Sets no-new-privileges, Landlock (only `read` and `write` paths, no
    execution, no signal or abstract socket outside) and the seccomp
    filter of the remote tier's children; what took (OSError if seccomp
    cannot be set)."""

def _drop_uid(uid: int, gid: int) -> int:
    """Becomes `uid`:`gid` with no groups where this process runs as root;
    the effective uid after."""

# A PyO3 class: it cannot be subclassed.
@final
class _Digest:
    """A BLAKE3 digest taken piece by piece, each piece copied into its
    place first (the GIL released)."""

    def __init__(self) -> None: ...
    def copy_update(self, dst: Buffer, src: Buffer) -> None:
        """Copies `src` into `dst` (the same length) and adds what `dst`
        now holds to the digest."""
    def finish(self) -> bytes:
        """The digest of every piece added; the object is spent."""

def cuda_status() -> dict[str, Any]:
    """`feature` (built with CUDA support), `driver` (libcuda loads) and
    `driver_version` (`major * 1000 + minor * 10`, or None)."""

def _remove_if_abandoned_file(name: str, dev: int, ino: int) -> bool:
    """Removes segment `name` if the name still names the file (`dev`,
    `ino`) and no live writer holds it: whether that file left the name.
    What a process's reaper runs for the segments the process made, after
    it died: never another segment of the same name."""

def _gc_segments(prefix: str = "", dry_run: bool = True) -> list[dict[str, Any]]:
    """The raw form of `pinshm.gc_segments` (which returns them typed,
    `pinshm.segments.Abandoned`): the same fields as dicts."""
