"""``PINSHM_VLLM_MESSAGE_QUEUE=auto`` (the default): each queue is vLLM's
where vLLM's would fit in /dev/shm, pinshm's where it would not.

vLLM checks, as it builds a queue's ring (and its tensor arena), that the
ring's bytes fit in /dev/shm's free space, and refuses to start otherwise:
in a container's default 64 MiB, its TP engine never starts. pinshm's queue
is sparse (it costs the pages its messages touch) and fails one message
with ``NoSpaceError`` rather than the engine. So :class:`AutoMessageQueue`,
bound to the name ``MessageQueue`` inside vLLM, makes that same check as
each queue is built and builds pinshm's queue where vLLM's would raise.

The choice holds across processes without any agreement: whoever builds a
queue decides, and ``create_from_handle`` follows the handle it is given
(pinshm's :class:`~pinshm.vllm.queue.Handle` gives pinshm's reader,
anything else vLLM's), so processes that look at /dev/shm at different
moments still read the queue they were handed.

Why this and not pinshm's queue everywhere: serving through vLLM's HTTP
server (examples/vllm_e2e/serve_bench.py, docs/vllm.md) puts pinshm's
queue behind at concurrency 1 in end-to-end latency, ahead at 8 and 32.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from typing import Any, Optional

from ..._node.budget import MIB, SHM_PATH
from .. import _status
from .message_queue import Handle as PinshmHandle
from .message_queue import MessageQueue as PinshmMessageQueue

# vLLM 0.33's tensor arena: one slot of this size per arena
# (shm_tensor_arena._ARENA_SLOT_BYTES), checked like the ring.
ARENA_SLOT_BYTES = 256 * MIB

logger = logging.getLogger("vllm.plugins.pinshm")
_said: set[str] = set()
_said_lock = threading.Lock()


def vllm_queue_bytes(n_local_reader: int, max_chunk_bytes: int, max_chunks: int, arena: bool) -> int:
    """The /dev/shm bytes vLLM 0.33 checks for before it builds a queue:
    its ring, ``max_chunks`` chunks of ``max_chunk_bytes`` each with one
    metadata byte per reader plus one (``ShmRingBuffer``), and its tensor
    arena when enabled. Nothing without local readers."""
    if n_local_reader <= 0:
        return 0
    ring = (max_chunk_bytes + 1 + n_local_reader) * max_chunks
    return ring + (ARENA_SLOT_BYTES + 1 + n_local_reader if arena else 0)


def shm_free_bytes(path: str = SHM_PATH) -> Optional[int]:
    """Free bytes of the filesystem at `path` (None where there is none:
    vLLM skips its check then, and so does the choice)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def queue_mode() -> str:
    """``PINSHM_VLLM_MESSAGE_QUEUE``: ``auto`` (unset or empty too), ``1``
    or ``0``; anything else is ``auto``, with a warning. The plugin binds
    by it, and ``doctor`` plans by it."""
    value = os.environ.get("PINSHM_VLLM_MESSAGE_QUEUE", "").strip().lower() or "auto"
    if value not in ("auto", "1", "0"):
        _status.warn("pinshm: PINSHM_VLLM_MESSAGE_QUEUE=%s is not auto, 1 or 0; using auto", value)
        return "auto"
    return value


def vllm_fits(need: int, free: Optional[int]) -> bool:
    """Whether vLLM's own queue, asking /dev/shm for `need` bytes, passes
    its own check with `free` bytes free (None: unknown; vLLM skips its
    check then). ``auto`` keeps vLLM's queue exactly then; ``doctor``
    plans with this too."""
    return need == 0 or free is None or need <= free


def choose(n_local_reader: int, max_chunk_bytes: int, max_chunks: int, arena: bool) -> tuple[bool, str]:
    """(use pinshm's queue, why), by vLLM's own check."""
    need = vllm_queue_bytes(n_local_reader, max_chunk_bytes, max_chunks, arena)
    free = shm_free_bytes()
    free_mib = 0 if free is None else free / MIB
    if vllm_fits(need, free):
        where = f"it needs {need / MIB:.0f} MiB of /dev/shm, {free_mib:.0f} MiB free"
        if need == 0:
            where = "no local readers"
        return False, f"vLLM's queue in use: {where}"
    return True, f"pinshm queue in use: vLLM's needs {need / MIB:.0f} MiB of /dev/shm, {free_mib:.0f} MiB free"


def _say(line: str, pinshm_chosen: bool) -> None:
    """Logs each distinct choice once per process (INFO for pinshm's, the
    one a user should know about; DEBUG for vLLM's)."""
    key = line.split(":", 1)[0]
    with _said_lock:
        if key in _said:
            return
        _said.add(key)
    logger.log(logging.INFO if pinshm_chosen else logging.DEBUG, "%s", line)


def make(vllm_class: Any) -> type:
    """The class to bind to ``MessageQueue`` inside vLLM, choosing between
    `vllm_class` (vLLM's own) and pinshm's for each queue built."""

    class Forward(type):
        """What vLLM's own code reaches through the name ``MessageQueue``
        besides building queues (``MessageQueue.recv`` inside its
        ``dequeue``, ``MessageQueue.ReadTimeoutWithWarnings``): vLLM's."""

        def __getattr__(cls, name: str) -> Any:
            return getattr(vllm_class, name)

    class AutoMessageQueue(metaclass=Forward):
        """vLLM's ``MessageQueue`` or pinshm's, per queue: see the module
        doc. Constructing it returns an instance of the chosen class."""

        vllm = vllm_class
        pinshm = PinshmMessageQueue

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            if not args and not kwargs:
                # vLLM's own create_from_handle makes its reader with
                # `MessageQueue.__new__(MessageQueue)` (the name is this
                # class now) and fills it in: a bare instance of vLLM's.
                return object.__new__(vllm_class)
            return cls._build(*args, **kwargs)

        @staticmethod
        def _build(
            n_reader: int,
            n_local_reader: int,
            local_reader_ranks: Optional[list[int]] = None,
            max_chunk_bytes: int = 1024 * 1024 * 24,
            max_chunks: int = 10,
            connect_ip: Optional[str] = None,
            enable_shm_tensor_arena: bool = False,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            use_pinshm, why = choose(n_local_reader, max_chunk_bytes, max_chunks, enable_shm_tensor_arena)
            _say(why, use_pinshm)
            chosen = PinshmMessageQueue if use_pinshm else vllm_class
            return chosen(
                n_reader,
                n_local_reader,
                local_reader_ranks,
                max_chunk_bytes,
                max_chunks,
                connect_ip,
                enable_shm_tensor_arena,
                *args,
                **kwargs,
            )

        @staticmethod
        def create_from_handle(handle: Any, rank: int) -> Any:
            """The reader of whichever queue `handle` belongs to."""
            if isinstance(handle, PinshmHandle):
                return PinshmMessageQueue.create_from_handle(handle, rank)
            return vllm_class.create_from_handle(handle, rank)

        # vLLM's own group helpers: they build the writer as
        # `MessageQueue(...)` and the readers with
        # `MessageQueue.create_from_handle`, looked up in vLLM's module,
        # where this class is bound, so each follows the choice above.
        create_from_process_group = staticmethod(vllm_class.create_from_process_group)
        if hasattr(vllm_class, "create_from_process_group_single_reader"):
            create_from_process_group_single_reader = staticmethod(vllm_class.create_from_process_group_single_reader)

    AutoMessageQueue.__qualname__ = AutoMessageQueue.__name__ = "MessageQueue"
    AutoMessageQueue.__module__ = __name__
    return AutoMessageQueue
