"""The queue's overflow store: messages that do not fit a chunk.

The writer puts a message's inline encoding (:mod:`._encoding`: the
pickle and its out-of-band buffers, each buffer 64-byte aligned) as one object of a pinshm store it
owns, gathered straight from the buffers, and sends its handle through the
channel (a ``STORED`` message: the store's handle, pickled once per store,
and the object's three numbers); each reader decodes it in place from the
store, as it decodes a slot. Per message, then, one put, one read, one
copy each side, and no pickle of handles.
Messages come in order, so a store is replaced (by one of the power of
two at or above twice the message that did not fit) without a handshake:
a reader that gets a handle of the new store is done with the old one.

The store is sparse, as vLLM's rings are: /dev/shm holds the pages the
messages touched. Once every object was read, the next message is put
from the store's first byte again, so a stream of large messages keeps
reusing the same pages rather than walking the whole ring.

It grows within the node's /dev/shm budget (:mod:`pinshm._node.budget`):
while /dev/shm keeps vLLM's reserve free. A message it cannot take then is
a ``NoSpaceError`` from :meth:`OverflowWriter.send`, before any of its
handles is sent, and the queue sends it another way.
"""

from __future__ import annotations

import pickle
import secrets
import time
from typing import Any, Callable, Optional

import pinshm

from ..._node import budget as _budget
from ..._node.tracker import Tracked
from ._encoding import STORED, STORED_ALIGN, STORED_HEAD, STORED_REF, inline_parts, inline_size, loads_inline
from ._wait import Wait

#: Names drawn for a new overflow store before its creation's error is raised.
NAME_TRIES = 4


class OverflowWriter:
    """The writer's side: stores named ``{prefix}-big{generation}-{random}``,
    made at the first message that needs one."""

    def __init__(self, prefix: str, n_readers: int, min_capacity: int, tracked: Tracked) -> None:
        self.prefix = prefix
        self.n_readers = n_readers
        self.min_capacity = min_capacity
        self.generation = 0
        self.store: Optional[pinshm.ObjectStore] = None
        self._capacity = 0
        # Replaced stores with objects still unread, each with the count of
        # its objects no reader will ever read (a message never sent).
        self._retired: list[tuple[Any, int]] = []
        self._seq = 0
        # The STORED message's head for the current store: the kind and
        # the store's handle, pickled once.
        self._head = b""
        # Objects put in the current store that free_unused has not yet
        # reported reclaimed: never fewer than the store holds.
        self._unreclaimed = 0
        self._tracked = tracked

    def send(
        self,
        bufs: list[Any],
        deadline: Optional[float],
        send_ref: Callable[[bytes], None],
        cancelled: Callable[[], bool],
    ) -> None:
        """Puts the inline encoding of `bufs` (the pickle, then its
        buffers) as one object and sends its handle with `send_ref`; waits
        while the store is full of unread objects, until `deadline` or
        until `cancelled()`."""
        if cancelled():
            # After shutdown() nothing goes in: a put would only fill, or
            # make, a store no reader will read.
            raise RuntimeError("cancelled")
        store = self._store_for(inline_size(bufs, STORED_ALIGN))
        key = str(self._seq)
        self._seq += 1
        put = False
        try:
            h = self._put(store, key, inline_parts(bufs, STORED_ALIGN), deadline, cancelled)
            put = True
            self._unreclaimed += 1
            send_ref(self._head + STORED_REF.pack(h.address, h.monotonic_id, h.epoch))
        except BaseException:
            # An object put for a message never sent is owed reads nobody
            # will make: the store cannot reclaim past it. Retire it (it
            # goes when the queue closes); the next message makes another.
            # A message that did not go in leaves it as it was.
            if put and self.store is store:
                self._retired.append((store, 1))
                self.store = None
                self._close_retired()
            raise
        if self._retired:
            self._close_retired()

    def close(self) -> None:
        for s in [self.store, *(r for r, _ in self._retired)]:
            if s is not None:
                s.close()
                self._tracked.discard(s.name)
        self.store = None
        self._retired = []

    def _store_for(self, nbytes: int) -> pinshm.ObjectStore:
        """The current store, replaced by a larger one when a message of
        `nbytes` would not fit twice; rewound to its first byte when every
        object in it was read."""
        need = pinshm.ObjectStore.slot_len(self.n_readers, nbytes)
        store = self.store
        if store is not None and 2 * need <= self._capacity:
            self._unreclaimed -= store.free_unused()
            if self._unreclaimed > 0:
                # A reader behind (or objects reclaimed otherwise): ask.
                objects = store.stats()["objects"]
                self._unreclaimed = objects if isinstance(objects, int) else self._unreclaimed
            if self._unreclaimed == 0:
                # Nothing owed, nothing held: the soft clear rewinds the
                # allocator to the first byte.
                store.clear()
            return store
        capacity = 1 << max(2 * need, self.min_capacity).bit_length()
        # Sparse: a full /dev/shm is NoSpaceError from that put. Made
        # before the old one is retired: if this fails, the old one stays
        # current, as it was. No pages backed ahead: the message that
        # made it comes at once (no time for a backer to get ahead), and
        # later ones reuse its first pages (it is rewound when read).
        limit = pinshm.ObjectStore.largest_object(capacity, self.n_readers)
        size = _budget.shm_size() or 0
        for attempt in range(NAME_TRIES):
            # A name nobody can predict (readers get it in the handle): a
            # file another user made at a guessable one would stop every
            # large message. A name taken all the same is never followed:
            # another is drawn.
            name = f"{self.prefix}-big{self.generation + 1}-{secrets.token_hex(6)}"
            try:
                new = pinshm.ObjectStore(
                    capacity,
                    limit,
                    self.n_readers,
                    name=name,
                    reserve=False,
                    shm_headroom=_budget.vllm_reserve(size),
                    back_ahead=0,
                )
                break
            except (pinshm.NoSpaceError, pinshm.InvalidArgumentError):
                raise
            except pinshm.PinshmError:
                if attempt == NAME_TRIES - 1:
                    raise
        if store is not None:
            self._retired.append((store, 0))
        self.generation += 1
        self.store = new
        self._capacity = capacity
        self._unreclaimed = 0
        handle = pickle.dumps(new.handle(), protocol=5)
        self._head = STORED_HEAD.pack(STORED, len(handle)) + handle
        # Readers attach to it by name at their first large message: the
        # name stays, covered by the reaper.
        self._tracked.add(name)
        return self.store

    @staticmethod
    def _put(
        store: pinshm.ObjectStore,
        key: str,
        parts: list[Any],
        deadline: Optional[float],
        cancelled: Callable[[], bool],
    ) -> Any:
        """Puts `parts` as one object, waiting while the store is full of
        unread objects (the readers are behind: they free room as they
        read)."""
        try:
            return store.put_parts(key, parts)
        except pinshm.FullError:
            pass
        wait = Wait(deadline)
        pause = 50e-6
        while True:
            try:
                return store.put_parts(key, parts)
            except pinshm.FullError as e:
                if wait.expired():
                    raise TimeoutError(f"enqueue: the store is full: {e}") from None
                why = f"the store to free room: {e}"
                wait.warn_if_due(lambda: why)  # noqa: B023 - called here, in this round
                if cancelled():
                    raise RuntimeError("cancelled") from None
                time.sleep(pause)
                pause = min(pause * 2, 5e-3)

    def _close_retired(self) -> None:
        """Closes replaced stores once every object in them that a reader
        will read was read (their pages go back to the node's budget)."""
        keep = []
        for s, orphans in self._retired:
            s.free_unused()
            objects = s.stats()["objects"]
            if isinstance(objects, int) and objects <= orphans:
                s.close()
                self._tracked.discard(s.name)
            else:
                keep.append((s, orphans))
        self._retired = keep


class OverflowReader:
    """A reader's side: attached to the store of the latest message."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._reader: Optional[pinshm.StoreReader] = None
        self._store_bytes = b""  # the pickled handle `_reader` attached by

    def load(self, ref: memoryview, zero_copy: bool) -> Any:
        """The object of a ``STORED`` message (`ref`: all its bytes).
        Its out-of-band buffers are copied into owned, writable buffers
        (the read is acknowledged once they are made); with `zero_copy`,
        they are read-only views that hold the object until the last
        array over them is gone."""
        _, m = STORED_HEAD.unpack_from(ref, 0)
        start = STORED_HEAD.size
        store_bytes = ref[start : start + m]
        if self._reader is None or store_bytes != self._store_bytes:
            self._attach(pickle.loads(store_bytes))
            self._store_bytes = bytes(store_bytes)
        reader = self._reader
        assert reader is not None  # attached above
        handle = pinshm.ObjectHandle(*STORED_REF.unpack_from(ref, start + m))
        guard = reader.get(handle)
        try:
            # The pickle is read in place (the object is unwritten while
            # its read is owed); a raise releases the guard below. One
            # export of the guard, which the decoding's views share.
            with memoryview(guard) as mv:
                return loads_inline(mv, copy=not zero_copy, align=STORED_ALIGN)
        finally:
            try:
                guard.release()
            except BufferError:
                # zero_copy: views of it live on; the last one releases it.
                pass

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._reader = None
        self._store_bytes = b""

    def _attach(self, store_handle: Any) -> pinshm.StoreReader:
        if self._reader is None or self._reader.name != store_handle.name:
            # Messages come in order: an older store is not read again.
            self.close()
            self._reader = pinshm.StoreReader.attach(store_handle, self.rank)
        return self._reader
