"""A producer's half of the remote tier: a thread in the producer engine's
scheduler process that serves the node's store to consumers of other
nodes (``ec_connector_extra_config: {"serve": "HOST:PORT"}``).

It reads the store through a reader of its own, registers that reader's
mapping of the data region with a NIXL agent once (again only when the
name names another segment), and answers on a ZMQ ROUTER socket (the
messages: :mod:`._wire`). A lookup leases the key's object and names the
place of its elements; the lease ends when the consumer says done (after
its READ), or after ``lease_ttl_s``. Done re-checks the handle (the slot's
id and tag): an object whose slot was reused meanwhile is answered
unstable, and the consumer drops what it read.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from typing import Any, Optional

from ..._pinshm import Lease, ObjectHandle, PinshmError, StoreReader
from ._attach import NamedReader
from ._config import ECSettings
from ._wire import ITEMSIZE, PeerError, agent, field, made_here, pack, release, unpack

logger = logging.getLogger("vllm.pinshm.ec")

#: Leases out at once; a consumer that never says done is let go by the TTL.
MAX_LEASES = 4096
#: A lease whose TTL passed is remembered (its handle, not its hold) this
#: long after, so that a late done is still answered by a re-check.
REMEMBER_S = 30.0
POLL_MS = 50


class Server:
    """Serves `settings.store` on `settings.serve` until :meth:`close`."""

    def __init__(self, settings: ECSettings) -> None:
        assert settings.serve is not None
        self.settings = settings
        host, port = settings.serve
        # The agent first: NIXL and the extra's other modules, or an
        # ImportError that says what to install.
        self._agent = agent(f"pinshm-serve-{os.getpid()}-{port}", progress=True)
        try:
            import zmq

            self.agent_name = self._agent.name
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
            self._sock.bind(f"tcp://{host}:{port}")
            self._named = NamedReader(settings.store, settings.retry_s, pin="off")
        except BaseException:
            # A port taken, say: no agent (and its progress thread) left behind.
            release(self)
            raise
        self._registered: Optional[tuple[StoreReader, Any, int, int]] = None
        self._gen = 0
        self._ids = itertools.count(1)
        # lease id -> (lease or None once its TTL passed, handle, reader, deadline)
        self._leases: dict[int, tuple[Optional[Lease], ObjectHandle, StoreReader, float]] = {}
        self._stop = threading.Event()
        self.lookups = self.found = self.stable = self.unstable = 0
        self._thread = threading.Thread(target=self._run, name="pinshm-ec-serve", daemon=True)
        self._thread.start()
        logger.info("pinshm encoder cache: serving store %r on %s:%d over NIXL", settings.store, host, port)

    # ---- the region -------------------------------------------------

    def _region(self) -> Optional[tuple[StoreReader, int, int]]:
        """The reader and its registered region, registered anew when the
        name names another segment."""
        reader = self._named.get()
        if reader is None:
            return None
        if self._registered is not None and self._registered[0] is reader:
            _, _, base, length = self._registered
            return reader, base, length
        self._unregister()
        base, length = reader.data_region()
        descs = self._agent.register_memory([(base, length, 0, "")], "DRAM")
        self._registered = (reader, descs, base, length)
        self._gen += 1
        return reader, base, length

    def _unregister(self) -> None:
        if self._registered is not None:
            _, descs, _, _ = self._registered
            self._registered = None
            try:
                self._agent.deregister_memory(descs)
            except Exception as e:  # noqa: BLE001 - NIXL's errors
                logger.debug("pinshm encoder cache: deregistering the served region: %r", e)

    # ---- the loop ---------------------------------------------------

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                if self._sock.poll(POLL_MS, zmq.POLLIN):
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    if len(frames) >= 2:
                        reply = self._answer(frames[-1])
                        self._sock.send_multipart([*frames[:-1], pack(reply)])
                self._expire()
            except Exception as e:  # noqa: BLE001 - the server outlives any one request
                logger.warning("pinshm encoder cache: serving a request: %r", e)

    def _answer(self, data: bytes) -> dict[str, Any]:
        try:
            msg = unpack(data)
            op = field(msg, "op", str)
            if op == "hello":
                return self._hello()
            if op == "lookup":
                return self._lookup(field(msg, "key", str))
            if op == "done":
                return self._done(field(msg, "lease", int))
            raise PeerError(f"no such op {op!r}")
        except PeerError as e:
            return {"error": str(e)}

    def _hello(self) -> dict[str, Any]:
        region = self._region()
        if region is None:
            return {"error": f"store {self.settings.store!r} is not there yet"}
        _, base, length = region
        meta = self._agent.get_agent_metadata()
        return {"agent": self.agent_name, "meta": meta, "base": base, "length": length, "gen": self._gen}

    def _lookup(self, key: str) -> dict[str, Any]:
        self.lookups += 1
        region = self._region()
        if region is None or len(self._leases) >= MAX_LEASES:
            return {"found": False}
        reader, base, length = region
        try:
            lease = reader.lease_key(key)
        except PinshmError:
            lease = None
        if lease is None:
            return {"found": False}
        handle = lease.handle
        try:
            place = _place(reader, handle, base, length)
        except Exception as e:  # noqa: BLE001 - not a tensor, gone: a miss
            logger.debug("pinshm encoder cache: serving %s: %r", key, e)
            lease.release()
            return {"found": False}
        lid = next(self._ids)
        self._leases[lid] = (lease, handle, reader, time.monotonic() + self.settings.lease_ttl_s)
        self.found += 1
        offset, nbytes, dtype, shape = place
        return {
            "found": True,
            "lease": lid,
            "offset": offset,
            "nbytes": nbytes,
            "dtype": dtype,
            "shape": list(shape),
            "id": handle.monotonic_id,
            "epoch": handle.epoch,
            "gen": self._gen,
        }

    def _done(self, lid: int) -> dict[str, Any]:
        entry = self._leases.pop(lid, None)
        if entry is None:
            self.unstable += 1
            return {"stable": False}  # never leased, or forgotten: cannot tell
        lease, handle, reader, _ = entry
        try:
            # The slot's id and tag re-checked after the READ: the same
            # object all along (a slot reused has another id for good).
            reader.validate(handle)
            stable = True
        except PinshmError:
            stable = False
        if lease is not None:
            _release(lease)
        if stable:
            self.stable += 1
        else:
            self.unstable += 1
        return {"stable": stable}

    def _expire(self) -> None:
        now = time.monotonic()
        forget = now - REMEMBER_S
        for lid, (lease, handle, reader, deadline) in list(self._leases.items()):
            if lease is not None and deadline <= now:
                _release(lease)
                self._leases[lid] = (None, handle, reader, deadline)
            elif lease is None and deadline <= forget:
                del self._leases[lid]

    def close(self) -> None:
        """Stops serving; every lease ends. Twice is fine. In a forked child,
        nothing but letting go of its copy (the connections are the parent's)."""
        if self._agent is not None and not made_here(self._agent):
            release(self)
            return
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(5)
        for lease, _, _, _ in self._leases.values():
            if lease is not None:
                _release(lease)
        self._leases.clear()
        self._unregister()
        self._sock.close(0)
        self._ctx.term()
        self._named.close()
        # Destroyed now (see _wire.release), unless the serving thread
        # outlived its join.
        release(self, safe=not self._thread.is_alive())


def _place(reader: StoreReader, handle: ObjectHandle, base: int, length: int) -> tuple[int, int, str, tuple[int, ...]]:
    """(offset in the region, bytes, dtype, shape) of a tensor's elements."""
    import numpy as np

    guard = reader.get(handle)
    try:
        dtype, shape, at = guard.tensor_meta()
        view = np.frombuffer(guard, dtype=np.uint8)
        start = int(view.ctypes.data) + at - base
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        if at + nbytes > len(guard):
            raise ValueError(f"a {dtype} tensor of shape {shape} in an object of {len(guard)} bytes")
        del view
    finally:
        guard.release()
    if not 0 <= start <= length - nbytes:
        raise ValueError(f"a payload at {start} outside the region of {length}")
    return start, nbytes, dtype, tuple(shape)


def _release(lease: Lease) -> None:
    try:
        lease.release()
    except PinshmError as e:
        logger.debug("pinshm encoder cache: releasing a served lease: %r", e)
