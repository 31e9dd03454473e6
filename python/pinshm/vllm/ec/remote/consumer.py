"""A consumer's half of the remote tier (``ec_connector_extra_config:
{"peers": ["HOST:PORT", ...]}``), in the consumer engine's scheduler
process, off the scheduler's path.

Outputs fetched from other nodes land in a store of this node of their
own, ``remote_store`` (``<store>_remote``): the node's store has one
writer (a producer engine's worker), and this one has another, the first
consumer scheduler of the node that asks for it. Every rank of every
engine of the node reads it, so an output fetched once is a local hit for
all of them.

The scheduler never waits on the network. It calls :meth:`RemoteTier.want`
with a request's keys (vLLM's ``ensure_cache_available``), which queues
them and returns; vLLM defers the request while :meth:`RemoteTier.pending`
says a key is in flight, and schedules every other request meanwhile. A
thread of this process (:meth:`RemoteTier._run`), which alone holds the
sockets, fetches them, a batch at a time, within ``remote_timeout_s``:

1. one lookup of every key of the batch at every peer not backed off,
   all at once (the first answer to name a key wins it; a peer slower
   than its share of the budget is backed off as one that failed);
2. a slot reserved here for each output found, and one NIXL READ of all
   of them from that peer, into the fetch process's staging buffer
   (:mod:`.fetcher`);
3. each output copied from staging into its slot and hashed in the same
   pass (BLAKE3, native code, the GIL released), and published only if
   the digest is the one the producer sent over the authenticated
   channel; then ``done`` ends the producer's leases, without waiting
   for its answer (the digest already proves the bytes).

Whatever a peer does (nothing, garbage, late answers, dying mid-READ)
costs a miss within the budget. See docs/remote.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, Callable, Optional

from ...._node.budget import shm_headroom
from ...._node.tracker import Tracked
from ...._pinshm import Lease, NoSpaceError, ObjectStore, PinshmError, UntrustedError
from .._attach import NamedReader
from .._config import INDEX_BYTES_PER_KEY, MAX_INDEX_KEYS, MIN_INDEX_KEYS, ECSettings, does_not_fit
from .agents import drop_agent, hello
from .fetcher import Fetcher, FetcherError
from .keys import keys_for
from .nixl import nixl
from .peers import Peer
from .protocol import MAX_KEYS, PeerError, Place, check_place
from .protocol import field as wire_field
from .reads import read

logger = logging.getLogger("vllm.pinshm.ec")

#: A key that was not fetched (no peer had it, or its fetch failed) is
#: not asked for again this long: vLLM asks again every step a request
#: waits.
ABSENT_S = 1.0
MAX_ABSENT = 4096
#: Keys queued or in flight at most (more are misses at once).
MAX_PENDING = 4096
#: How long the fetching thread sleeps when it has nothing to do (it is
#: woken at once by a new key).
IDLE_S = 0.5
#: How long a hello may take before the peer counts as failed (the
#: producer registers its store with NIXL at the first one).
HELLO_S = 5.0
#: How often the fetching thread reads answers while a hello is on the way.
HELLO_POLL_S = 0.005


class RemoteTier:
    """The node's store of fetched outputs, and the fetches into it."""

    def __init__(self, settings: ECSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
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
        # Shared with the fetching thread, under the lock: keys queued,
        # keys in flight (each with its deadline), keys no peer had.
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._queue: OrderedDict[str, None] = OrderedDict()
        self._pending: set[str] = set()
        self._absent: OrderedDict[str, float] = OrderedDict()
        self._closing = False
        self._batch = 0
        self.fetched = self.not_found = self.peer_failures = self.corrupt = self.slow_answers = 0
        # The NIXL agent lives in a fetch process of its own, never in this
        # one (the engine core): UCX over TCP lets whoever reaches an
        # agent's process read and write its memory (docs/security.md).
        self.fetcher: Optional[Fetcher] = None
        self._ctx: Any = None
        self._thread: Optional[threading.Thread] = None
        if self.store is not None:
            # NIXL and the extra's other modules first, or an ImportError
            # that says what to install.
            nixl()
            import zmq

            name = f"pinshm-fetch-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            hosts = tuple(h for h, _ in settings.peers)
            self.fetcher = Fetcher(self.max_bytes, name, hosts, (settings.secret_file or "",))
            self._ctx = zmq.Context()
            self._thread = threading.Thread(target=self._run, name="pinshm-ec-fetch", daemon=True)
            self._thread.start()
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
        except UntrustedError as e:
            logger.warning("pinshm encoder cache: store %r is not this engine's: no fetches (%s)", s.remote_store, e)
            return None
        except (PinshmError, OSError, ValueError) as e:
            if isinstance(e, NoSpaceError) and s.reserve and s.remote_size_given:  # the engine stops at start
                raise ValueError(does_not_fit("remote_size", s.remote_size, s.remote_store, 2)) from e
            logger.warning(
                "pinshm encoder cache: store %r of fetched outputs is another engine's (or cannot be made: %s): "
                "this engine reads what that one fetched and fetches nothing itself",
                s.remote_store,
                e,
            )
            return None
        self._tracked.add(s.remote_store)
        return store

    # ---- the scheduler's side: never waits on the network ------------

    def lease_local(self, key: str) -> Optional[Lease]:
        """A lease on `key`'s object in the store of fetched outputs."""
        reader = self.reader.get()
        if reader is None:
            return None
        try:
            return reader.lease_key(key)
        except PinshmError:
            return None

    def has_local(self, key: str) -> bool:
        """Whether the store of fetched outputs has `key` now."""
        reader = self.reader.get()
        if reader is None:
            return False
        try:
            return reader.lookup(key) is not None
        except PinshmError:
            return False

    @property
    def peers_ready(self) -> int:
        """Peers that can be asked now (hello answered, not backed off)."""
        now = self.clock()
        return sum(1 for p in self.peers if now >= p.skip_until and self.ready(p))

    @property
    def epoch(self) -> Optional[int]:
        reader = self.reader.get()
        return None if reader is None else reader.epoch

    def want(self, keys: list[str]) -> None:
        """Starts fetching those of `keys` that are neither in flight nor
        known absent (none while every peer is backed off); returns at
        once."""
        if self._thread is None or not self.peers or not self._thread.is_alive():
            return  # nothing fetches: a miss at once, never a deferral
        now = self.clock()
        if all(now < p.skip_until for p in self.peers):
            return  # every peer backed off: a miss at once, no deferral
        with self._lock:
            added = False
            for key in keys:
                if key in self._pending or self._absent.get(key, now) > now:
                    continue
                self._absent.pop(key, None)
                if len(self._pending) >= MAX_PENDING:
                    break
                self._pending.add(key)
                self._queue[key] = None
                added = True
            if added:
                self._changed.notify_all()

    def pending(self, key: str) -> bool:
        """Whether `key` is queued or being fetched (never, once the
        fetching thread is gone: nothing would end it)."""
        thread = self._thread
        return key in self._pending and thread is not None and thread.is_alive()

    def wait(self, keys: list[str], timeout: float) -> bool:
        """Waits (at most `timeout`) until none of `keys` is in flight;
        whether none is. For tests and benchmarks: the scheduler never
        calls it."""
        end = self.clock() + timeout
        with self._changed:
            while any(k in self._pending for k in keys):
                left = end - self.clock()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def fetch(self, key: str, timeout: Optional[float] = None) -> Optional[Lease]:
        """`key`'s output fetched now and leased; None on a miss. Waits:
        for tests and benchmarks, never the scheduler."""
        self.want([key])
        self.wait([key], self.settings.remote_timeout_s + 1.0 if timeout is None else timeout)
        return self.lease_local(key)

    # ---- the fetching thread -----------------------------------------

    def _run(self) -> None:
        for peer in self.peers:
            self._connect(peer, self.clock())  # handshakes before the first request
        while True:
            with self._changed:
                if not self._queue and not self._closing:
                    # Hellos on the way are answered within milliseconds.
                    self._changed.wait(HELLO_POLL_S if any(p.hello_sent for p in self.peers) else IDLE_S)
                if self._closing:
                    return
                keys: list[str] = []
                while self._queue and len(keys) < MAX_KEYS:
                    keys.append(self._queue.popitem(last=False)[0])
            try:
                self._service()  # late answers, hellos
            except Exception as e:  # noqa: BLE001 - the thread outlives any one answer
                logger.warning("pinshm encoder cache: reading the peers' answers: %r", e)
            if not keys:
                continue
            got: set[str] = set()
            try:
                got = self._fetch(keys)
            except Exception as e:  # noqa: BLE001 - the thread outlives any one batch: a miss
                logger.warning("pinshm encoder cache: fetching %d output(s): %r", len(keys), e)
            with self._changed:
                # What did not arrive (no peer has it, a peer failed, the
                # bytes were wrong) is not asked for again for a while:
                # vLLM asks again at every step a request waits.
                until = self.clock() + ABSENT_S
                for key in keys:
                    self._pending.discard(key)
                    if key not in got:
                        self._absent[key] = until
                while len(self._absent) > MAX_ABSENT:
                    self._absent.popitem(last=False)
                self._changed.notify_all()
            logger.debug("pinshm encoder cache: fetched %d of %d output(s)", len(got), len(keys))

    def _connect(self, peer: Peer, now: float) -> None:
        """Connects `peer` and sends its hello, unless it has an agent in
        the fetch process that runs now (or a hello on the way)."""
        if self.fetcher is None or now < peer.skip_until or self.ready(peer) or peer.hello_sent:
            return
        try:
            peer.connect(self._ctx, self._keys)
            peer.send({"op": "hello"}, now)
            peer.hello_sent, peer.hello_at = True, now
        except PeerError as e:
            self.failed(peer, str(e), close=True)

    def ready(self, peer: Peer) -> bool:
        """Whether the fetch process that runs now knows `peer`'s agent."""
        fetcher = self.fetcher
        return peer.agent_name is not None and fetcher is not None and peer.fetcher_start == fetcher.starts

    def _service(self) -> None:
        """Reads whatever answers arrived outside a batch (hellos, late
        lookups, dones)."""
        now = self.clock()
        for peer in self.peers:
            if peer.sock is not None:
                self._take(peer, now, {}, -1)
            if peer.hello_sent and now - peer.hello_at > HELLO_S:
                self.failed(peer, f"no answer to its hello in {HELLO_S:g} s", close=True)
            self._connect(peer, now)

    def _fetch(self, keys: list[str]) -> set[str]:
        """Fetches `keys` (a batch) into the store; the keys published."""
        import zmq

        self._batch += 1
        batch = self._batch
        now = self.clock()
        deadline = now + self.settings.remote_timeout_s
        asked = [p for p in self.peers if now >= p.skip_until and p.sock is not None]
        for peer in asked:
            if self.ready(peer):
                self._lookup(peer, keys, now, batch)
            else:  # the lookup follows its hello's answer
                self._connect(peer, now)
        want = {k: False for k in keys}  # key -> taken by a peer
        got: set[str] = set()
        answered: set[int] = set()
        while True:
            live = [p for p in asked if p.sock is not None and id(p) not in answered]
            if not live or all(want.values()):
                break
            now = self.clock()
            left = deadline - now
            if left <= 0:
                break
            poller = zmq.Poller()
            for p in live:
                poller.register(p.sock, zmq.POLLIN)
            ready = {s for s, _ in poller.poll(max(1, int(left * 1000)))}
            # Every answer that has arrived is taken (and timed) before any
            # READ: one peer's READ never makes another's answer late.
            now = self.clock()
            taken = [(p, self._take(p, now, want, batch, answered)) for p in live if p.sock in ready]
            for p, claims in taken:
                if claims:
                    got |= read(self, p, claims, deadline)
        now = self.clock()
        for p in [p for p in asked if p.sock is not None and id(p) not in answered]:
            for key, place in self._take(p, now, want, batch, answered):  # a last look, not a wait
                want[key] = False
                self.end_leases(p, [place.lease], now)
        for p in asked:
            if id(p) in answered or p.sock is None or now < p.skip_until:
                continue
            if p.hello_sent and now - p.hello_at < HELLO_S:
                continue  # its first hello (the producer registers its store): failed only past HELLO_S
            # No answer within the whole budget: a failed peer (its
            # connection kept: a late answer still ends its leases).
            self.failed(p, "no answer within remote_timeout_s", close=False)
        if len(answered) == len(self.peers):
            self.not_found += sum(1 for taken in want.values() if not taken)
        return got

    def _lookup(self, peer: Peer, keys: list[str], now: float, batch: int) -> None:
        try:
            peer.send({"op": "lookup", "keys": keys}, now, tuple(keys), batch)
        except PeerError as e:
            self.failed(peer, str(e), close=True)

    def _take(
        self, peer: Peer, now: float, want: dict[str, bool], batch: int, answered: Optional[set[int]] = None
    ) -> list[tuple[str, Place]]:
        """Handles what `peer` sent: a hello's answer; a lookup's answer, whose places for
        keys of `want` not yet taken are claimed and returned (the rest of
        its leases end at once); a done's answer (nothing to do)."""
        claims: list[tuple[str, Place]] = []
        ends: list[bytes] = []
        try:
            for asked, reply in peer.receive():
                if asked is None:  # a request forgotten (too many since): its leases end
                    found = reply.get("found")
                    if isinstance(found, list):
                        ends += [f["lease"] for f in found if isinstance(f, dict) and isinstance(f.get("lease"), bytes)]
                    continue
                if asked.op == "done":
                    continue
                if asked.op == "hello":
                    hello(self.fetcher, peer, reply)
                    if answered is not None:  # a batch waits for it
                        self._lookup(peer, list(want), now, batch)
                    continue
                places = wire_field(reply, "found", list)
                if len(places) != len(asked.keys):
                    raise PeerError(f"{len(places)} answers to a lookup of {len(asked.keys)} keys")
                current = asked.batch == batch
                if current and answered is not None:
                    answered.add(id(peer))
                    if not peer.answered(now - asked.sent, self.settings.remote_timeout_s):
                        self.slow_answers += 1
                        self.failed(peer, f"a lookup answered in {now - asked.sent:.3g} s", close=False)
                regen = False
                for key, found in zip(asked.keys, places):
                    if found is None:
                        continue
                    if not isinstance(found, dict):
                        raise PeerError(f"an answer of {type(found).__name__}")
                    place = check_place(found, peer.length, self.max_bytes)
                    if current and want.get(key) is False and place.gen == peer.gen:
                        want[key] = True
                        claims.append((key, place))
                    else:
                        regen |= place.gen != peer.gen
                        ends.append(place.lease)
                if regen:
                    # It registered another segment since: its hello anew
                    # (this batch's keys from it are misses).
                    drop_agent(self.fetcher, peer)
                    peer.hello_sent = False
                    for key, place in claims:
                        want[key] = False
                        ends.append(place.lease)
                    claims = []
                    self._connect(peer, now)
        except FetcherError as e:
            # This node's fetch process, not the peer: its hello is sent
            # again once the process runs.
            logger.debug("pinshm encoder cache: hello of %s: %s", peer.address, e)
            peer.hello_sent = False
            for key, _ in claims:
                want[key] = False
            return []
        except PeerError as e:
            self.failed(peer, str(e), close=True)
            for key, _ in claims:
                want[key] = False
            return []
        self.end_leases(peer, ends, now)
        return claims

    def end_leases(self, peer: Peer, leases: list[bytes], now: float) -> None:
        """Ends `leases` at `peer` (its answer is not waited for)."""
        for i in range(0, len(leases), MAX_KEYS):
            try:
                peer.send({"op": "done", "leases": leases[i : i + MAX_KEYS]}, now)
            except PeerError:
                return  # its TTL ends them

    def failed(self, peer: Peer, why: str, close: bool) -> None:
        self.peer_failures += 1
        if close:
            drop_agent(self.fetcher, peer)
        peer.back_off(self.clock(), self.settings.peer_backoff_s, why, close)

    def close(self) -> None:
        """Stops the fetching thread; closes the sockets, the fetch process
        and the store it writes. Twice is fine. In a forked child, nothing
        but letting go of its copies: the thread, the sockets and the
        fetch process are the parent's."""
        if os.getpid() != self._pid:
            self.fetcher = None
            return
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(30)
            if thread.is_alive():
                # Still in a READ or a hello: its sockets and the fetch
                # process stay as they are (ZeroMQ sockets are the thread's
                # own), and go with this process.
                logger.warning("pinshm encoder cache: the fetching thread did not stop in 30 s: left running")
                self.reader.close()
                return
        for peer in self.peers:
            drop_agent(self.fetcher, peer)
            peer.close()
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
