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

import logging
import os
import secrets
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..._pinshm import Lease, ObjectStore, PinshmError, TensorReservation
from .._tracker import Tracked
from ..cache.storage import shm_headroom
from ._attach import NamedReader
from ._config import INDEX_BYTES_PER_KEY, MAX_INDEX_KEYS, MIN_INDEX_KEYS, ECSettings
from ._secret import keys_for, secure_client
from ._wire import VERSION, PeerError, Place, agent, check_place, made_here, pack, release, unpack
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
        self._agent: Any = None
        # The store's data region, registered with NIXL once (None: each
        # READ registers its slot, as where the whole region cannot be).
        self._region: Any = None
        self._stuck: list[tuple[Any, Any, TensorReservation]] = []
        self._absent: OrderedDict[str, float] = OrderedDict()
        self.fetched = self.not_found = self.unstable = self.peer_failures = 0
        if self.store is not None:
            # The agent first: NIXL and the extra's other modules, or an
            # ImportError that says what to install.
            self._agent = agent(f"pinshm-fetch-{os.getpid()}-{uuid.uuid4().hex[:8]}", progress=False)
            try:
                import zmq

                self._ctx = zmq.Context()
                self._region = self._register_region()
            except BaseException:
                release(self)
                raise
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

    def _register_region(self) -> Any:
        """Registers the writer's mapping of the data region with NIXL, for
        every READ into one of its slots; None if NIXL refuses it."""
        assert self.store is not None
        base, length = self.store.data_region()
        try:
            return self._agent.register_memory([(base, length, 0, "")], "DRAM")
        except Exception as e:  # noqa: BLE001 - NIXL's errors: register per READ instead
            logger.info(
                "pinshm encoder cache: registering store %r's data region (%d bytes) failed (%r): "
                "each READ registers its slot instead",
                self.settings.remote_store,
                length,
                e,
            )
            return None

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
        self._unstick()
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
        if peer.agent_name is None:
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

        assert self.store is not None
        try:
            res = self.store.reserve_tensor(key, place.dtype, list(place.shape))
        except (PinshmError, MemoryError, ValueError) as e:  # full, too large, being fetched
            logger.debug("pinshm encoder cache: no slot for %s: %r", key, e)
            self._tell_done(peer, place, deadline)
            return None
        # The slot's address (the reservation keeps the slot; no export
        # may be alive at publish).
        view = np.frombuffer(res, dtype=np.uint8)
        addr, size = int(view.ctypes.data), int(view.nbytes)
        del view
        xfer = reg = None
        state = "ERR"
        try:
            if size != place.nbytes:
                raise PeerError(f"a slot of {size} bytes for {place.nbytes}")
            if self._region is None:
                reg = self._agent.register_memory([(addr, size, 0, "")], "DRAM")
            local = self._agent.get_xfer_descs([(addr, size, 0)], "DRAM")
            remote = self._agent.get_xfer_descs([(peer.base + place.offset, size, 0)], "DRAM")
            xfer = self._agent.initialize_xfer("READ", local, remote, peer.agent_name)
            if before_read is not None:
                before_read(key)
            state = self._agent.transfer(xfer)
            pause = 20e-6
            while state == "PROC" and self._clock() < deadline:
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
                state = self._agent.check_xfer_state(xfer)
        finally:
            if state != "DONE" and not self._let_go(xfer, reg, res):
                # In flight still (NIXL could not cancel it): the slot is
                # kept, never published nor reused, until it can let go.
                self._stuck.append((xfer, reg, res))
                self._drop_agent(peer)
        if state != "DONE":
            raise PeerError("READ " + ("failed" if state == "ERR" else "not done in time"))
        self._let_go(xfer, reg, None)
        if after_read is not None:
            after_read(key)
        try:
            stable = wire_field(self._ask(peer, {"op": "done", "lease": place.lease}, deadline), "stable", bool)
        except PeerError:
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
            logger.info("pinshm encoder cache: first output fetched from peer %s (%d bytes)", peer.address, size)
        peer.fetched += 1
        reader = self.reader.for_epoch(handle.epoch)
        return None if reader is None else reader.lease(handle)

    def _let_go(self, xfer: Any, reg: Any, res: Optional[TensorReservation]) -> bool:
        """Ends a transfer and its registration; gives the slot back. False
        if NIXL could not end the transfer (nothing else is let go)."""
        if xfer is not None:
            try:
                self._agent.release_xfer_handle(xfer)
            except Exception as e:  # noqa: BLE001 - still in flight
                logger.debug("pinshm encoder cache: a READ could not be cancelled yet: %r", e)
                return False
        if reg is not None:
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:  # noqa: BLE001
                logger.debug("pinshm encoder cache: deregistering a slot: %r", e)
        if res is not None and self.store is not None:
            self.store.abort(res)
        return True

    def _unstick(self) -> None:
        if self._agent is not None:  # None once closed: what is stuck stays
            self._stuck = [s for s in self._stuck if not self._let_go(*s)]

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
        added = self._agent.add_remote_agent(meta)
        added = added.decode() if isinstance(added, bytes) else str(added)
        if added != name:
            self._agent.remove_remote_agent(added)
            raise PeerError(f"its metadata names agent {added!r}, not {name!r}")
        peer.agent_name, peer.base, peer.length, peer.gen = name, base, length, gen

    def _drop_agent(self, peer: Peer) -> None:
        name, peer.agent_name = peer.agent_name, None
        if name is not None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:  # noqa: BLE001
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
        """Detaches, closes the sockets and the store it writes. Twice is fine.
        In a forked child, nothing but letting go of its copy: the agent's
        connections and the sockets are the parent's."""
        if self._agent is not None and not made_here(self._agent):
            release(self)
            return
        self._unstick()
        for peer in self.peers:
            self._drop_agent(peer)
            if peer.sock is not None:
                peer.sock.close(0)
                peer.sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        region, self._region = self._region, None
        if region is not None and not self._stuck:
            try:
                self._agent.deregister_memory(region)
            except Exception as e:  # noqa: BLE001
                logger.debug("pinshm encoder cache: deregistering the data region: %r", e)
        self.reader.close()
        store, self.store = self.store, None
        if store is not None and not self._stuck:
            try:
                store.close()
            except (PinshmError, OSError) as e:
                logger.debug("pinshm encoder cache: closing store %r: %s", self.settings.remote_store, e)
        self._tracked.clear()
        # Destroyed now, not whenever the collector gets to it; kept while
        # a READ may still land (see _wire.release).
        release(self, safe=not self._stuck)
