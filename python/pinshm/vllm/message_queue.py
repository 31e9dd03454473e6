"""``MessageQueue``: a drop-in for vLLM 0.33.0's
``vllm.distributed.device_communicators.shm_broadcast.MessageQueue``.

One writer broadcasts pickled objects to ``n_reader`` readers. Local readers
(this machine) get everything through shared memory:

* a message whose pickle (without out-of-band buffers) fits a chunk
  travels in a pinshm broadcast channel of ``max_chunks`` slots of
  ``max_chunk_bytes``;
* a larger one, or one with out-of-band buffers, goes into a pinshm object
  store owned by the queue (one object for the pickle, one per
  out-of-band buffer), and only the objects' handles travel in the
  channel. No ZMQ socket is involved.

Both segments are sparse, as vLLM's rings are: /dev/shm holds the pages
the messages touched, and a full /dev/shm is a ``MemoryError``
(``pinshm.NoSpaceError``) from that ``enqueue``, never SIGBUS. The
channel's name is removed once every local reader has attached
(``wait_until_ready``), and the store's is covered by multiprocessing's
resource tracker, so a SIGKILLed writer leaves nothing in /dev/shm.

Readers sleep on the channel's futex (a few µs of spinning first). A
``shutdown()`` from another thread ends a blocked ``dequeue`` with
``RuntimeError("cancelled")``. Remote readers (other machines) keep vLLM's
transport: a ZMQ XPUB socket over TCP (pyzmq, imported only then).

The module imports with numpy alone: torch, vLLM and pyzmq are imported
when a call needs them. The plugin (``pinshm.vllm.plugin``) rebinds the
name ``MessageQueue`` inside vLLM.
"""

from __future__ import annotations

import copyreg
import io
import logging
import os
import pickle
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pickle import PickleBuffer
from typing import Any, Optional

import pinshm

__all__ = ["Handle", "MessageQueue", "install", "LONG_WAIT_TIME_LOG_MSG"]

# A child of vLLM's "vllm" logger, so vLLM's logging configuration shows it.
logger = logging.getLogger("vllm.pinshm.message_queue")

# vLLM's text, kept word for word up to "weight/kv cache quantization)."
# because users grep for it; what follows names who blocks.
LONG_WAIT_TIME_LOG_MSG = (
    "No available shared memory broadcast block found "
    "in %d seconds. This typically happens "
    "when some processes are hanging or doing some "
    "time-consuming work (e.g. compilation, "
    "weight/kv cache quantization). Waiting for %s."
)

# Out-of-band buffers below this size are pickled in-band (as vLLM does).
OOB_MIN_BYTES = 1 << 20

# Message kinds (byte 0 of a channel message).
_INLINE = 0  # the pickle and its buffers, in the message
_STORED = 1  # handles of objects in the queue's store
_READY = 2  # wait_until_ready's probe

_U16 = struct.Struct("<H")


def _track(name: str) -> None:
    from .storage import _track as track

    track(name)


def _untrack(name: str) -> None:
    from .storage import _untrack as untrack

    untrack(name)


def _announce() -> None:
    """The plugin's "in use" line, once vLLM's logging is configured (it is
    when vLLM builds its queues)."""
    from .plugin import announce

    announce()


def _warning_interval() -> float:
    """vLLM's VLLM_RINGBUFFER_WARNING_INTERVAL (seconds, default 60)."""
    try:
        return float(os.environ.get("VLLM_RINGBUFFER_WARNING_INTERVAL", "60"))
    except ValueError:
        return 60.0


class _Wait:
    """A blocking wait taken in steps: until `deadline` (time.monotonic();
    None: none), logging vLLM's long-wait line every
    VLLM_RINGBUFFER_WARNING_INTERVAL seconds unless `quiet`."""

    def __init__(self, deadline: Optional[float], quiet: bool = False) -> None:
        self.started = time.monotonic()
        self.deadline = deadline
        self.interval = None if quiet else _warning_interval()
        self.n_warning = 1

    def step(self) -> Optional[float]:
        """How long the next wait may last (None: as long as it takes):
        until the next warning or the deadline."""
        now = time.monotonic()
        step = None if self.interval is None else self.started + self.interval * self.n_warning - now
        if self.deadline is not None:
            left = self.deadline - now
            step = left if step is None else min(step, left)
        return None if step is None else max(step, 0.0)

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def warn_if_due(self, waiting_for: Any) -> None:
        """Logs the long-wait line naming `waiting_for()` once per interval."""
        if self.interval is not None and time.monotonic() - self.started >= self.interval * self.n_warning:
            logger.info(LONG_WAIT_TIME_LOG_MSG, self.interval, waiting_for())
            self.n_warning += 1


# ---------------------------------------------------------------------------
# Encoding: vLLM's pickle with out-of-band buffers, CPU tensors included.
# ---------------------------------------------------------------------------


def _rebuild_tensor(buf: Any, shape: tuple, dtype_str: str) -> Any:
    """Rebuilds a CPU tensor from an out-of-band buffer (a writable
    bytearray, or a read-only view of the store in zero-copy mode)."""
    import torch

    dtype = getattr(torch, dtype_str)
    mv = memoryview(buf)
    if mv.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if mv.readonly:
        import warnings

        with warnings.catch_warnings():
            # Zero-copy mode: the tensor is a read-only view of the store.
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(mv, dtype=torch.uint8).view(dtype).view(shape)
    return torch.frombuffer(mv, dtype=torch.uint8).view(dtype).view(shape)


def _reduce_tensor(tensor: Any) -> Any:
    """A CPU tensor as an out-of-band buffer (torch's own reducer copies
    the bytes into the pickle stream)."""
    import torch

    if tensor.device.type == "cpu" and tensor.layout == torch.strided and not tensor.requires_grad:
        try:
            raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        except RuntimeError:
            pass
        else:
            dtype_str = str(tensor.dtype).removeprefix("torch.")
            return _rebuild_tensor, (PickleBuffer(raw), tuple(tensor.shape), dtype_str)
    return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


_tensor_table: Optional[dict] = None
_tensor_table_key: Optional[tuple] = None


def _dumps(obj: Any, oob_min: int = OOB_MIN_BYTES) -> list:
    """``[pickle, *out-of-band buffers]``: buffers of ``oob_min`` bytes and
    more travel out of band (no copy into the pickle)."""
    bufs: list = [b""]

    def oob(buf: PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < oob_min:
            return True
        bufs.append(raw)
        return False

    torch = sys.modules.get("torch")
    if torch is None:
        # No torch in this process: the object holds no tensor.
        bufs[0] = pickle.dumps(obj, protocol=5, buffer_callback=oob)
        return bufs
    global _tensor_table, _tensor_table_key
    key = (id(copyreg.dispatch_table), len(copyreg.dispatch_table))
    if _tensor_table is None or _tensor_table_key != key:
        table = dict(copyreg.dispatch_table)
        table[torch.Tensor] = _reduce_tensor
        _tensor_table, _tensor_table_key = table, key
    with io.BytesIO() as bio:
        p = pickle.Pickler(bio, protocol=5, buffer_callback=oob)
        p.dispatch_table = _tensor_table
        p.dump(obj)
        bufs[0] = bio.getvalue()
    return bufs


def _inline_parts(bufs: list) -> list:
    """One channel message as parts the channel gathers into its slot
    (no join): kind, buffer count, each length, then the buffers."""
    head = struct.pack(f"<BH{len(bufs)}I", _INLINE, len(bufs), *(memoryview(b).nbytes for b in bufs))
    return [head, *bufs]


def _inline_size(bufs: list) -> int:
    return 3 + 4 * len(bufs) + sum(memoryview(b).nbytes for b in bufs)


def _loads_inline(data: Any) -> Any:
    """The object of an inline message (bytes, or a view of the slot: the
    pickle is read in place, each out-of-band buffer copied once into an
    owned bytearray)."""
    (n,) = _U16.unpack_from(data, 1)
    lens = struct.unpack_from(f"<{n}I", data, 3)
    off = 3 + 4 * n
    oob = []
    with memoryview(data) as mv, mv[off : off + lens[0]] as main:
        off += lens[0]
        for length in lens[1:]:
            # Writable, and owned: the arrays may outlive the message.
            with mv[off : off + length] as part:
                oob.append(bytearray(part))
            off += length
        # Released on the way out, raise or not: an exception's frames
        # must not keep the slot.
        return pickle.loads(main, buffers=oob)


# ---------------------------------------------------------------------------
# The handle and the queue.
# ---------------------------------------------------------------------------


@dataclass
class Handle:
    """What a reader needs to attach (picklable). vLLM's field names are
    kept, for code that reads them (``local_reader_ranks``,
    ``remote_subscribe_addr``); the local transport is pinshm's."""

    local_reader_ranks: list = field(default_factory=list)
    buffer_handle: Any = None  # pinshm.BroadcastHandle (vLLM: its ring's)
    local_subscribe_addr: Optional[str] = None  # always None: no ZMQ locally
    local_notify_addr: Optional[str] = None  # always None: futex wake-ups
    remote_subscribe_addr: Optional[str] = None
    remote_addr_ipv6: bool = False
    tensor_arena_handle: Any = None  # always None: no tensor arena
    n_reader: int = 0
    writer_pid: int = 0


class MessageQueue:
    """vLLM 0.33.0's MessageQueue API over a pinshm broadcast channel (and a
    pinshm object store for messages larger than a chunk)."""

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: Optional[list] = None,
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
        self.shutting_down = False
        self.tensor_arena = None
        self._is_writer = True
        self._is_local_reader = False
        self._is_remote_reader = False
        self.local_reader_rank = -1
        self._init_common()
        _announce()

        if n_local_reader > 0:
            self._tx = pinshm.Broadcast(n_local_reader, max_chunks, max_chunk_bytes, name=name)
            # Until the name is unlinked (wait_until_ready), a writer killed
            # without closing (vLLM SIGKILLs its engine core and workers)
            # leaves it to multiprocessing's resource tracker, as vLLM's
            # SharedMemory rings do.
            self._tracked.append(self._tx.name)
            _track(self._tx.name)
        self._store_gen = 0
        self._seq = 0

        remote_subscribe_addr = None
        remote_addr_ipv6 = False
        if self.n_remote_reader > 0:
            zmq = _zmq()
            if not connect_ip:
                connect_ip = _get_ip()
            self._zmq_context = zmq.Context()
            self.remote_socket = self._zmq_context.socket(zmq.XPUB)
            self.remote_socket.setsockopt(zmq.XPUB_VERBOSE, True)
            if ":" in connect_ip and not connect_ip.startswith("["):
                self.remote_socket.setsockopt(zmq.IPV6, 1)
                remote_addr_ipv6 = True
                connect_ip = f"[{connect_ip}]"
            self.remote_socket.bind(f"tcp://{connect_ip}:0")
            endpoint = self.remote_socket.getsockopt(zmq.LAST_ENDPOINT).decode()
            port = endpoint.rsplit(":", 1)[1]
            remote_subscribe_addr = f"tcp://{connect_ip}:{port}"

        self.handle = Handle(
            local_reader_ranks=list(local_reader_ranks),
            buffer_handle=self._tx.handle() if self._tx is not None else None,
            remote_subscribe_addr=remote_subscribe_addr,
            remote_addr_ipv6=remote_addr_ipv6,
            n_reader=n_reader,
            writer_pid=os.getpid(),
        )
        logger.debug("pinshm message queue handle: %s", self.handle)

    def _init_common(self) -> None:
        self._rx: Optional[pinshm.BroadcastReader] = None
        self._store_readers: dict = {}
        self._tx: Optional[pinshm.Broadcast] = None
        self._store: Optional[pinshm.ObjectStore] = None  # made on the first overflow
        self._retired: list = []  # replaced stores with objects still unread
        self._zmq_context = None
        self.remote_socket = None
        self.local_socket = None  # vLLM's overflow socket: not used
        self._lock = threading.Lock()
        self._tracked: list = []  # segment names registered with the resource tracker

    # ---- construction, as vLLM ----

    def export_handle(self) -> Handle:
        return self.handle

    @staticmethod
    def create_from_handle(handle: Handle, rank: int) -> "MessageQueue":
        self = MessageQueue.__new__(MessageQueue)
        self.handle = handle
        self.n_reader = handle.n_reader
        self.n_local_reader = len(handle.local_reader_ranks)
        self.n_remote_reader = handle.n_reader - self.n_local_reader
        self.shutting_down = False
        self.tensor_arena = None
        self._is_writer = False
        self._init_common()
        _announce()
        if rank in handle.local_reader_ranks:
            self.local_reader_rank = handle.local_reader_ranks.index(rank)
            self._is_local_reader = True
            self._is_remote_reader = False
            self._rx = pinshm.BroadcastReader.attach(handle.buffer_handle, self.local_reader_rank)
            self.max_chunk_bytes = handle.buffer_handle.slot_size
            self.max_chunks = handle.buffer_handle.slots
        else:
            self.local_reader_rank = -1
            self._is_local_reader = False
            self._is_remote_reader = True
            if handle.remote_subscribe_addr is None:
                raise ValueError(f"rank {rank} is not a local reader and the queue has no remote readers")
            zmq = _zmq()
            self._zmq_context = zmq.Context()
            self.remote_socket = self._zmq_context.socket(zmq.SUB)
            self.remote_socket.setsockopt_string(zmq.SUBSCRIBE, "")
            if handle.remote_addr_ipv6:
                self.remote_socket.setsockopt(zmq.IPV6, 1)
            self.remote_socket.connect(handle.remote_subscribe_addr)
        return self

    def wait_until_ready(self) -> None:
        """Collective: the writer and every reader call it (concurrently:
        each waits for the others, as in vLLM). Locally the writer learns
        that every reader has attached, then removes the channel's name
        (see :meth:`_ready_handshake`); remote readers do vLLM's XPUB
        handshake."""
        if self._is_writer:
            if self._tx is not None:
                self._ready_handshake()
            if self.n_remote_reader > 0:
                for _ in range(self.n_remote_reader):
                    self.remote_socket.recv()  # a subscription message
                self.remote_socket.send(b"READY")
        elif self._is_local_reader:
            data = self._recv(None, indefinite=True)
            if data[0] != _READY:
                raise RuntimeError(f"wait_until_ready: expected the writer's READY, got a message of kind {data[0]}")
            # The fillers the writer announced (see _ready_handshake).
            fillers = int.from_bytes(data[1:5], "little") if len(data) >= 5 else 0
            for _ in range(fillers):
                data = self._recv(None, indefinite=True)
                if data[0] != _READY:
                    raise RuntimeError(f"wait_until_ready: expected a READY filler, got a message of kind {data[0]}")
        elif self._is_remote_reader:
            recv = self.remote_socket.recv()
            if recv != b"READY":
                raise RuntimeError(f"wait_until_ready: expected b'READY', got {recv[:16]!r}")

    def _ready_handshake(self) -> None:
        """Sends READY, and where the channel can drop its name
        (``Broadcast.unlink()``), drops it once every local reader has
        attached, so that no kill can leave it in /dev/shm (the mapping
        stays; the name was only for attaching). Without ``unlink`` the
        resource tracker covers the name.

        The channel tells the writer that every reader has attached
        through its slots: the send that reuses READY's slot
        (``max_chunks`` sends later) waits until every reader has released
        READY. READY announces those ``max_chunks`` fillers and each reader
        reads them all in its ``wait_until_ready``, so the ring is empty
        again when the handshake ends."""
        unlink = getattr(self._tx, "unlink", None)
        fillers = self.max_chunks if unlink is not None else 0
        self._send(bytes([_READY]) + fillers.to_bytes(4, "little"), None)
        if unlink is None:
            return
        for _ in range(fillers):
            self._send(bytes([_READY]), None)
        unlink()
        self._untrack(self._tx.name)

    def _untrack(self, name: str) -> None:
        if name in self._tracked:
            self._tracked.remove(name)
            _untrack(name)

    @staticmethod
    def create_from_process_group(
        pg: Any,
        max_chunk_bytes: int,
        max_chunks: int,
        writer_rank: int = 0,
        external_writer_handle: Optional[Handle] = None,
        blocking: bool = True,
    ) -> "MessageQueue":
        """As vLLM: the writer rank creates the queue and broadcasts its
        handle over `pg` (a torch ProcessGroup or vLLM's
        StatelessProcessGroup); every other rank attaches."""
        stateless = hasattr(pg, "broadcast_obj")
        if stateless:
            group_rank, world, global_ranks = pg.rank, pg.world_size, list(range(pg.world_size))
        else:
            import torch.distributed as dist

            group_rank = dist.get_rank(pg)
            world = dist.get_world_size(pg)
            global_ranks = dist.get_process_group_ranks(pg)
        status = _same_node(pg, writer_rank, world)
        if group_rank == writer_rank:
            if external_writer_handle is not None:
                mq = MessageQueue.create_from_handle(external_writer_handle, group_rank)
            else:
                same = [i for i, s in enumerate(status) if s]
                local = [i for i in same if i != writer_rank]
                mq = MessageQueue(
                    n_reader=world - 1,
                    n_local_reader=len(local),
                    local_reader_ranks=local,
                    max_chunk_bytes=max_chunk_bytes,
                    max_chunks=max_chunks,
                )
            handle = mq.export_handle()
            if stateless:
                pg.broadcast_obj(handle, writer_rank)
            else:
                import torch.distributed as dist

                dist.broadcast_object_list([handle], src=global_ranks[writer_rank], group=pg)
        else:
            if stateless:
                handle = pg.broadcast_obj(None, writer_rank)
            else:
                import torch.distributed as dist

                recv = [None]
                dist.broadcast_object_list(recv, src=global_ranks[writer_rank], group=pg)
                handle = recv[0]
            mq = MessageQueue.create_from_handle(handle, group_rank)
        if blocking:
            mq.wait_until_ready()
        return mq

    @staticmethod
    def create_from_process_group_single_reader(
        pg: Any,
        max_chunk_bytes: int,
        max_chunks: int,
        reader_rank: int = 0,
        blocking: bool = False,
    ) -> tuple:
        """As vLLM: every rank writes its own queue to `reader_rank`, which
        gathers the handles."""
        import torch.distributed as dist

        try:
            from vllm.platforms import current_platform
            from vllm.platforms.interface import get_assigned_physical_gpu_ids

            ids = get_assigned_physical_gpu_ids()
            local_size = len(ids) if ids is not None else current_platform.device_count()
        except ImportError:
            local_size = 0
        rank = dist.get_rank()
        same_node = local_size <= 0 or rank // local_size == reader_rank // local_size
        mq = MessageQueue(
            n_reader=1,
            n_local_reader=1 if same_node else 0,
            max_chunk_bytes=max_chunk_bytes,
            max_chunks=max_chunks,
        )
        handle = mq.export_handle()
        handles = [None] * dist.get_world_size(pg) if rank == reader_rank else None
        dist.gather_object(handle, handles, dst=reader_rank, group=pg)
        if blocking:
            mq.wait_until_ready()
        return mq, handles or []

    # ---- messaging ----

    def enqueue(self, obj: Any, timeout: Optional[float] = None) -> None:
        """Sends `obj` to every reader; TimeoutError after `timeout`
        seconds if a slot (or store room) does not free up."""
        if not self._is_writer:
            raise RuntimeError("Only writers can enqueue")
        bufs = _dumps(obj)
        if self._tx is not None:
            deadline = None if timeout is None else time.monotonic() + timeout
            # What fits a chunk travels in it: the parts are gathered
            # straight into the slot (send_parts), and the reader copies
            # each out-of-band buffer once out of a view of it (recv_view),
            # one copy each side as in vLLM's ring. Only what does not fit
            # goes through the store.
            if _inline_size(bufs) <= self.max_chunk_bytes:
                self._send_parts(_inline_parts(bufs), deadline)
            else:
                self._send_stored(bufs, deadline)
        if self.n_remote_reader > 0:
            self.remote_socket.send_multipart(bufs, copy=False)

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
                    if kind == _INLINE:
                        return _loads_inline(mv)
                    data = bytes(mv)  # a few handles: small
                finally:
                    mv.release()
                    try:
                        view.release()  # the slot goes back to the writer
                    except BufferError:
                        # An export still alive: the slot goes with it.
                        pass
                if kind == _STORED:
                    return self._load_stored(data, zero_copy)
                if kind != _READY:
                    raise RuntimeError(f"pinshm MessageQueue: unknown message kind {kind}")
                # A READY nobody waited for: skip it.
        if self._is_remote_reader:
            return self._recv_remote(timeout)
        raise RuntimeError("Only readers can dequeue")

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
        for r in self._store_readers.values():
            r.close()
        self._store_readers.clear()
        if self._rx is not None:
            self._rx.close()
        if self._tx is not None:
            self._tx.close()
        for s in [self._store, *self._retired]:
            if s is not None:
                s.close()
        self._retired = []
        for name in list(self._tracked):
            self._untrack(name)
        if self.remote_socket is not None:
            self.remote_socket.close(linger=0)
            self.remote_socket = None
        if self._zmq_context is not None:
            self._zmq_context.term()
            self._zmq_context = None

    def __del__(self) -> None:
        # vLLM never closes its queues: the segments go when the objects
        # do (unlinked on drop); the tracker must not unlink them again.
        for name in list(self.__dict__.get("_tracked", ())):
            self._untrack(name)

    def __enter__(self) -> "MessageQueue":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- the local transport ----

    def _send(self, data: bytes, deadline: Optional[float]) -> None:
        self._send_parts([data], deadline)

    def _send_parts(self, parts: list, deadline: Optional[float]) -> None:
        """Sends one channel message gathered from `parts`, waiting on the
        futex for a slot; logs who blocks every warning interval."""
        tx = self._tx
        try:
            tx.send_parts(parts, timeout=0)
            return
        except pinshm.CancelledError:
            raise RuntimeError("cancelled") from None
        except pinshm.WaitTimeoutError:
            pass
        wait = _Wait(deadline)
        while True:
            if wait.expired():
                raise TimeoutError(f"enqueue: no free slot, waiting for {self._channel_blockers()}")
            try:
                tx.send_parts(parts, timeout=wait.step())
                return
            except pinshm.CancelledError:
                raise RuntimeError("cancelled") from None
            except pinshm.WaitTimeoutError:
                wait.warn_if_due(self._channel_blockers)

    def _channel_blockers(self) -> str:
        try:
            blockers = self._tx.blocking_readers()
        except Exception as e:  # closed meanwhile
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
        if self.shutting_down:
            raise RuntimeError("cancelled")
        wait = _Wait(None if timeout is None else time.monotonic() + timeout, quiet=indefinite)
        while True:
            try:
                return rx.recv_view(timeout=wait.step())
            except pinshm.CancelledError:
                raise RuntimeError("cancelled") from None
            except pinshm.WaitTimeoutError:
                if wait.expired():
                    raise TimeoutError(f"dequeue: nothing from the writer in {timeout} s") from None
                wait.warn_if_due(lambda: f"the writer (pid {self.handle.writer_pid}) to send")

    def _recv(self, timeout: Optional[float], indefinite: bool) -> bytes:
        """The next channel message, copied (the small ones of the
        ready handshake)."""
        view = self._recv_view(timeout, indefinite)
        try:
            return bytes(view)
        finally:
            view.release()

    # ---- the store, for messages larger than a chunk ----

    def _send_stored(self, bufs: list, deadline: Optional[float]) -> None:
        sizes = [memoryview(b).nbytes for b in bufs]
        store = self._store_for(sizes)
        seq = self._seq
        self._seq += 1
        try:
            handles = [self._put(store, f"{seq}.{i}", b, deadline) for i, b in enumerate(bufs)]
            ref = pickle.dumps((store.handle(), handles, sizes), protocol=5)
            self._send(bytes([_STORED]) + ref, deadline)
        except BaseException:
            # Objects put for a message never sent are owed reads nobody
            # will make: the store cannot reclaim past them. Retire it (it
            # goes when the queue closes); the next message makes another.
            if self._store is store:
                self._retired.append(store)
                self._store = None
            raise
        self._close_retired()

    def _store_for(self, sizes: list) -> pinshm.ObjectStore:
        """The current store, replaced by a larger one when this message
        would not fit twice."""
        need = sum(s + 4096 for s in sizes)
        store = self._store
        if store is not None and 2 * need <= self._store_capacity:
            return store
        capacity = 1 << max(2 * need, 2 * self.max_chunk_bytes, 1 << 20).bit_length()
        if store is not None:
            self._retired.append(store)
        self._store_gen += 1
        name = f"{self._tx.name}-big{self._store_gen}"
        # Sparse, as vLLM's rings are: /dev/shm holds the pages messages
        # touched; a full /dev/shm is NoSpaceError from that put.
        self._store = pinshm.ObjectStore(capacity, capacity // 2, self.n_local_reader, name=name, reserve=False)
        self._store_capacity = capacity
        # Readers attach to it by name at their first big message: the
        # name stays, covered by the resource tracker.
        self._tracked.append(name)
        _track(name)
        return self._store

    def _put(self, store: pinshm.ObjectStore, key: str, buf: Any, deadline: Optional[float]) -> Any:
        """Puts one part, waiting while the store is full of unread
        objects (the readers are behind: they free room as they read)."""
        try:
            return store.put(key, buf)
        except pinshm.FullError:
            pass
        wait = _Wait(deadline)
        pause = 50e-6
        while True:
            try:
                return store.put(key, buf)
            except pinshm.FullError as e:
                if wait.expired():
                    raise TimeoutError(f"enqueue: the store is full: {e}") from None
                why = f"the store to free room: {e}"
                wait.warn_if_due(lambda: why)
                if self.shutting_down:
                    raise RuntimeError("cancelled") from None
                time.sleep(pause)
                pause = min(pause * 2, 5e-3)

    def _close_retired(self) -> None:
        """Closes replaced stores once every object in them was read (a
        reader reads messages in order, so it is done with a store once it
        has read an object of its successor)."""
        if not self._retired:
            return
        keep = []
        for s in self._retired:
            s.free_unused()
            if s.stats()["objects"] == 0:
                s.close()
                self._untrack(s.name)
            else:
                keep.append(s)
        self._retired = keep

    def _load_stored(self, data: bytes, zero_copy: bool) -> Any:
        store_handle, handles, sizes = pickle.loads(memoryview(data)[1:])
        reader = self._store_readers.get(store_handle.name)
        if reader is None:
            # Messages come in order: an older store will not be read again.
            for old in self._store_readers.values():
                old.close()
            self._store_readers.clear()
            reader = pinshm.StoreReader.attach(store_handle, self.local_reader_rank)
            self._store_readers[store_handle.name] = reader
        if not zero_copy:
            # Owned, writable copies (one pass each: no zero-filling); each
            # read is acknowledged as soon as its copy is made.
            parts = []
            for h in handles:
                with reader.get(h) as g:
                    parts.append(bytearray(g))
            return pickle.loads(parts[0], buffers=parts[1:])
        # Zero copy: the pickle is read through a guard released below,
        # whatever loads does; each buffer is a view that holds its object
        # until the last array over it is gone.
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

    # ---- remote readers (ZMQ over TCP) ----

    def _recv_remote(self, timeout: Optional[float]) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        sock = self.remote_socket
        while True:
            if self.shutting_down:
                raise RuntimeError("cancelled")
            step_ms = 100
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 and not sock.poll(timeout=0):
                    raise TimeoutError("dequeue: nothing from the remote writer")
                step_ms = max(0, min(step_ms, int(left * 1000)))
            if sock.poll(timeout=step_ms):
                main, *oob = sock.recv_multipart(copy=False)
                return pickle.loads(main, buffers=oob)


def _zmq() -> Any:
    try:
        import zmq
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("remote readers of pinshm's MessageQueue need pyzmq (pip install pyzmq)") from e
    return zmq


def _get_ip() -> str:
    try:
        from vllm.utils.network_utils import get_ip

        return get_ip()
    except ImportError:
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect(("8.8.8.8", 80))  # no packet is sent
                return s.getsockname()[0]
            except OSError:
                return "127.0.0.1"


def _same_node(pg: Any, writer_rank: int, world: int) -> list:
    """Which ranks share the writer's machine: vLLM's answer where vLLM is
    installed, else all of them."""
    try:
        from vllm.distributed.parallel_state import in_the_same_node_as
    except ImportError:
        return [True] * world
    return in_the_same_node_as(pg, source_rank=writer_rank)


def install() -> list:
    """Rebinds ``MessageQueue`` (and ``Handle``) to pinshm's inside vLLM:
    :func:`pinshm.vllm.plugin.install_message_queue`, where all rebinding
    into vLLM lives. Returns the modules rebound."""
    from .plugin import install_message_queue

    return install_message_queue()
