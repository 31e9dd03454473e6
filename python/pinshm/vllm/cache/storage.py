"""Drop-in replacements for the classes of vLLM 0.33.0's
``vllm.distributed.device_communicators.shm_object_storage`` that vLLM's
shared-memory multimodal cache (``vllm.multimodal.cache.shm``) uses,
backed by a pinshm store.

Same constructors, methods, return values, exception types and messages as
vLLM's; what differs underneath:

- The ring, the key index and the read accounting live in Rust. Reads are
  counted by one atomic counter per object (pinshm's aggregate mode, the
  accounting vLLM uses), not under ``reader_lock``: the lock readers must
  still pass is never taken.
- Readers read the slot in place and acknowledge when the serde is done
  with it; a reader that dies stops counting towards what an object owes.
- The segment is sparse, as vLLM's is: it costs the pages its objects
  touch, and a full /dev/shm is a ``NoSpaceError`` (a ``MemoryError``, so
  vLLM's sender serves the item uncached), never SIGBUS.
  ``PINSHM_VLLM_RESERVE=1`` reserves and pre-faults it at creation instead.
- Pinning (a ``cuda`` build with a driver): the writer (vLLM's API server,
  which forks the engine core) never pins, so it stays CUDA-free; each
  worker registers its own mapping of a reserved segment
  (``PINSHM_VLLM_RESERVE=1``), so the tensors vLLM decodes from it are
  pinned memory and ``pin_memory()`` returns them as they are: the slot is
  the tensor, and its H2D copy a DMA from it. ``PINSHM_VLLM_PIN=0`` turns
  the workers' pinning off. With ``pinshm.cuda_release.install()`` in a
  worker, a read ends only once the GPU has finished copying from it.
- ``PINSHM_VLLM_ZERO_COPY=1`` (CPU workers, opt-in): the decoder hands vLLM
  tensors that view the slot instead of clones, and the worker maps the
  segment a second time read-only for them, so an in-place write by model
  code faults (SIGSEGV) instead of changing the other ranks' inputs. The
  read is held, and the slot kept, until the tensors are gone.
- The writer tells its segment to pinshm's reaper (:mod:`pinshm._node.tracker`),
  as vLLM's ``SharedMemory`` tells the resource tracker: a killed API
  server does not leave it behind, and another engine's live segment of
  the same name is never removed.

Handles travel as vLLM's ``(address, monotonic_id)``: see :mod:`._wire`.
The handle-signing secret never leaves Rust, so ``get_auth_secret()`` is
not offered.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, Optional

from ..._node.budget import shm_headroom
from ..._node.tracker import track, untrack
from ..._pinshm import (
    ObjectHandle,
    ObjectStore,
    PinshmError,
    StaleError,
    StoreReader,
    signature_bytes,
)
from .. import _status
from .._status import announce
from ._serde import MsgpackSerde, ObjectSerde, zero_copy
from ._wire import MAX_ID, OFFSET_BITS, IdIndex, KeyIndex, from_wire, stale, to_wire

logger = logging.getLogger("vllm.pinshm.storage")

__all__ = [
    "MsgpackSerde",
    "ObjectSerde",
    "ShmObjectStorageHandle",
    "SingleWriterShmObjectStorage",
    "SingleWriterShmRingBuffer",
]

# vLLM's storage counts a 4-byte in-use flag in every object's size.
_FLAG_BYTES = 4

_MISSING_SIGNATURE = "Missing SHM handle signature for cache key."
_INVALID_SIGNATURE = "Invalid SHM handle signature for cache key."


class SingleWriterShmRingBuffer:
    """The shared memory under a :class:`SingleWriterShmObjectStorage`.

    vLLM makes the ring first and hands it to the storage, which knows the
    object size limit and the reader count a pinshm store is created with;
    so the writer's segment is created when the storage is, under the name
    chosen here, and a reader attaches then. The raw chunk API
    (``allocate_buf``, ``access_buf``, ``free_buf``) is not offered: the
    ring is the store's.
    """

    def __init__(self, data_buffer_size: int, name: Optional[str] = None, create: bool = False):
        if type(data_buffer_size) is not int or not 0 < data_buffer_size < 1 << OFFSET_BITS:
            raise ValueError(f"data_buffer_size must be an int in [1, 2**{OFFSET_BITS}), not {data_buffer_size!r}")
        self.data_buffer_size = data_buffer_size
        self.is_writer = bool(create)
        self._store: Optional[ObjectStore] = None
        self._reader: Optional[StoreReader] = None
        if create:
            # As multiprocessing.shared_memory names its segments.
            self.name = name if name is not None else f"psm_{secrets.token_hex(8)}"
        else:
            if name is None:
                raise ValueError("'name' can only be None if create=True")
            if not os.path.exists(os.path.join("/dev/shm", name.lstrip("/"))):
                raise FileNotFoundError(errno.ENOENT, "No such shared memory segment", name.lstrip("/"))
            self.name = name.lstrip("/")

    def _open_writer(self, max_object_size: int, n_readers: int) -> ObjectStore:
        if self._store is None:
            reserve = os.environ.get("PINSHM_VLLM_RESERVE", "0") == "1"
            # vLLM takes any size: the ring is the size rounded down to
            # pinshm's slot alignment, and the Rust-side object limit is
            # what fits in it (the storage still checks the user's limit,
            # with vLLM's message).
            capacity = self.data_buffer_size - self.data_buffer_size % ObjectStore.SLOT_ALIGN
            limit = min(max_object_size, ObjectStore.largest_object(capacity, n_readers))
            if limit <= 0:
                raise ValueError(
                    f"data_buffer_size ({self.data_buffer_size}) is too small for a "
                    f"pinshm store of {n_readers} readers: it needs more than "
                    f"{ObjectStore.slot_len(n_readers, 0) + ObjectStore.SLOT_ALIGN} bytes"
                )
            try:
                self._store = ObjectStore(
                    capacity,
                    limit,
                    n_readers,
                    name=self.name,
                    aggregate_reads=True,
                    reserve=reserve,
                    prefault=reserve,
                    # vLLM's API server forks the engine core: no CUDA here.
                    pin="off",
                    # The cache is /dev/shm's elastic user: it leaves the
                    # queues beside it what they need.
                    shm_headroom=0 if reserve else shm_headroom(),
                )
            except PinshmError as e:
                if os.path.exists(os.path.join("/dev/shm", self.name)):
                    # A live writer has the name (a dead one's segment is
                    # replaced): vLLM's SharedMemory says FileExistsError.
                    raise FileExistsError(errno.EEXIST, str(e), self.name) from e
                raise
            track(self.name)
            self._tracked_by = os.getpid()
        return self._store

    def _open_reader(self) -> StoreReader:
        if self._reader is None:
            pin: Literal["off", "auto"] = "off" if os.environ.get("PINSHM_VLLM_PIN", "1") == "0" else "auto"
            self._reader = StoreReader.attach_by_name(self.name, pin=pin, read_only_views=zero_copy())
            _status.pinned(f"multimodal cache {self.name!r}", self._reader)
        return self._reader

    def handle(self) -> tuple[int, str]:
        return (self.data_buffer_size, self.name)

    @property
    def metadata(self) -> Mapping[int, str]:
        """vLLM's ``monotonic_id -> chunk`` table, here ``monotonic_id ->
        key`` of the objects the writer knows (empty after ``clear``);
        read-only, and empty on a reader (the table is the writer's)."""
        if self._store is None:
            return {}
        return IdIndex(self._store)

    def clear(self) -> None:
        """Forgets every object (the store's soft clear: ids keep
        increasing, handles issued before read until their slot is reused)."""
        assert self.is_writer, "Only the writer can clear the buffer."
        if self._store is not None:
            self._store.clear()

    def close(self) -> None:
        """Detaches; the writer also removes the segment. Twice is fine."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
        store, self._store = self._store, None
        if store is not None:
            store.close()
            # Not in a forked child: the tracker is shared with the parent,
            # whose name this is (the child's close did nothing to it).
            if getattr(self, "_tracked_by", None) == os.getpid():
                untrack(self.name)

    def __del__(self) -> None:
        # A half-built object (the constructor raised) has no _store.
        if "_store" in self.__dict__:
            self.close()

    def get_auth_secret(self) -> bytes:
        raise NotImplementedError("pinshm keeps the handle-signing secret in Rust")

    def allocate_buf(self, size: int) -> NoReturn:
        raise NotImplementedError("pinshm's ring is managed by its store: use the storage's put")

    def access_buf(self, address: int) -> NoReturn:
        raise NotImplementedError("pinshm's ring is managed by its store: use the storage's get")

    def free_buf(self, is_free_fn: Any, nbytes: Optional[int] = None) -> NoReturn:
        raise NotImplementedError("pinshm's ring is managed by its store: use the storage's free_unused")


@dataclass
class ShmObjectStorageHandle:
    max_object_size: int
    n_readers: int
    ring_buffer_handle: tuple[int, str]
    serde_class: type
    reader_lock: Any


class SingleWriterShmObjectStorage:
    """vLLM 0.33.0's shared-memory object storage over a pinshm store: one
    writer process puts, ``n_readers`` reader processes get; an object
    referenced k times (one put, k - 1 ``get_cached``) is free after
    k × n_readers reads from any readers, oldest first."""

    def __init__(
        self,
        max_object_size: int,
        n_readers: int,
        ring_buffer: SingleWriterShmRingBuffer,
        serde_class: type = MsgpackSerde,
        reader_lock: Any = None,
    ):
        self.max_object_size = max_object_size
        self.n_readers = n_readers
        self.serde_class = serde_class
        self.ser_de = serde_class()
        self.ring_buffer = ring_buffer
        self.is_writer = ring_buffer.is_writer
        self._reader_lock = reader_lock
        self._store: Optional[ObjectStore] = None
        self._reader: Optional[StoreReader] = None
        self._epoch: Optional[int] = None
        announce()
        if self.is_writer:
            self._store = ring_buffer._open_writer(max_object_size, n_readers)
            self.key_index: Mapping[str, tuple[int, int]] = KeyIndex(self._store)
            self.id_index: Mapping[int, str] = IdIndex(self._store)
        else:
            if reader_lock is None:
                raise ValueError("Lock must be provided for readers.")
            self._reader = ring_buffer._open_reader()
            # Constant for the store's life: the drop-in never hard-clears.
            self._epoch = self._reader.epoch

    # -- the writer -----------------------------------------------------

    def _writer(self) -> ObjectStore:
        if self._store is None:
            raise RuntimeError("only the writer can do this (or the storage is closed)")
        return self._store

    def put(self, key: str, value: Any) -> tuple[int, int]:
        """Stores ``value`` under ``key``; returns ``(address,
        monotonic_id)``. ValueError if the key exists or the object is too
        large; MemoryError (pinshm.FullError) if unread objects fill the
        ring."""
        store = self._writer()
        if store.is_cached(key):
            raise ValueError(f"Key '{key}' already exists in the storage.")
        data, data_bytes, metadata, md_bytes = self.ser_de.serialize(value)
        buffer_size = _FLAG_BYTES + data_bytes + md_bytes
        if buffer_size > self.max_object_size:
            raise ValueError(
                f"Serialized object size ({buffer_size} bytes) exceeds max object size ({self.max_object_size} bytes)"
            )
        parts = (
            [metadata, data]
            if isinstance(data, (bytes, bytearray, memoryview))
            else [
                metadata,
                *data,
            ]
        )
        h = store.put_parts(key, parts)
        if h.monotonic_id - 1 >= MAX_ID:
            raise RuntimeError(f"store {self.ring_buffer.name} has used all 2**48 ids its wire handles can carry")
        self._epoch = h.epoch
        return to_wire(h)

    def is_cached(self, key: str) -> bool:
        return self._writer().is_cached(key)

    def get_cached(self, key: str) -> tuple[int, int]:
        """The handle of ``key``, expecting one more read from each reader;
        ends a ``touch`` protection. KeyError if absent."""
        h = self._writer().get_cached(key)
        if h is None:
            raise KeyError(key)
        return to_wire(h)

    def get_signature(self, key: str) -> list[int]:
        signature = self._writer().signature(key)
        if signature is None:
            raise KeyError(key)
        return list(signature)

    def release_touches(self) -> None:
        self._writer().release_protections()

    def free_unused(self) -> None:
        self._writer().free_unused()

    def clear(self) -> None:
        if self.is_writer and self._store is not None:
            self._store.clear()

    # -- both sides -----------------------------------------------------

    def _handle(self, address: Any, monotonic_id: Any) -> ObjectHandle:
        # A writer learns its epoch from its first put; before it, no
        # handle can be good.
        return from_wire(address, monotonic_id, self._epoch or 0)

    def _verified(self, key: Any, address: Any, monotonic_id: Any, signature: Any) -> ObjectHandle:
        """The handle, once ``signature`` is found to be issued for ``key``
        at it (and, on the writer, the handle is still the key's);
        ValueError with vLLM's messages otherwise."""
        if self.is_writer:
            h = self._store.lookup(key) if self._store is not None and type(key) is str else None
            if h is None or to_wire(h) != (address, monotonic_id):
                raise ValueError(_INVALID_SIGNATURE)
        if signature is None or key is None:
            raise ValueError(_MISSING_SIGNATURE)
        sig = signature_bytes(signature)
        if sig is None or not isinstance(key, str):
            raise ValueError(_INVALID_SIGNATURE)
        try:
            h = self._handle(address, monotonic_id)
        except StaleError:
            raise ValueError(_INVALID_SIGNATURE) from None
        target = self._store if self.is_writer else self._reader
        if target is None or not target.verify(key, h, sig):
            raise ValueError(_INVALID_SIGNATURE)
        return h

    def verify_signature(
        self,
        key: Optional[str],
        address: int,
        monotonic_id: int,
        signature: Optional[list[int]],
    ) -> None:
        """ValueError unless ``signature`` was issued for ``key`` at this
        handle; on the writer the handle must also still be the key's."""
        self._verified(key, address, monotonic_id, signature)

    def get(
        self,
        address: int,
        monotonic_id: int,
        signature: Optional[list[int]] = None,
        key: Optional[str] = None,
    ) -> Any:
        """The object at the handle, deserialized (a reader checks the
        signature first and counts one read once the serde is done).
        ValueError (pinshm.StaleError) with vLLM's message if the handle's
        object is gone."""
        if self.is_writer and self._reader_lock is None:
            # vLLM's sender: its gets count nothing.
            try:
                data = self._writer().peek(self._handle(address, monotonic_id))
            except StaleError:
                raise stale(address, monotonic_id) from None
            return self.ser_de.deserialize(memoryview(data))
        if self.is_writer:
            # A writer given a reader_lock counts its own gets as reads, as
            # vLLM's does (its tests read that way): through a reader of its
            # own segment, which takes one of the n_readers reader places.
            if self._reader is None:
                self._writer()
                self._reader = self.ring_buffer._open_reader()
            h = self._handle(address, monotonic_id)
        else:
            h = self._verified(key, address, monotonic_id, signature)
        reader = self._reader
        if reader is None:
            raise RuntimeError("the storage is closed")
        try:
            guard = reader.get(h)
        except StaleError:
            raise stale(address, monotonic_id) from None
        try:
            return self.ser_de.deserialize(memoryview(guard))
        finally:
            try:
                guard.release()
            except BufferError:
                # The result still views the slot: the read ends (and is
                # counted) when the last view goes.
                pass

    def touch(
        self,
        key: str,
        address: int = 0,
        monotonic_id: int = 0,
        signature: Optional[list[int]] = None,
    ) -> None:
        """Writer: protects ``key`` from eviction until its next
        ``get_cached`` or ``release_touches()``. Reader: checks the handle
        (signature, then that its object is still there), counting nothing."""
        if self.is_writer:
            store = self._writer()
            if store.is_cached(key):
                store.protect(key)
            return
        h = self._verified(key, address, monotonic_id, signature)
        reader = self._reader
        if reader is None:
            raise RuntimeError("the storage is closed")
        try:
            reader.validate(h)
        except StaleError:
            raise stale(address, monotonic_id) from None

    def close(self) -> None:
        self._store = None
        self._reader = None
        self.ring_buffer.close()

    def handle(self) -> ShmObjectStorageHandle:
        return ShmObjectStorageHandle(
            max_object_size=self.max_object_size,
            n_readers=self.n_readers,
            ring_buffer_handle=self.ring_buffer.handle(),
            serde_class=self.serde_class,
            reader_lock=self._reader_lock,
        )

    @staticmethod
    def create_from_handle(handle: ShmObjectStorageHandle) -> SingleWriterShmObjectStorage:
        ring_buffer = SingleWriterShmRingBuffer(*handle.ring_buffer_handle)
        return SingleWriterShmObjectStorage(
            max_object_size=handle.max_object_size,
            n_readers=handle.n_readers,
            ring_buffer=ring_buffer,
            serde_class=handle.serde_class,
            reader_lock=handle.reader_lock,
        )
