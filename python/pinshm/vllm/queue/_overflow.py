"""The queue's overflow store: messages that do not fit a chunk.

The writer puts a message's pickle and each of its out-of-band buffers as
objects of a pinshm store it owns, and sends their handles through the
channel (a ``STORED`` message); each reader reads them from the store.
Messages come in order, so a store is replaced (by one of the power of
two at or above twice the message that did not fit) without a handshake:
a reader that gets a handle of the new store is done with the old one.

The store is sparse, as vLLM's rings are: /dev/shm holds the pages the
messages touched. Once every object was read, the next message is put
from the store's first byte again, so a stream of large messages keeps
reusing the same pages rather than walking the whole ring.

It grows within the node's /dev/shm budget (:mod:`pinshm.vllm._budget`):
while /dev/shm keeps vLLM's reserve free. A message it cannot take then is
a ``NoSpaceError`` from :meth:`OverflowWriter.send`, before any of its
handles is sent, and the queue sends it another way.
"""

from __future__ import annotations

import pickle
import time
from typing import Any, Callable, Optional

import pinshm

from .. import _budget
from .._tracker import Tracked
from ._encoding import STORED
from ._wait import Wait


class OverflowWriter:
    """The writer's side: stores named ``{prefix}-big{generation}``, made at
    the first message that needs one."""

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
        self._tracked = tracked

    def send(
        self,
        bufs: list[Any],
        deadline: Optional[float],
        send_ref: Callable[[bytes], None],
        cancelled: Callable[[], bool],
    ) -> None:
        """Puts `bufs` (the pickle, then its buffers) and sends the
        handles with `send_ref`; waits while the store is full of unread
        objects, until `deadline` or until `cancelled()`."""
        if cancelled():
            # After shutdown() nothing goes in: a put would only fill, or
            # make, a store no reader will read.
            raise RuntimeError("cancelled")
        sizes = [memoryview(b).nbytes for b in bufs]
        store = self._store_for(sizes)
        seq = self._seq
        self._seq += 1
        handles: list[Any] = []
        try:
            for i, b in enumerate(bufs):
                handles.append(self._put(store, f"{seq}.{i}", b, deadline, cancelled))
            send_ref(bytes([STORED]) + pickle.dumps((store.handle(), handles), protocol=5))
        except BaseException:
            # Objects put for a message never sent are owed reads nobody
            # will make: the store cannot reclaim past them. Retire it (it
            # goes when the queue closes); the next message makes another.
            # A message none of whose parts went in leaves it as it was.
            if handles and self.store is store:
                self._retired.append((store, len(handles)))
                self.store = None
                self._close_retired()
            raise
        self._close_retired()

    def close(self) -> None:
        for s in [self.store, *(r for r, _ in self._retired)]:
            if s is not None:
                s.close()
                self._tracked.discard(s.name)
        self.store = None
        self._retired = []

    def _store_for(self, sizes: list[int]) -> pinshm.ObjectStore:
        """The current store, replaced by a larger one when this message
        would not fit twice; rewound to its first byte when every object
        in it was read."""
        need = sum(pinshm.ObjectStore.slot_len(self.n_readers, s) for s in sizes)
        store = self.store
        if store is not None and 2 * need <= self._capacity:
            store.free_unused()
            if store.stats()["objects"] == 0:
                # Nothing owed, nothing held: the soft clear rewinds the
                # allocator to the first byte.
                store.clear()
            return store
        capacity = 1 << max(2 * need, self.min_capacity).bit_length()
        name = f"{self.prefix}-big{self.generation + 1}"
        # Sparse: a full /dev/shm is NoSpaceError from that put. Made
        # before the old one is retired: if this fails, the old one stays
        # current, as it was. No pages backed ahead: the message that
        # made it comes at once (no time for a backer to get ahead), and
        # later ones reuse its first pages (it is rewound when read).
        limit = pinshm.ObjectStore.largest_object(capacity, self.n_readers)
        size = _budget.shm_size() or 0
        new = pinshm.ObjectStore(
            capacity,
            limit,
            self.n_readers,
            name=name,
            reserve=False,
            shm_headroom=_budget.vllm_reserve(size),
            back_ahead=0,
        )
        if store is not None:
            self._retired.append((store, 0))
        self.generation += 1
        self.store = new
        self._capacity = capacity
        # Readers attach to it by name at their first large message: the
        # name stays, covered by the resource tracker.
        self._tracked.add(name)
        return self.store

    @staticmethod
    def _put(
        store: pinshm.ObjectStore,
        key: str,
        buf: Any,
        deadline: Optional[float],
        cancelled: Callable[[], bool],
    ) -> Any:
        """Puts one part, waiting while the store is full of unread
        objects (the readers are behind: they free room as they read)."""
        try:
            return store.put(key, buf)
        except pinshm.FullError:
            pass
        wait = Wait(deadline)
        pause = 50e-6
        while True:
            try:
                return store.put(key, buf)
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

    def load(self, ref: memoryview, zero_copy: bool) -> Any:
        """The object of a ``STORED`` message (`ref`: its bytes after the
        kind). Copied into owned, writable buffers; with `zero_copy`, the
        out-of-band buffers are read-only views that hold their objects
        until the last array over them is gone."""
        store_handle, handles = pickle.loads(ref)
        reader = self._attach(store_handle)
        if not zero_copy:
            # One pass each (no zero-filling); each read is acknowledged
            # as soon as its copy is made.
            parts = []
            for h in handles:
                with reader.get(h) as g:
                    parts.append(bytearray(g))
            return pickle.loads(parts[0], buffers=parts[1:])
        # The pickle is read through a guard released below, whatever
        # loads does; each buffer is a view that holds its object.
        oob = []
        guards = []
        try:
            guards = [reader.get(h) for h in handles]
            oob = [memoryview(g) for g in guards[1:]]
            main = memoryview(guards[0])
            try:
                return pickle.loads(main, buffers=oob)
            finally:
                main.release()
        finally:
            del oob
            g0 = guards[0] if guards else None
            del guards
            if g0 is not None:
                g0.release()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._reader = None

    def _attach(self, store_handle: Any) -> pinshm.StoreReader:
        if self._reader is None or self._reader.name != store_handle.name:
            # Messages come in order: an older store is not read again.
            self.close()
            self._reader = pinshm.StoreReader.attach(store_handle, self.rank)
        return self._reader
