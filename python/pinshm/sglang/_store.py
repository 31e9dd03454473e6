"""The tokenizer's feature store (the writer) and the ranks' readers.

One cache store per tokenizer process, sparse (it costs the /dev/shm its
features touch), made at the first feature. A feature's key is SGLang's
item hash with its dtype and shape; a feature without a hash (a list's
elements) gets a key of its own and no reuse. Each object sent is leased
by the writer's own reader for ``PINSHM_SGLANG_GRACE_S`` seconds, so no
put evicts it before the ranks have read it; after that, only a rank's
read in progress holds it. Readers hold nothing between reads.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from .._pinshm import (
    FullError,
    InvalidArgumentError,
    Lease,
    NoSpaceError,
    ObjectHandle,
    ObjectStore,
    PinshmError,
    StoreReader,
)
from ..vllm._budget import shm_size

logger = logging.getLogger("pinshm.sglang")

#: The prefix of the name a pinshm feature travels under (SGLang's
#: ``shm_name``): ``pinshm:STORE:ADDRESS:ID:EPOCH``.
PREFIX = "pinshm:"
#: Every store the plugin makes is named so; a name read from a request
#: names no other segment.
STORE = re.compile(r"pinshm_sgl_[0-9]{1,10}_[0-9a-f]{8}")
_NUMBER = re.compile(r"[0-9]{1,20}")
MIB = 1 << 20


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        logger.warning("pinshm sglang: %s=%r is not a number; %s used", name, os.environ.get(name), default)
        return default


@dataclass(frozen=True)
class Ref:
    """Where a feature is: a store and an object's handle."""

    store: str
    handle: ObjectHandle

    def name(self) -> str:
        h = self.handle
        return f"{PREFIX}{self.store}:{h.address}:{h.monotonic_id}:{h.epoch}"

    @staticmethod
    def parse(name: str) -> Optional[Ref]:
        """The reference in `name`, or None where it is not pinshm's (or
        is malformed: nothing read from a pickle is trusted)."""
        if not name.startswith(PREFIX):
            return None
        parts = name[len(PREFIX) :].split(":")
        if len(parts) != 4 or not STORE.fullmatch(parts[0]) or not all(_NUMBER.fullmatch(p) for p in parts[1:]):
            return None
        address, ident, epoch = (int(p) for p in parts[1:])
        if min(address, ident, epoch) < 0 or max(address, ident, epoch) >= 1 << 64:
            return None
        return Ref(parts[0], ObjectHandle(address, ident, epoch))


class Writer:
    """The tokenizer process's store: puts features, serves repeats."""

    def __init__(self) -> None:
        size = shm_size() or 0
        want = int(_env_float("PINSHM_SGLANG_CACHE_MIB", 2048) * MIB)
        capacity = max(4 * MIB, min(want, size // 2 if size else want))
        self.grace = _env_float("PINSHM_SGLANG_GRACE_S", 300.0)
        name = f"pinshm_sgl_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.store = ObjectStore(
            capacity,
            capacity // 2,
            64,
            name=name,
            cache=True,
            reserve=False,
            pin="off",
            shm_headroom=min(256 * MIB, size // 8),
        )
        self.name = self.store.name
        try:
            from ..vllm import _tracker

            _tracker.track(self.name)  # removed after this process dies, SIGKILL included
        except Exception as e:  # noqa: BLE001 - best effort: `pinshm gc` is the fallback
            logger.debug("pinshm sglang: no reaper for %s: %s", self.name, e)
        self.own = StoreReader.attach_by_name(self.name, pin="off")
        self.pid = os.getpid()
        self.lock = threading.Lock()
        # One lease per object sent, its deadline pushed on at each send:
        # (deadline, key) in send order, and key -> (deadline, lease).
        self.order: collections.deque[tuple[float, int]] = collections.deque()
        self.leases: dict[int, tuple[float, Lease]] = {}
        self.puts = self.hits = self.fallbacks = 0
        logger.info(
            "pinshm sglang: multimodal features through /dev/shm/%s (%d MiB, sparse)", self.name, capacity // MIB
        )

    def put(self, data: Any, key: Optional[str]) -> Ref:
        """Stores `data` (a contiguous uint8 buffer) under `key` (None: a
        key of its own), or finds it stored; leases it for the grace
        period. OSError (ENOSPC) where it does not fit: SGLang then sends
        the tensor inline."""
        with self.lock:
            self._expire()
            h = self.store.get_cached(key) if key is not None else None
            if h is not None:
                self.hits += 1
            else:
                try:
                    h = self.store.put(key if key is not None else f"u:{uuid.uuid4().hex}", data)
                except (FullError, NoSpaceError, InvalidArgumentError) as e:
                    self.fallbacks += 1
                    raise OSError(errno.ENOSPC, f"pinshm store {self.name}: {e}") from e
                except PinshmError as e:
                    self.fallbacks += 1
                    raise OSError(errno.EIO, f"pinshm store {self.name}: {e}") from e
                self.puts += 1
            deadline = time.monotonic() + self.grace
            held = self.leases.get(h.monotonic_id)
            try:
                lease = held[1] if held is not None else self.own.lease(h)
            except PinshmError as e:  # gone meanwhile (a clear): not sent, SGLang goes inline
                self.fallbacks += 1
                raise OSError(errno.EIO, f"pinshm store {self.name}: {e}") from e
            self.leases[h.monotonic_id] = (deadline, lease)
            self.order.append((deadline, h.monotonic_id))
            return Ref(self.name, h)

    def _expire(self) -> None:
        now = time.monotonic()
        while self.order and self.order[0][0] <= now:
            _, ident = self.order.popleft()
            held = self.leases.get(ident)
            if held is not None and held[0] <= now:  # not sent again since
                del self.leases[ident]
                held[1].release()


_WRITER: Optional[Writer] = None
_WRITER_FAILED = False
_READERS: dict[str, StoreReader] = {}
_READERS_PID = 0
_LOCK = threading.Lock()


def writer() -> Optional[Writer]:
    """This process's writer, made at the first call (None where no store
    can be made here: then SGLang's own segments carry the features)."""
    global _WRITER, _WRITER_FAILED
    with _LOCK:
        if _WRITER is not None and _WRITER.pid == os.getpid():
            return _WRITER
        if _WRITER_FAILED:
            return None
        try:
            _WRITER = Writer()
        except Exception as e:  # noqa: BLE001 - SGLang's path stays
            _WRITER_FAILED = True
            logger.warning("pinshm sglang: no store for multimodal features (%s); SGLang's own path stays", e)
            return None
        return _WRITER


#: Features this process's ranks read in place (a private view of the
#: slot: no byte copied) and their bytes; nothing here copies a feature.
IN_PLACE = {"features": 0, "bytes": 0}


def count_in_place(nbytes: int) -> None:
    IN_PLACE["features"] += 1
    IN_PLACE["bytes"] += nbytes


def reader(store: str) -> StoreReader:
    """This process's reader of `store`, attached at first use."""
    global _READERS_PID
    with _LOCK:
        if _READERS_PID != os.getpid():  # a forked child: the parent's are not its own
            _READERS.clear()
            _READERS_PID = os.getpid()
        r = _READERS.get(store)
        if r is None:
            r = StoreReader.attach_by_name(store, pin="off")
            _READERS[store] = r
        return r
