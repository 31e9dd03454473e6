"""A consumer's half of the remote tier (``ec_connector_extra_config:
{"peers": ["HOST:PORT", ...]}``), in the consumer engine's scheduler.

Outputs fetched from other nodes land in a store of this node of their
own, ``remote_store`` (``<store>_remote``): the node's store has one
writer (a producer engine's worker), and this one has another, the first
consumer scheduler of the node that asks for it. Every rank of every
engine of the node reads it, so an output fetched once is a local hit for
all of them.

A fetch, within ``remote_timeout_s`` in all: a lookup at each peer in
turn (one that failed is skipped for ``peer_backoff_s``); a slot reserved
here for the answer's tensor; a NIXL READ of the peer's bytes straight
into it; done, which ends the peer's lease and says whether its slot held
the same object throughout; then the slot is published (or given back:
a miss). Whatever a peer does (nothing, garbage, dying mid-READ) costs a
miss within the budget. See docs/remote.md.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..._pinshm import Lease, ObjectStore, PinshmError
from .._tracker import Tracked
from ..cache.storage import shm_headroom
from ._attach import NamedReader
from ._config import INDEX_BYTES_PER_KEY, MAX_INDEX_KEYS, MIN_INDEX_KEYS, ECSettings
from ._fetcher import Fetcher
from ._secret import keys_for, secure_client
from ._wire import VERSION, PeerError, Place, check_place, digest, nixl, pack, unpack
from ._wire import field as wire_field

logger = logging.getLogger("vllm.pinshm.ec")

#: The longest a failed peer is skipped (the backoff doubles up to it).
MAX_BACKOFF_S = 60.0
#: A key no peer had is not asked for again this long: vLLM asks
#: `has_cache_item` again every step a request waits.
ABSENT_S = 1.0
MAX_ABSENT = 4096
#: Tests' hooks, called with the key just before a READ (to kill the peer)
#: and between a READ and its done (to reuse the slot).
before_read: Optional[Callable[[str], None]] = None
after_read: Optional[Callable[[str], None]] = None


@dataclass
class Peer:
    host: str
    port: int
    sock: Any = None
    agent_name: Optional[str] = None
    #: The start of the fetch process the agent was added to.
    fetcher_start: int = -1
    meta: bytes = b""
    base: int = 0
    length: int = 0
    gen: int = -1
    skip_until: float = 0.0
    backoff: float = 0.0
    failures: int = 0
    fetched: int = 0
    said: set[str] = field(default_factory=set)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class RemoteTier:
    """The node's store of fetched outputs, and the fetches into it."""

    def __init__(self, settings: ECSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._pid = os.getpid()
        # Before anything is made: a missing or open secret stops the
        # engine here, saying what to fix.
        self._keys = keys_for(settings.secret_file, settings.insecure) if settings.peers else None
        if self._keys is None and settings.peers:
            logger.warning(
                "pinshm encoder cache: asking peers %s WITHOUT authentication ('insecure': true): whoever "
                "answers on those addresses is believed; use 'secret_file' anywhere but a trusted lab network",
                ", ".join(f"{h}:{p}" for h, p in settings.peers),
            )
        self._tracked = Tracked()
        self.store = self._create()
        self.reader = NamedReader(settings.remote_store, settings.retry_s, pin="off")
        self.peers = [Peer(h, p) for h, p in settings.peers]
        self._ctx: Any = None
        # The NIXL agent lives in a fetch process of its own, never in this
        # one (the engine core): UCX over TCP lets whoever reaches an
        # agent's process read and write its memory (docs/security.md).
        self.fetcher: Optional[Fetcher] = None
        self._absent: OrderedDict[str, float] = OrderedDict()
        self.fetched = self.not_found = self.unstable = self.peer_failures = self.corrupt = 0
        if self.store is not None:
            # NIXL and the extra's other modules first, or an ImportError
            # that says what to install.
            nixl()
            import zmq

            self.fetcher = Fetcher(self.max_bytes, f"pinshm-fetch-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            self._ctx = zmq.Context()
        self.reader.get()

    def _create(self) -> Optional[ObjectStore]:
        s = self.settings
        capacity = s.remote_size - s.remote_size % ObjectStore.SLOT_ALIGN
        self.max_bytes = ObjectStore.largest_object(capacity, s.n_readers)
        if s.max_object_size is not None:
            self.max_bytes = min(self.max_bytes, s.max_object_size)
        try:
            store = ObjectStore(
                capacity,
                self.max_bytes,
                s.n_readers,
                name=s.remote_store,
                cache=True,
                key_index=min(MAX_INDEX_KEYS, max(MIN_INDEX_KEYS, capacity // INDEX_BYTES_PER_KEY)),
                # `reserve` as the node's store: reserved and pre-faulted,
                # so the workers' mappings are pinned on a GPU host. Never
                # pinned here: this is the engine core, which must not
                # make a CUDA context (the workers pin their own mappings).
                reserve=s.reserve,
                prefault=s.reserve,
                pin="off",
                shm_headroom=0 if s.reserve else shm_headroom() if s.shm_headroom is None else s.shm_headroom,
            )
        except (PinshmError, OSError, ValueError) as e:
            logger.warning(
                "pinshm encoder cache: store %r of fetched outputs is another engine's (or cannot be made: %s): "
                "this engine reads what that one fetched and fetches nothing itself",
                s.remote_store,
                e,
            )
            return None
        self._tracked.add(s.remote_store)
        return store

    # ---- local hits of what was fetched ----------------------------

    def lease_local(self, key: str) -> Optional[Lease]:
        """A lease on `key`'s object in the store of fetched outputs."""
        reader = self.reader.get()
        if reader is None:
            return None
        try:
            return reader.lease_key(key)
        except PinshmError:
            return None

    @property
    def epoch(self) -> Optional[int]:
        reader = self.reader.get()
        return None if reader is None else reader.epoch

    # ---- fetches ----------------------------------------------------

    def fetch(self, key: str) -> Optional[Lease]:
        """`key`'s output fetched from a peer into this node's store,
        published and leased; None (a miss) if no peer gives it in time."""
        if self.store is None or not self.peers:
            return None
        now = self._clock()
        if self._absent.get(key, now) > now:
            return None
        self._absent.pop(key, None)
        deadline = now + self.settings.remote_timeout_s
        asked = 0
        for peer in self.peers:
            now = self._clock()
            if now >= deadline:
                break
            if now < peer.skip_until:
                continue
            try:
                lease = self._from(peer, key, deadline)
            except PeerError as e:
                self._failed(peer, str(e))
                continue
            except Exception as e:  # noqa: BLE001 - NIXL's and ZMQ's errors: the peer is a miss
                self._failed(peer, repr(e))
                continue
            peer.backoff, peer.failures = 0.0, 0
            asked += 1
            if lease is not None:
                return lease
        if asked == len(self.peers):  # every peer answered that it has none
            self._absent[key] = self._clock() + ABSENT_S
            while len(self._absent) > MAX_ABSENT:
                self._absent.popitem(last=False)
        return None

    def _from(self, peer: Peer, key: str, deadline: float) -> Optional[Lease]:
        fetcher = self.fetcher
        if peer.agent_name is None or (fetcher is not None and peer.fetcher_start != fetcher.starts):
            # Never said hello, or the fetch process started again since
            # (the new one knows no agent of the peer's): hello anew.
            self._hello(peer, deadline)
        reply = self._ask(peer, {"op": "lookup", "key": key}, deadline)
        if not wire_field(reply, "found", bool):
            self.not_found += 1
            return None
        place = check_place(reply, peer.length, self.max_bytes)
        if place.gen != peer.gen:
            # It registered another segment since: its metadata anew.
            self._hello(peer, deadline)
            if place.gen != peer.gen:
                raise PeerError(f"region generation {place.gen}, hello said {peer.gen}")
        return self._read(peer, key, place, deadline)

    def _read(self, peer: Peer, key: str, place: Place, deadline: float) -> Optional[Lease]:
        import numpy as np

        assert self.store is not None and self.fetcher is not None
        try:
            res = self.store.reserve_tensor(key, place.dtype, list(place.shape))
        except (PinshmError, MemoryError, ValueError) as e:  # full, too large, being fetched
            logger.debug("pinshm encoder cache: no slot for %s: %r", key, e)
            self._tell_done(peer, place, deadline)
            return None
        slot: Any = None
        try:
            slot = np.frombuffer(res, dtype=np.uint8)
            if slot.nbytes != place.nbytes:
                raise PeerError(f"a slot of {slot.nbytes} bytes for {place.nbytes}")
            if before_read is not None:
                before_read(key)
            # Into the fetch process's staging buffer, then copied here and
            # checked: the slot keeps only the bytes the producer's digest names.
            left = deadline - self._clock()
            msg = {"op": "read", "name": peer.agent_name, "addr": peer.base + place.offset}
            state = self.fetcher.ask({**msg, "nbytes": place.nbytes, "timeout": left}, left)["state"]
            if state != "DONE":
                raise PeerError("READ " + ("failed" if state == "ERR" else "not done in time"))
            if after_read is not None:
                after_read(key)
            np.copyto(slot, np.frombuffer(self.fetcher.staging, dtype=np.uint8, count=place.nbytes))
            if not hmac.compare_digest(digest(slot), place.digest):
                self.corrupt += 1
                raise PeerError("the bytes read are not the ones the producer's digest names")
            slot = None  # no export of the reservation is alive at publish
            stable = wire_field(self._ask(peer, {"op": "done", "lease": place.lease}, deadline), "stable", bool)
        except BaseException:
            slot = None
            self.store.abort(res)
            raise
        if not stable:
            self.unstable += 1
            self.store.abort(res)
            logger.info("pinshm encoder cache: %s changed at %s during its READ: a miss", key, peer.address)
            return None
        handle = self.store.publish(res)
        self.fetched += 1
        if not peer.fetched:
            logger.info(
                "pinshm encoder cache: first output fetched from peer %s (%d bytes)", peer.address, place.nbytes
            )
        peer.fetched += 1
        reader = self.reader.for_epoch(handle.epoch)
        return None if reader is None else reader.lease(handle)

    def _tell_done(self, peer: Peer, place: Place, deadline: float) -> None:
        try:
            self._ask(peer, {"op": "done", "lease": place.lease}, deadline)
        except PeerError:
            pass  # its TTL ends the lease

    # ---- the control channel -----------------------------------------

    def _socket(self, peer: Peer) -> Any:
        import zmq

        if peer.sock is None:
            sock = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            # A request that timed out may be followed by the next one, and
            # a late answer to it is dropped, never taken for the next's.
            sock.setsockopt(zmq.REQ_RELAXED, 1)
            sock.setsockopt(zmq.REQ_CORRELATE, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
            # The producer binds leases to this id: random, the same across
            # reconnects, and sent only inside the encrypted handshake.
            sock.setsockopt(zmq.ROUTING_ID, b"c" + secrets.token_bytes(15))
            if self._keys is not None:
                secure_client(sock, self._keys)
            sock.connect(f"tcp://{peer.host}:{peer.port}")
            peer.sock = sock
        return peer.sock

    def _ask(self, peer: Peer, msg: dict[str, Any], deadline: float) -> dict[str, Any]:
        import zmq

        sock = self._socket(peer)
        left_ms = int((deadline - self._clock()) * 1000)
        if left_ms <= 0:
            raise PeerError("no time left")
        try:
            sock.send(pack(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise PeerError(f"cannot send: {e}") from None
        if not sock.poll(left_ms, zmq.POLLIN):
            raise PeerError(f"no answer to {msg.get('op')} within the budget")
        reply = unpack(sock.recv(zmq.NOBLOCK))
        if "error" in reply:
            raise PeerError(f"it says: {str(reply['error'])[:200]}")
        return reply

    def _hello(self, peer: Peer, deadline: float) -> None:
        reply = self._ask(peer, {"op": "hello"}, deadline)
        if reply.get("v") != VERSION:
            raise PeerError(f"protocol version {str(reply.get('v'))[:20]}, not {VERSION} (another pinshm release)")
        name = wire_field(reply, "agent", str)
        meta = wire_field(reply, "meta", bytes)
        base, length = wire_field(reply, "base", int), wire_field(reply, "length", int)
        gen = wire_field(reply, "gen", int)
        if base <= 0 or length <= 0:
            raise PeerError(f"a region at {base} of {length} bytes")
        self._drop_agent(peer)
        assert self.fetcher is not None
        added = str(self.fetcher.ask({"op": "add", "meta": meta}, 5.0)["name"])
        if added != name:
            self.fetcher.ask({"op": "remove", "name": added}, 5.0)
            raise PeerError(f"its metadata names agent {added!r}, not {name!r}")
        peer.agent_name, peer.meta, peer.base, peer.length, peer.gen = name, meta, base, length, gen
        peer.fetcher_start = self.fetcher.starts

    def _drop_agent(self, peer: Peer) -> None:
        name, peer.agent_name = peer.agent_name, None
        fetcher = self.fetcher
        # Only the process that added it knows it (one started since has not).
        if name is not None and fetcher is not None and fetcher.alive and peer.fetcher_start == fetcher.starts:
            try:
                fetcher.ask({"op": "remove", "name": name}, 5.0)
            except Exception as e:  # noqa: BLE001 - a miss at worst, never the scheduler's error
                logger.debug("pinshm encoder cache: forgetting agent %s: %r", name, e)

    def _failed(self, peer: Peer, why: str) -> None:
        self.peer_failures += 1
        peer.failures += 1
        peer.backoff = min(MAX_BACKOFF_S, max(self.settings.peer_backoff_s, peer.backoff * 2))
        peer.skip_until = self._clock() + peer.backoff
        self._drop_agent(peer)
        if peer.sock is not None:
            peer.sock.close(0)
            peer.sock = None
        what = "first" if peer.failures == 1 else "again"
        log = logger.warning if peer.failures == 1 else logger.debug
        log(
            "pinshm encoder cache: peer %s failed (%s): a miss; skipped for %.3g s (%s)",
            peer.address,
            why,
            peer.backoff,
            what,
        )

    def close(self) -> None:
        """Detaches, closes the sockets, the fetch process and the store it
        writes. Twice is fine. In a forked child, nothing but letting go of
        its copies: the sockets and the fetch process are the parent's."""
        if os.getpid() != self._pid:
            self.fetcher = None
            return
        for peer in self.peers:
            self._drop_agent(peer)
            if peer.sock is not None:
                peer.sock.close(0)
                peer.sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        fetcher, self.fetcher = self.fetcher, None
        if fetcher is not None:
            fetcher.close()
        self.reader.close()
        store, self.store = self.store, None
        if store is not None:
            try:
                store.close()
            except (PinshmError, OSError) as e:
                logger.debug("pinshm encoder cache: closing store %r: %s", self.settings.remote_store, e)
        self._tracked.clear()
