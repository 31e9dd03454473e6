"""The tokenizer's feature store (the writer) and the ranks' readers.

One cache store per tokenizer process, sparse (it costs the /dev/shm its
features touch), made at the first feature. A feature's key is SGLang's
item hash with its dtype and shape; a feature without a hash (a list's
elements) gets a key of its own and no reuse. Each object sent is leased
by the writer's own reader, so no put evicts it before the ranks have
read it: until every request that sent it has finished (SGLang's
tokenizer sees each request's last output, which comes after a prefill
every rank of its group ran), and at most ``PINSHM_SGLANG_GRACE_S``
seconds (a request whose end is never seen). After that only the ranks'
tensors hold it: a rank's feature tensor is a private copy-on-write view
of the slot (``StoreReader.get_private``), which holds the slot for as
long as the tensor lives.
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

from .._node.budget import MIB, shm_size
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
from ..segments import gc_segments

logger = logging.getLogger("pinshm.sglang")

#: The prefix of the name a pinshm feature travels under (SGLang's
#: ``shm_name``): ``pinshm:STORE:ADDRESS:ID:EPOCH``.
PREFIX = "pinshm:"
#: Every store the plugin makes is named so; a name read from a request
#: names no other segment.
STORE = re.compile(r"pinshm_sgl_[0-9]{1,10}_[0-9a-f]{8}")
_NUMBER = re.compile(r"[0-9]{1,20}")


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


def ranks() -> Optional[int]:
    """How many scheduler processes may read this server's features: TP ×
    DP × PP from SGLang's published server arguments (every scheduler,
    an upper bound on the readers: only the first pipeline stage reads),
    or ``PINSHM_SGLANG_RANKS``; None where neither says."""
    given: Optional[int] = None
    raw = os.environ.get("PINSHM_SGLANG_RANKS", "").strip()
    if raw:
        try:
            given = max(1, int(raw))
        except ValueError:
            logger.warning("pinshm sglang: PINSHM_SGLANG_RANKS=%r is not a number; ignored", raw)
    try:
        from sglang.srt.runtime_context import get_server_args

        a = get_server_args()
        found = int(a.tp_size) * int(getattr(a, "dp_size", 1) or 1) * int(getattr(a, "pp_size", 1) or 1)
    except Exception:  # noqa: BLE001 - not published here (a test, another launcher)
        return given
    # The variable may raise the count, never lower it below SGLang's: a
    # name unlinked before a rank attached would fail that rank's features.
    return max(found, given or 0)


class Writer:
    """The tokenizer process's store: puts features, serves repeats.

    Its reader table holds every rank (TP × DP × PP, at least 64 entries).
    Once every rank has attached, the store's name leaves /dev/shm (the
    store serves on): from then a SIGKILL of every process of the server,
    an engine that is PID 1 of its container included, leaves nothing.
    Until then the reaper removes it; a store a PID-1 engine left before
    that is removed by the next server's first feature (abandoned stores
    of this user, writer dead, are swept)."""

    def __init__(self) -> None:
        size = shm_size() or 0
        self.ranks = ranks()
        # The ranks, this process's own, one spare; where the count is
        # unknown, room for 255 ranks (12 bytes of each slot apiece).
        n_readers = max(64, self.ranks + 2) if self.ranks is not None else 256
        want = int(_env_float("PINSHM_SGLANG_CACHE_MIB", 2048) * MIB)
        capacity = max(4 * MIB, min(want, size // 2 if size else want))
        self.grace = _env_float("PINSHM_SGLANG_GRACE_S", 300.0)
        self.min_grace = min(self.grace, _env_float("PINSHM_SGLANG_MIN_GRACE_S", 60.0))
        name = f"pinshm_sgl_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        try:  # stores of servers killed before their names left (a PID-1 engine's)
            for gone in gc_segments("pinshm_sgl_", dry_run=False):
                logger.info("pinshm sglang: removed %s, left by a dead server", gone.name)
        except Exception as e:  # noqa: BLE001 - best effort
            logger.debug("pinshm sglang: no sweep of dead servers' stores: %s", e)
        self.store = ObjectStore(
            capacity,
            capacity // 2,
            n_readers,
            name=name,
            cache=True,
            reserve=False,
            pin="off",
            shm_headroom=min(256 * MIB, size // 8),
        )
        # reap=True (the default): removed after this process dies, SIGKILL included.
        self.name = self.store.name
        self.own = StoreReader.attach_by_name(self.name, pin="off")
        self.pid = os.getpid()
        self.lock = threading.Lock()
        # One lease per object sent, its deadline pushed on at each send:
        # (deadline, key) in send order, and key -> (deadline, lease).
        self.order: collections.deque[tuple[float, int]] = collections.deque()
        self.leases: dict[int, tuple[float, Lease]] = {}
        # The requests whose features were sent and that have not finished
        # (SGLang's rid -> (deadline, object ids)), and per object how many
        # of them sent it: when the last one finishes, every rank has read
        # the object (a request's output comes after its prefill, which
        # every rank of its group runs), so its lease ends then, not after
        # the grace period. Ids put since the last request was claimed
        # wait in `unclaimed` (wrap_shm_features puts, then says the rid).
        self.requests: collections.OrderedDict[str, tuple[float, list[int]]] = collections.OrderedDict()
        self.sending: dict[int, int] = {}
        self.unclaimed: list[int] = []
        self.finished_early = 0
        self.puts = self.hits = self.fallbacks = self.mismatches = 0
        self.named = True  # the store's name is in /dev/shm
        self.next_look = 0.0
        logger.info(
            "pinshm sglang: multimodal features through /dev/shm/%s (%d MiB, sparse)", self.name, capacity // MIB
        )

    def put(self, flat: Any, key: Optional[str]) -> Ref:
        """Stores `flat` (a contiguous 1-D uint8 CPU tensor) under `key`
        (None: a key of its own), or finds it stored; leases it until the
        request it is sent for (`claim`) finishes, the grace period at
        most. OSError (ENOSPC) where it does not fit: SGLang then sends
        the tensor inline."""
        data = flat.numpy()
        with self.lock:
            self._expire()
            h = self.store.get_cached(key) if key is not None else None
            if h is not None and not self._holds(h, data):
                # The hash is not proof: a client may send its own
                # (SGLang's mm_hashes). Another feature under this key is
                # never sent; this one is put under a key of its own.
                self.mismatches += 1
                if self.mismatches == 1:
                    logger.warning("pinshm sglang: a feature's hash names other bytes in the store; not reused")
                h, key = None, None
            if h is not None:
                self.hits += 1
            else:
                try:
                    h = self._put(key if key is not None else f"u:{uuid.uuid4().hex}", flat)
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
            self.sending[h.monotonic_id] = self.sending.get(h.monotonic_id, 0) + 1
            self.unclaimed.append(h.monotonic_id)
            if self.named and self.ranks is not None:
                self._unlink_once_all_attached()
            return Ref(self.name, h)

    def claim(self, rid: Optional[str]) -> None:
        """The objects put since the last claim were sent for request
        `rid` (SGLang's, None where it has none: then only the grace
        period ends their leases)."""
        with self.lock:
            ids, self.unclaimed = self.unclaimed, []
            if not ids:
                return
            if rid is None:
                rid = f"pinshm-norid:{uuid.uuid4().hex}"  # never finished: expires
            elif rid in self.requests:  # a rid sent again (a client's own): the first is done
                self._finish(rid, release=True)
            self.requests[rid] = (time.monotonic() + self.grace, ids)

    def finished(self, rid: str) -> None:
        """Request `rid` has finished (SGLang's tokenizer got its last
        output): the leases of objects no unfinished request sent end."""
        with self.lock:
            self._finish(rid, release=True)

    def _finish(self, rid: str, release: bool) -> None:
        entry = self.requests.pop(rid, None)
        if entry is None:
            return
        for ident in entry[1]:
            n = self.sending.get(ident, 0) - 1
            if n > 0:
                self.sending[ident] = n
                continue
            self.sending.pop(ident, None)
            held = self.leases.pop(ident, None) if release else None
            if held is not None:
                held[1].release()
                self.finished_early += 1

    def _holds(self, h: ObjectHandle, data: Any) -> bool:
        """Whether the object at `h` is byte for byte `data` (a uint8
        array): read in place, compared a MiB at a time (numpy, the GIL
        released), which costs less than the copy a put would make."""
        import numpy as np

        try:
            with self.own.get(h) as g:
                a = np.frombuffer(g, dtype=np.uint8)
                same = a.size == data.size and all(
                    np.array_equal(a[i : i + MIB], data[i : i + MIB]) for i in range(0, a.size, MIB)
                )
                del a
            return same
        except PinshmError:
            return False

    def _unlink_once_all_attached(self) -> None:
        """Removes the store's name once every rank has attached (looked at
        once a second at most: the reader table costs a lock test per
        entry). Ranks are other processes; this process's own readers do
        not count."""
        now = time.monotonic()
        if now < self.next_look:
            return
        self.next_look = now + 1.0
        me = os.getpid()
        attached = {pid for _, pid in self.own.live_readers() if pid != me}
        if len(attached) >= (self.ranks or 0):
            self.store.unlink()
            self.named = False
            logger.info(
                "pinshm sglang: all %d ranks attached; %s left /dev/shm (nothing of it outlives the server)",
                len(attached),
                self.name,
            )

    def _put(self, key: str, flat: Any) -> ObjectHandle:
        """A put that, where the store is full of leased objects, first
        lets go of the leases older than ``PINSHM_SGLANG_MIN_GRACE_S`` (60
        s) and tries once more. A scheduler reads a feature as it receives
        its request (well within that, unless requests wait that long before
        any scheduler takes them: then such a request fails, as SGLang fails
        a feature it cannot read, where a store never full would have sent
        it); a rank's tensor holds its slot by itself, so what is freed is
        only what nobody reads any more."""
        try:
            return self._copy_in(key, flat)
        except FullError:
            cut = time.monotonic() + self.grace - self.min_grace  # leased before this: old enough
            freed = 0
            for ident, (deadline, lease) in list(self.leases.items()):
                if deadline <= cut:
                    del self.leases[ident]
                    lease.release()
                    freed += 1
            if not freed:
                raise
            return self._copy_in(key, flat)

    def _copy_in(self, key: str, flat: Any) -> ObjectHandle:
        """Copies `flat` into a slot reserved for it with torch's ``copy_``,
        as SGLang copies a feature into its segment: on torch's intra-op
        threads, so a large feature's copy is spread over them, and the
        tokenizer's threads are what they are without the plugin (a copy
        of pinshm's own, on one thread, left libgomp spinning the image
        processor's workers harder on a small host: docs/sglang.md)."""
        import torch

        res = self.store.reserve_bytes(key, flat.numel())
        try:
            if flat.numel():  # torch.frombuffer refuses an empty buffer
                dst = torch.frombuffer(res, dtype=torch.uint8)
                dst.copy_(flat)
                del dst  # the export ends before the publish
            return self.store.publish(res)
        except BaseException:
            self.store.abort(res)
            raise

    def _expire(self) -> None:
        now = time.monotonic()
        # Requests never seen to finish (failed before dispatch, or their
        # output went elsewhere) stop counting with their grace period.
        while self.requests:
            rid, (deadline, _) = next(iter(self.requests.items()))
            if deadline > now:
                break
            self._finish(rid, release=False)
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


def current() -> Optional[Writer]:
    """This process's writer if it has made one (never makes one)."""
    w = _WRITER
    return w if w is not None and w.pid == os.getpid() else None


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
