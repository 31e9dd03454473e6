"""One budget for the node's /dev/shm, shared by every pinshm segment on it.

The kernel's free count of /dev/shm is the shared ledger: no process needs
to agree with another, each backs pages only within its part's rule.

- **vLLM's own** (:func:`vllm_reserve`): what vLLM itself puts in /dev/shm
  beside pinshm (its CPU communicator's 8 MiB, its own queues where they
  fit). Every pinshm part below leaves it free.
- **Queues** (:func:`queue_slot_bytes`): a pinshm queue backs its
  channel's slots when it is created, so no chunk-sized send of a started
  queue can fail for lack of /dev/shm. A slot is vLLM's chunk
  (``max_chunk_bytes``), shrunk to the queue's share of the node
  (:func:`queue_share`) and to what is free; a queue that cannot get
  ``max_chunks`` slots of 64 KiB refuses to start, naming that size.
- **Overflow** (a queue's store for messages larger than a slot): sparse;
  it grows while /dev/shm keeps vLLM's reserve free. Where it cannot, the
  message goes through the channel's backed slots in pieces (slower,
  never failed).
- **Cache** (the multimodal cache, the elastic tenant): sparse; it grows
  only while /dev/shm keeps :func:`cache_headroom` free (vLLM's reserve
  plus the overflow's share), and reuses what it has beyond that. So a
  cache never takes what a started queue may need.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

logger = logging.getLogger("pinshm")

SHM_PATH = "/dev/shm"
KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
#: The smallest slot a queue is given (pinshm's backing chunk).
SLOT_UNIT = 64 * KIB
#: vLLM's CPU communicator's segment (its shm all-reduce buffers).
VLLM_COMMUNICATOR_BYTES = 8 * MIB


def shm_size(path: str = SHM_PATH) -> Optional[int]:
    """Size of the filesystem at `path` (None where there is none)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def shm_free(path: str = SHM_PATH) -> Optional[int]:
    """Free bytes of the filesystem at `path` (None where there is none)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def vllm_reserve(size: int) -> int:
    """What every pinshm part leaves free for vLLM's own segments: its CPU
    communicator's 8 MiB, at most an eighth of /dev/shm."""
    return min(VLLM_COMMUNICATOR_BYTES, size // 8)


def overflow_share(size: int) -> int:
    """What the cache leaves the queues' overflow stores: a quarter of
    /dev/shm, at most 1 GiB (16 MiB of a container's 64 MiB)."""
    return min(size // 4, GIB)


def cache_headroom(size: int) -> int:
    """Free bytes of /dev/shm a sparse cache leaves when it grows."""
    return vllm_reserve(size) + overflow_share(size)


def reserved_store(size: int, stores: int = 1) -> int:
    """The default capacity of a reserved store (the encoder cache's, with
    ``serve`` or ``reserve``), of `stores` such stores of one engine: what
    /dev/shm holds after a sparse cache's headroom (vLLM's segments, the
    queues' overflow), shared among them, in whole MiB: 760 MiB of a 1 GiB
    /dev/shm, 40 MiB of a container's 64 MiB."""
    return max(0, (size - cache_headroom(size)) // max(1, stores)) // MIB * MIB


#: The most one queue's channel backs on a roomy node: vLLM's messages
#: are mostly small, and a node runs many queues (an engine of TP=8 has
#: ten); larger messages go through the sparse overflow store.
QUEUE_SHARE_MAX = 8 * MIB


def queue_share(size: int) -> int:
    """The most one queue's channel backs: a sixteenth of /dev/shm, at most
    8 MiB (4 MiB of a container's 64 MiB, 1 MiB of 16 MiB)."""
    return min(size // 16, QUEUE_SHARE_MAX)


def queue_slot_bytes(max_chunk_bytes: int, max_chunks: int, size: Optional[int], free: Optional[int]) -> int:
    """The slot size of a pinshm queue asked for vLLM's `max_chunks` chunks
    of `max_chunk_bytes`: vLLM's chunk, within the queue's share and what
    is free less vLLM's reserve, rounded down to 64 KiB. A message larger
    than a slot goes through the overflow store (or in pieces).

    Raises :class:`QueueNoRoom` where even ``max_chunks`` slots of 64 KiB
    (or of the chunk, if smaller) do not fit."""
    smallest = min(max_chunk_bytes, SLOT_UNIT)
    if size is None or free is None:
        return max_chunk_bytes  # no /dev/shm to budget (vLLM skips its check too)
    room = min(queue_share(size), free - vllm_reserve(size)) // max(1, max_chunks)
    slot = min(max_chunk_bytes, room)
    if slot >= SLOT_UNIT:
        slot -= slot % SLOT_UNIT
    if slot < smallest:
        raise QueueNoRoom(max_chunks * smallest, vllm_reserve(size), free)
    return slot


class QueueNoRoom(MemoryError):
    """/dev/shm cannot back even the smallest channel a queue works with."""

    def __init__(self, slots: int, reserve: int, free: int) -> None:
        self.needed, self.free = slots + reserve, free
        super().__init__(
            f"pinshm MessageQueue: /dev/shm has {free / MIB:.2f} MiB free; a queue needs "
            f"{self.needed / MIB:.2f} MiB: {slots / MIB:.2f} MiB of slots, backed now so that no "
            f"send fails later, and {reserve / MIB:.2f} MiB left for vLLM's own segments. "
            "Give the container more /dev/shm (docker --shm-size)"
        )


def shm_headroom(size: Optional[int] = None) -> int:
    """Free bytes of /dev/shm a sparse cache leaves when it grows, for the
    queues and other segments beside it, which cannot fail where a cache
    can reuse what it has: ``PINSHM_VLLM_SHM_HEADROOM`` (bytes), else the
    node budget's (:func:`cache_headroom`: vLLM's own
    8 MiB plus a quarter of /dev/shm, at most 1 GiB, for the queues'
    overflow; 24 MiB of a container's 64 MiB). `size`: of a /dev/shm to
    plan for (``doctor --shm-mib``), this machine's by default."""
    value = os.environ.get("PINSHM_VLLM_SHM_HEADROOM")
    if value:
        try:
            return max(0, int(value))
        except ValueError:
            logger.warning("PINSHM_VLLM_SHM_HEADROOM=%r is not a byte count; using the default", value)
    size = shm_size() if size is None else size
    return 0 if size is None else cache_headroom(size)
