"""``MessageQueue``: a drop-in for vLLM 0.33.0's
``vllm.distributed.device_communicators.shm_broadcast.MessageQueue``.

One writer broadcasts pickled objects to ``n_reader`` readers. Local readers
(this machine) get everything through shared memory:

* a message whose encoding (:mod:`._encoding`: the pickle and its
  out-of-band buffers) fits a chunk travels in a pinshm broadcast channel
  of ``max_chunks`` slots of ``max_chunk_bytes``, gathered into the slot
  by the writer and read in place by each reader;
* a larger one goes through the queue's overflow store
  (:mod:`._overflow`), as one object, and only its handle travels in
  the channel. No ZMQ socket is involved.

The node's /dev/shm is one budget (:mod:`pinshm._node.budget`): the
channel's slots are backed when the queue is made (vLLM's chunk, shrunk
to the queue's share of /dev/shm and to what is free; a queue that cannot
get ``max_chunks`` slots of 64 KiB refuses to start, naming the size it
needs), so no send of a started queue fails for lack of /dev/shm. The
overflow store is sparse; a message it cannot take for lack of /dev/shm
goes through the slots in pieces (:mod:`._pieces`), whole. The
channel's name is removed once every local reader has attached
(``wait_until_ready``), and the store's is covered by pinshm's
reaper (pinshm._node.tracker), so a SIGKILLed writer leaves nothing in /dev/shm.

Readers wait on the channel's futex, spinning first only while the recent
gaps between messages say it pays. A ``shutdown()`` from another thread
ends a blocked ``dequeue`` or ``enqueue`` with ``RuntimeError("cancelled")``.
Remote readers (other machines) keep vLLM's transport (:mod:`._remote`).

The module imports with numpy alone: torch, vLLM and pyzmq are imported
when a call needs them. The plugin (:mod:`pinshm.vllm.plugin`, with
``install_message_queue``) rebinds the name ``MessageQueue`` inside vLLM.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sized
from dataclasses import dataclass, field
from typing import Any, Optional

import pinshm

from ..._node import budget as _budget
from ..._node.tracker import Tracked
from .._status import announce
from . import _encoding as enc
from . import _groups
from ._overflow import OverflowReader, OverflowWriter
from ._pieces import Detours, assemble, send_in_pieces
from ._remote import Remote
from ._wait import LONG_WAIT_TIME_LOG_MSG, Wait, deadline_after, logger, remote_poll_wait_ms

__all__ = ["Handle", "MessageQueue", "LONG_WAIT_TIME_LOG_MSG"]


@dataclass
class Handle:
    """What a reader needs to attach (picklable). vLLM's field names are
    kept, for code that reads them (``local_reader_ranks``,
    ``remote_subscribe_addr``); the local transport is pinshm's."""

    local_reader_ranks: list[int] = field(default_factory=list)
    buffer_handle: Any = None  # pinshm.BroadcastHandle (vLLM: its ring's)
    local_subscribe_addr: Optional[str] = None  # always None: no ZMQ locally
    local_notify_addr: Optional[str] = None  # always None: futex wake-ups
    remote_subscribe_addr: Optional[str] = None
    remote_addr_ipv6: bool = False
    tensor_arena_handle: Any = None  # always None: no tensor arena
    n_reader: int = 0
    writer_pid: int = 0
    max_chunk_bytes: int = 0  # vLLM's chunk (a slot may be smaller: see _budget)


class MessageQueue:
    """vLLM 0.33.0's MessageQueue API over a pinshm broadcast channel (and a
    pinshm object store for messages larger than a chunk)."""

    # Set by _init_common; the rest depend on the role.
    _tx: Optional[pinshm.Broadcast]
    _rx: Optional[pinshm.BroadcastReader]
    _overflow: Optional[OverflowWriter]
    _overflow_reader: Optional[OverflowReader]
    _remote: Optional[Remote]
    _tracked: Tracked

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: Optional[list[int]] = None,
        max_chunk_bytes: int = 1024 * 1024 * 24,
        max_chunks: int = 10,
        connect_ip: Optional[str] = None,
        enable_shm_tensor_arena: bool = False,
        *,
        name: Optional[str] = None,
    ):
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        elif len(local_reader_ranks) != n_local_reader:
            raise ValueError(
                f"local_reader_ranks has {len(local_reader_ranks)} ranks, n_local_reader is {n_local_reader}"
            )
        if enable_shm_tensor_arena:
            logger.debug("pinshm MessageQueue: the tensor arena is not reproduced; large tensors go to the store")
        self.n_reader = n_reader
        self.n_local_reader = n_local_reader
        self.n_remote_reader = n_reader - n_local_reader
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        self._init_common(is_writer=True)
        announce()

        self.detours = Detours()  # messages sent in pieces
        self._slot_bytes = max_chunk_bytes
        if n_local_reader > 0:
            self._tx = self._make_channel(n_local_reader, max_chunks, max_chunk_bytes, name)
            self._slot_bytes = self._tx.handle().slot_size
            # Until the name is unlinked (wait_until_ready), a writer killed
            # without closing leaves it to the reaper.
            self._tracked.add(self._tx.name)
            self._overflow = OverflowWriter(
                self._tx.name, n_local_reader, max(2 * self._slot_bytes, 1 << 20), self._tracked
            )
        remote_subscribe_addr = None
        remote_addr_ipv6 = False
        if self.n_remote_reader > 0:
            self._remote, remote_subscribe_addr, remote_addr_ipv6 = Remote.publisher(connect_ip)
            self.remote_socket = self._remote.socket
        self.handle = Handle(
            local_reader_ranks=list(local_reader_ranks),
            buffer_handle=self._tx.handle() if self._tx is not None else None,
            remote_subscribe_addr=remote_subscribe_addr,
            remote_addr_ipv6=remote_addr_ipv6,
            n_reader=n_reader,
            writer_pid=os.getpid(),
            max_chunk_bytes=max_chunk_bytes,
        )
        logger.debug("pinshm message queue handle: %s", self.handle)

    @staticmethod
    def _make_channel(n: int, chunks: int, chunk_bytes: int, name: Optional[str]) -> pinshm.Broadcast:
        """The channel, its slots backed now (see the module doc)."""
        size, free = _budget.shm_size(), _budget.shm_free()
        slot = _budget.queue_slot_bytes(chunk_bytes, chunks, size, free)
        if slot < chunk_bytes:
            logger.info(
                "pinshm MessageQueue: %d slots of %.2f MiB backed (vLLM asked for %.0f MiB chunks; %.0f MiB "
                "of /dev/shm free): larger messages go through the overflow store",
                chunks,
                slot / (1 << 20),
                chunk_bytes / (1 << 20),
                (free or 0) / (1 << 20),
            )
        try:
            return pinshm.Broadcast(n, chunks, slot, name=name, reserve=True)
        except pinshm.NoSpaceError:
            # Taken meanwhile by another process: the same refusal.
            raise _budget.QueueNoRoom(chunks * slot, _budget.vllm_reserve(size or 0), _budget.shm_free() or 0) from None

    def _init_common(self, is_writer: bool) -> None:
        self.shutting_down = False
        self.tensor_arena = None  # vLLM's tensor arena: not reproduced
        self.local_socket = None  # vLLM's overflow socket: not used
        self.remote_socket = None
        self.local_reader_rank = -1
        self._is_writer = is_writer
        self._is_local_reader = False
        self._is_remote_reader = False
        self._tx = None
        self._rx = None
        self._overflow = None
        self._overflow_reader = None
        self._remote = None
        self._tracked = Tracked()

    # ---- construction, as vLLM ----

    def export_handle(self) -> Handle:
        return self.handle

    @staticmethod
    def create_from_handle(handle: Handle, rank: int) -> MessageQueue:
        self = MessageQueue.__new__(MessageQueue)
        self.handle = handle
        self.n_reader = handle.n_reader
        self.n_local_reader = len(handle.local_reader_ranks)
        self.n_remote_reader = handle.n_reader - self.n_local_reader
        self._init_common(is_writer=False)
        announce()
        if rank in handle.local_reader_ranks:
            self.local_reader_rank = handle.local_reader_ranks.index(rank)
            self._is_local_reader = True
            self._rx = pinshm.BroadcastReader.attach(handle.buffer_handle, self.local_reader_rank)
            self._overflow_reader = OverflowReader(self.local_reader_rank)
            self.max_chunk_bytes = handle.max_chunk_bytes or handle.buffer_handle.slot_size
            self.max_chunks = handle.buffer_handle.slots
        else:
            self._is_remote_reader = True
            if handle.remote_subscribe_addr is None:
                raise ValueError(f"rank {rank} is not a local reader and the queue has no remote readers")
            self._remote = Remote.subscriber(handle.remote_subscribe_addr, handle.remote_addr_ipv6)
            self.remote_socket = self._remote.socket
        return self

    def wait_until_ready(self) -> None:
        """Collective, as in vLLM: the writer's call returns once every
        local reader has attached (made its queue with
        ``create_from_handle``), whether or not it has called its own yet,
        and removes the channel's name (see :meth:`_ready_handshake`); a
        reader's returns once the writer's has. So they may be called in
        turn from one thread, writer first. Remote readers do vLLM's XPUB
        handshake."""
        if self._is_writer:
            if self._tx is not None:
                self._ready_handshake()
            if self._remote is not None:
                self._remote.wait_for_subscribers(self.n_remote_reader)
        elif self._is_local_reader:
            data = self._recv(None, indefinite=True)
            if data[:1] != bytes([enc.READY]):
                raise RuntimeError(f"wait_until_ready: expected the writer's READY, got a message of kind {data[:1]!r}")
        elif self._remote is not None:
            self._remote.wait_for_ready()

    def _ready_handshake(self) -> None:
        """Waits until every local reader has attached, drops the channel's
        name (so that no kill can leave it in /dev/shm: the mapping stays,
        the name was only for attaching), then sends READY.

        As vLLM's writer, which returns once every local reader's socket
        has subscribed, that is once the readers *exist*: it does not wait
        for their own ``wait_until_ready`` calls, so a writer and its
        readers may call it in turn from one thread. The channel counts the
        reader indices that have attached (``Broadcast.attached_readers``);
        READY is one message, which each reader's ``wait_until_ready``
        reads."""
        tx = self._channel()
        wait = Wait(None)
        pause = 0.0005
        while tx.attached_readers < self.n_local_reader:
            if self.shutting_down:
                raise RuntimeError("cancelled")
            wait.warn_if_due(self._unattached)
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        tx.unlink()
        self._tracked.discard(tx.name)
        self._send(bytes([enc.READY]), None)

    def _channel(self) -> pinshm.Broadcast:
        """The writer's channel (a writer with local readers has one)."""
        if self._tx is None:
            raise RuntimeError("pinshm MessageQueue: no channel (not a writer with local readers)")
        return self._tx

    def _unattached(self) -> str:
        n = self._channel().attached_readers
        return f"{self.n_local_reader - n} of {self.n_local_reader} local reader(s) to attach"

    # As vLLM's static methods, called the same way; classmethods so that
    # the functions build this class.
    create_from_process_group = classmethod(_groups.create_from_process_group)
    create_from_process_group_single_reader = classmethod(_groups.create_from_process_group_single_reader)

    # ---- messaging ----

    def enqueue(self, obj: Any, timeout: Optional[float] = None) -> None:
        """Sends `obj` to every reader; TimeoutError after `timeout`
        seconds if a slot (or store room) does not free up."""
        if not self._is_writer:
            raise RuntimeError("Only writers can enqueue")
        bufs = enc.dumps(obj)
        if self._tx is not None and self._overflow is not None:  # set together
            deadline = deadline_after(timeout)
            # What fits a chunk travels in it: one copy of each buffer into
            # the slot, one out of it on each reader, as in vLLM's ring.
            if enc.inline_size(bufs) <= self._slot_bytes:
                self._send_parts(enc.inline_parts(bufs), deadline)
            else:
                try:
                    self._overflow.send(bufs, deadline, lambda ref: self._send(ref, deadline), self._cancelled)
                except pinshm.NoSpaceError as e:
                    # The other way: the slots, backed at start (no message
                    # of it went out: the handles are sent last).
                    n = send_in_pieces(
                        enc.inline_parts(bufs), self._slot_bytes, lambda parts: self._send_parts(parts, deadline)
                    )
                    self.detours.sent(n, e)
        if self._remote is not None:
            self._remote.send(bufs)

    def dequeue(self, timeout: Optional[float] = None, indefinite: bool = False, *, zero_copy: bool = False) -> Any:
        """The next object; TimeoutError after `timeout` seconds;
        RuntimeError("cancelled") if `shutdown()` is called meanwhile.

        With ``zero_copy=True``, out-of-band buffers of a message that went
        through the store are read-only views of it (no copy); each holds
        its object until the arrays over it are gone. By default they are
        copied into writable bytearrays, as vLLM does."""
        if self._is_local_reader:
            while True:
                view = self._recv_view(timeout, indefinite)
                mv = memoryview(view)
                try:
                    kind = mv[0]
                    if kind == enc.INLINE:
                        return enc.loads_inline(mv)
                    data = bytes(mv)  # a few handles: small
                finally:
                    mv.release()
                    try:
                        view.release()  # the slot goes back to the writer
                    except BufferError:
                        # An export still alive: the slot goes with it.
                        pass
                if kind == enc.PIECE:
                    # Its first slot is released already: the writer may
                    # need it for a later piece.
                    return enc.loads_inline(assemble(memoryview(data), lambda: self._recv_view(timeout, indefinite)))
                if kind == enc.STORED:
                    if self._overflow_reader is None:
                        raise RuntimeError("pinshm MessageQueue: a stored message reached a reader without a store")
                    return self._overflow_reader.load(memoryview(data), zero_copy)
                if kind != enc.READY:
                    raise RuntimeError(f"pinshm MessageQueue: unknown message kind {kind}")
                # A READY nobody waited for: skip it.
        if self._remote is not None:
            return self._remote.recv(timeout, self._cancelled)
        raise RuntimeError("Only readers can dequeue")

    def readable(self) -> bool:
        """Whether :meth:`dequeue` would return without waiting (vLLM
        0.34): a message is there, or the writer has gone (``dequeue`` then
        raises at once). Never consumes one. A local reader peeks at the
        channel's sequence number (nothing is taken, no slot held); a
        remote one polls its socket with a zero timeout.
        RuntimeError("cancelled") after :meth:`shutdown`; RuntimeError for
        a writer."""
        if self.shutting_down:
            raise RuntimeError("cancelled")
        if self._is_local_reader and self._rx is not None:
            try:
                return self._rx.ready()
            except pinshm.CancelledError:
                raise RuntimeError("cancelled") from None
        if self._is_remote_reader:
            return bool(self.remote_socket.poll(timeout=0))
        raise RuntimeError("Only readers can check readability")

    def spin_until_readable(self, pending: Sized, deadline: float) -> None:
        """Returns once a message is ready (see :meth:`readable`),
        `pending` is non-empty, or ``time.monotonic()`` reaches `deadline`
        (vLLM 0.34's engine waits for its workers' outputs with it, while
        its input thread fills `pending`); callers re-check ``readable()``.

        vLLM's spins with the GIL held; here a local reader sleeps on the
        channel's futex, GIL released, in steps of ``REMOTE_POLL_WAIT_MS``
        (1 ms), looking at `pending` between them: a message wakes it at
        once, new input within a step, and a step costs a wake-up, not a
        core. A remote reader sleeps one step in its socket's poll."""
        if self._is_remote_reader:
            self.remote_socket.poll(timeout=remote_poll_wait_ms())
            return
        rx = self._rx if self._is_local_reader else None
        if rx is None:
            raise RuntimeError("Only readers can wait for readability")
        step_s, monotonic = remote_poll_wait_ms() / 1000.0, time.monotonic
        try:
            while not pending and not self.shutting_down:
                left = deadline - monotonic()
                if left <= 0 or rx.wait_ready(min(left, step_s)):
                    return
        except pinshm.CancelledError:
            raise RuntimeError("cancelled") from None
        if self.shutting_down:
            raise RuntimeError("cancelled")

    def broadcast_object(self, obj: Any = None) -> Any:
        if self._is_writer:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    def shutdown(self) -> None:
        """Wakes a reader blocked in `dequeue`, or a writer blocked in
        `enqueue` (another thread), with RuntimeError("cancelled"); later
        calls raise it too. (vLLM's wakes readers only; a writer waiting
        for a reader that is gone is the other half of a shutdown.)"""
        self.shutting_down = True
        if self._rx is not None:
            self._rx.cancel()
        if self._tx is not None:
            self._tx.cancel()

    def close(self) -> None:
        """Detaches, or (the writer) removes the channel and the store.
        Not in vLLM (its queue lives until collected); idempotent."""
        self.shutting_down = True
        if self._overflow_reader is not None:
            self._overflow_reader.close()
        if self._rx is not None:
            self._rx.close()
        if self._tx is not None:
            self._tx.close()
        if self._overflow is not None:
            self._overflow.close()
        self._tracked.clear()
        if self._remote is not None:
            self._remote.close()
            self._remote = None
            self.remote_socket = None

    def __del__(self) -> None:
        # vLLM never closes its queues: the segments go when the objects
        # do (unlinked on drop); the tracker must not unlink them again.
        tracked = self.__dict__.get("_tracked")
        if tracked is not None:
            tracked.clear()

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- the local transport ----

    def _cancelled(self) -> bool:
        return self.shutting_down

    def _send(self, data: bytes, deadline: Optional[float]) -> None:
        self._send_parts([data], deadline)

    def _send_parts(self, parts: list[Any], deadline: Optional[float]) -> None:
        """Sends one channel message gathered from `parts`, waiting on the
        futex for a slot; logs who blocks every warning interval."""
        tx = self._channel()
        wait: Optional[Wait] = None
        step: Optional[float] = 0.0  # the first try does not wait
        while True:
            try:
                tx.send_parts(parts, timeout=step)
                return
            except pinshm.CancelledError:
                raise RuntimeError("cancelled") from None
            except pinshm.WaitTimeoutError:
                if wait is None:
                    wait = Wait(deadline)
                else:
                    wait.warn_if_due(self._channel_blockers)
            if wait.expired():
                raise TimeoutError(f"enqueue: no free slot, waiting for {self._channel_blockers()}")
            step = wait.step()

    def _channel_blockers(self) -> str:
        try:
            blockers = self._channel().blocking_readers()
        except Exception as e:  # noqa: BLE001 - closed meanwhile: a diagnostic, never an error
            return f"(unknown: {e})"
        if not blockers:
            return "nobody (the slot is free now)"
        ranks = self.handle.local_reader_ranks
        return ", ".join(
            f"reader rank {ranks[i] if i < len(ranks) else i} "
            + (f"(pid {pid})" if pid is not None else "(not attached yet)")
            for i, pid in blockers
        )

    def _recv_view(self, timeout: Optional[float], indefinite: bool) -> Any:
        """The next channel message as a view of its slot (release it)."""
        rx = self._rx
        if rx is None:
            raise RuntimeError("Only local readers can dequeue from the channel")
        if self.shutting_down:
            raise RuntimeError("cancelled")
        wait = Wait(deadline_after(timeout), quiet=indefinite)
        while True:
            try:
                return rx.recv(timeout=wait.step())
            except pinshm.CancelledError:
                raise RuntimeError("cancelled") from None
            except pinshm.WaitTimeoutError:
                if wait.expired():
                    raise TimeoutError(f"dequeue: nothing from the writer in {timeout} s") from None
                wait.warn_if_due(lambda: f"the writer (pid {self.handle.writer_pid}) to send")

    def _recv(self, timeout: Optional[float], indefinite: bool) -> bytes:
        """The next channel message, copied (the ready handshake's)."""
        view = self._recv_view(timeout, indefinite)
        try:
            return bytes(view)
        finally:
            view.release()
