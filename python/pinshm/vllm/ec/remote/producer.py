"""A producer's half of the remote tier (``ec_connector_extra_config:
{"serve": "HOST:PORT", "secret_file": ...}``), in the producer engine's
scheduler process, and the two processes it starts and watches.

What other nodes reach is not this process: the endpoint is a small
process of its own (:mod:`.serving_process`), the NIXL agent and a
read-only mapping of the store's data region another
(:mod:`.nixl_process`), and neither holds anything of the engine
(docs/security.md). This side keeps what must be trusted: a reader of the
store, the leases, their budgets. The serving process forwards each
peer's ``lookup`` (of up to MAX_KEYS keys) and ``done`` here over a
socket pair, with the peer's connection id; this side checks every field
of it (that process is the one a peer could subvert), leases each key's
object and answers where its elements lie in the data region, with their
digest (taken once per object). A lease ends when its peer says done
(after its READ: the consumer does not wait for the answer, since the
digest already proves what it read), or after ``lease_ttl_s``; done
still re-checks the handle (the slot's id and tag) for the counts.

Leases are budgeted (:mod:`.budget`): a connection holds at most
``PEER_LEASES`` at once, an address group (an IPv4 address, an IPv6 /64)
an equal share of the pool among the groups holding leases, and a
newcomer always gets its share; an expired lease stops counting at once.
Lease ids are 16 random bytes, valid only from the peer that took them.
A serving process that dies (a peer's WRITE into the read-only region
kills it) is started again after a backoff; meanwhile lookups go
unanswered, which consumers count as misses.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import signal
import socket
import subprocess
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from ...._pinshm import Lease, ObjectHandle, PinshmError, StoreReader
from .._attach import NamedReader
from .._config import ECSettings
from .budget import Budget, group_of
from .child import Inbox
from .holder import Holder
from .keys import keys_for
from .protocol import LEASE_BYTES, MAX_KEY, MAX_KEYS, VERSION, PeerError, field, pack, unpack
from .region import place
from .spawn import KEY_FIELDS, ServeError, spawn, stop

logger = logging.getLogger("vllm.pinshm.ec")

#: A lease whose TTL passed is remembered (its handle, not its hold) this
#: long after, and at most this many, so that a late done is still
#: answered by a re-check.
REMEMBER_S = 30.0
MAX_REMEMBERED = 4096
POLL_S = 0.05
#: A dead serving process is started again after this, doubling to the most.
RESTART_S, MAX_RESTART_S = 0.5, 30.0


@dataclass
class _Held:
    """A lease a peer holds (`lease` None once its TTL passed)."""

    peer: bytes
    #: Its address's group (:func:`.budget.group_of`).
    group: str
    lease: Optional[Lease]
    handle: ObjectHandle
    reader: StoreReader
    deadline: float


class Server:
    """Serves `settings.store` on `settings.serve` until :meth:`close`."""

    def __init__(self, settings: ECSettings, nofile: Optional[int] = None) -> None:
        assert settings.serve is not None
        self.settings = settings
        self._keys = keys_for(settings.secret_file, settings.insecure)
        if self._keys is None:
            logger.warning(
                "pinshm encoder cache: serving store %r WITHOUT authentication ('insecure': true): any host that "
                "reaches %s:%d reads its outputs; use 'secret_file' anywhere but a trusted lab network",
                settings.store,
                *settings.serve,
            )
        self._nofile = nofile
        self._pid = os.getpid()
        self._named = NamedReader(settings.store, settings.retry_s, pin="off")
        self._reader: Optional[StoreReader] = None
        self._gen = 0
        self._leases: dict[bytes, _Held] = {}
        self._remembered: OrderedDict[bytes, _Held] = OrderedDict()
        self._budget = Budget()
        self._digests: dict[tuple[int, int], bytes] = {}
        self.lookups = self.found = self.stable = self.unstable = self.busy = 0
        #: Leases taken back from a group over its share, for a newcomer.
        self.revoked = 0
        #: Lookup messages (each of up to MAX_KEYS keys; `lookups` counts keys).
        self.lookup_requests = 0
        self.restarts = 0
        self._proc: Optional[subprocess.Popen[bytes]] = None
        self._nixl = Holder(settings)
        self._sock: Optional[socket.socket] = None
        self._inbox = Inbox()
        self._started_at = 0.0
        self._restart_at = 0.0
        self._backoff = 0.0
        self._stop = threading.Event()
        # Every serving process is started by the serving thread, which
        # lives as long as this: PR_SET_PDEATHSIG fires when the *thread*
        # that started a process ends. The first start is waited for here:
        # a port taken or NIXL missing stops the engine at start.
        self._started = threading.Event()
        self._start_error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="pinshm-ec-serve", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._stop.set()
            self._thread.join(5)
            self._named.close()
            raise self._start_error
        host, port = settings.serve
        logger.info(
            "pinshm encoder cache: serving store %r on %s:%d over NIXL (serving process %d%s)",
            settings.store,
            host,
            port,
            self.pid,
            "" if self._keys is None else ", authenticated",
        )

    @property
    def pid(self) -> Optional[int]:
        """The serving process's pid (None while there is none)."""
        return None if self._proc is None else self._proc.pid

    @property
    def nixl_pid(self) -> Optional[int]:
        """The NIXL process's pid (None while there is none)."""
        return self._nixl.pid

    # ---- the serving process ----------------------------------------

    def _start(self) -> None:
        """Starts the NIXL process (if none runs) and the serving process,
        and waits for each to say ready; ServeError (ImportError for a
        missing extra) if one cannot."""
        assert self.settings.serve is not None
        host, port = self.settings.serve
        if not self._nixl.running:
            self._nixl.start()
        cfg = {
            "host": host,
            "port": port,
            "keys": None if self._keys is None else {k: getattr(self._keys, k) for k in KEY_FIELDS},
            "nofile": self._nofile,
        }
        self._proc, self._sock = spawn("serving_process", [], cfg, f"cannot serve on {host}:{port}")
        self._started_at = time.monotonic()

    def _died(self) -> None:
        """The serving process is gone: every lease ends; another starts
        after the backoff."""
        assert self._proc is not None and self._sock is not None
        rc = self._proc.poll()
        why = f"signal {-rc}" if rc is not None and rc < 0 else f"exit status {rc}"
        now = time.monotonic()
        if now - self._started_at > 60:
            self._backoff = 0.0
        self._backoff = min(MAX_RESTART_S, max(RESTART_S, self._backoff * 2))
        self._restart_at = now + self._backoff
        logger.warning(
            "pinshm encoder cache: the serving process %d ended (%s%s): lookups are misses until another "
            "starts in %.3g s",
            self._proc.pid,
            why,
            ": a peer wrote into the read-only region, or read outside it" if rc == -signal.SIGSEGV else "",
            self._backoff,
        )
        self._proc = self._sock = None
        self._end_all()

    def _end_all(self) -> None:
        for held in self._leases.values():
            if held.lease is not None:
                _release(held.lease)
        self._leases.clear()
        self._remembered.clear()
        self._budget.clear()

    # ---- the loop ---------------------------------------------------

    def _run(self) -> None:
        try:
            self._start()
        except BaseException as e:  # noqa: BLE001 - raised by __init__, in the engine's thread
            self._start_error = e
            self._nixl.stop()
            return
        finally:
            self._started.set()
        while not self._stop.is_set():
            try:
                self._once()
            except Exception as e:  # noqa: BLE001 - the server outlives any one request
                logger.warning("pinshm encoder cache: serving a request: %r", e)
                time.sleep(POLL_S)

    def _once(self) -> None:
        sock, proc = self._sock, self._proc
        if sock is None or proc is None:
            if time.monotonic() >= self._restart_at:
                try:
                    self._start()
                    self.restarts += 1
                except (ServeError, ImportError, OSError) as e:
                    self._backoff = min(MAX_RESTART_S, max(RESTART_S, self._backoff * 2))
                    self._restart_at = time.monotonic() + self._backoff
                    logger.warning("pinshm encoder cache: %s (again in %.3g s)", e, self._backoff)
            else:
                self._stop.wait(POLL_S)
            self._expire()
            return
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        ready = bool(poller.poll(int(POLL_S * 1000)))
        data = b""
        if ready:
            try:
                data = self._inbox.recv(sock)
            except OSError:
                data = b""
            if data:
                self._answer_child(sock, proc, data)
        self._expire()
        if self._nixl.ended():
            self._gen += 1
        if proc.poll() is not None or (ready and not data):
            stop(proc, sock, wait_s=1)
            self._died()

    def _answer_child(self, sock: socket.socket, proc: subprocess.Popen[bytes], data: bytes) -> None:
        """Answers one request of the serving process. One that breaks the
        protocol (only a subverted process sends it), or that does not take
        its answer in time, gets the process killed (and another started)."""
        try:
            reply = self._serve(unpack(data))
        except (PeerError, ValueError, TypeError) as e:
            logger.warning("pinshm encoder cache: the serving process asked %r: stopped", e)
            proc.kill()
            return
        except Exception as e:  # noqa: BLE001 - ours, not the request's: said, and served on
            logger.warning("pinshm encoder cache: answering the serving process: %r", e)
            reply = {"error": f"the scheduler could not answer: {type(e).__name__}"}
        try:
            sock.sendall(pack(reply))
        except OSError as e:  # its buffer full (it reads nothing), or gone
            logger.warning("pinshm encoder cache: the serving process took no answer (%r): stopped", e)
            proc.kill()

    def _serve(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The answer to the serving process's request."""
        op = field(msg, "op", str)
        if op == "hello":
            return self._hello()
        peer = field(msg, "peer", bytes)
        if not 0 < len(peer) <= 256:
            raise PeerError(f"a peer id of {len(peer)} bytes")
        if op == "lookup":
            keys, addr = field(msg, "keys", list), field(msg, "addr", str)
            if not 0 < len(keys) <= MAX_KEYS or len(addr) > 64:
                raise PeerError(f"a lookup of {len(keys)} keys, an address of {len(addr)}")
            if not all(isinstance(k, str) and len(k) <= MAX_KEY for k in keys):
                raise PeerError("a key that is not a string of at most MAX_KEY characters")
            self.lookup_requests += 1
            return {"found": [self._lookup(peer, addr, key) for key in keys]}
        if op == "done":
            leases = field(msg, "leases", list)
            if not 0 < len(leases) <= MAX_KEYS or not all(isinstance(x, bytes) for x in leases):
                raise PeerError(f"a done of {len(leases)} leases")
            return {"stable": [self._done(peer, lid) for lid in leases]}
        raise PeerError(f"no such op {op[:40]!r}")

    # ---- the region -------------------------------------------------

    def _region(self) -> Optional[StoreReader]:
        """The reader of the store's segment now; a new one bumps `gen`."""
        reader = self._named.get()
        if reader is not None and reader is not self._reader:
            self._reader = reader
            self._gen += 1
        return reader

    def _hello(self) -> dict[str, Any]:
        """A hello's answer: the NIXL process's agent and its registration
        of the store's region now (registered anew when the store's segment
        or the NIXL process changed)."""
        reader = self._region()
        if reader is None:
            return {"error": "the store is not there yet"}
        if self._nixl.ended():
            self._gen += 1
        if not self._nixl.running:
            self._nixl.start()
            self.restarts += 1
        said = self._nixl.register(reader)
        if "error" in said:
            return said
        return {"v": VERSION, **said, "gen": self._gen}

    # ---- leases -----------------------------------------------------

    def _lookup(self, peer: bytes, addr: str, key: str) -> Optional[dict[str, Any]]:
        self.lookups += 1
        reader = self._region()
        if reader is None:
            return None
        group = group_of(addr)
        admitted, victim = self._budget.admit(peer, group)
        if not admitted:
            self.busy += 1
            return None
        try:
            lease = reader.lease_key(key)
        except PinshmError:
            lease = None
        if lease is None:
            return None
        handle = lease.handle
        try:
            offset, nbytes, dtype, shape, sums = place(reader, handle, self._digests)
        except Exception as e:  # noqa: BLE001 - not a tensor, gone: a miss
            logger.debug("pinshm encoder cache: serving %s: %r", key, e)
            lease.release()
            return None
        if victim is not None:
            self._revoke(victim)
        lid = secrets.token_bytes(LEASE_BYTES)
        self._leases[lid] = _Held(peer, group, lease, handle, reader, time.monotonic() + self.settings.lease_ttl_s)
        self._budget.add(peer, group)
        self.found += 1
        return {
            "lease": lid,
            "digest": sums,
            "offset": offset,
            "nbytes": nbytes,
            "dtype": dtype,
            "shape": list(shape),
            "id": handle.monotonic_id,
            "epoch": handle.epoch,
            "gen": self._gen,
        }

    def _done(self, peer: bytes, lid: bytes) -> bool:
        held = self._leases.get(lid)
        if held is None or held.peer != peer:
            # Never leased, forgotten, or another peer's (left alone).
            self.unstable += 1
            return False
        del self._leases[lid]
        self._remembered.pop(lid, None)
        try:
            # The slot's id and tag re-checked after the READ: the same
            # object all along (a slot reused has another id for good).
            held.reader.validate(held.handle)
            stable = True
        except PinshmError:
            stable = False
        if held.lease is not None:
            self._let_go(held)
        if stable:
            self.stable += 1
        else:
            self.unstable += 1
        return stable

    def _let_go(self, held: _Held) -> None:
        assert held.lease is not None
        _release(held.lease)
        held.lease = None
        self._budget.remove(held.peer, held.group)

    def _revoke(self, group: str) -> None:
        """Ends the oldest live lease of `group` as its TTL would (a late
        done is still answered by a re-check): room for a newcomer."""
        for lid, held in self._leases.items():
            if held.group == group and held.lease is not None:
                self._let_go(held)
                self._remembered[lid] = held
                self.revoked += 1
                return

    def _expire(self) -> None:
        now = time.monotonic()
        for lid, held in list(self._leases.items()):
            if held.lease is not None and held.deadline <= now:
                self._let_go(held)  # stops counting against its peer at once
                self._remembered[lid] = held
        forget = now - REMEMBER_S
        while self._remembered:
            lid, held = next(iter(self._remembered.items()))
            if held.deadline > forget and len(self._remembered) <= MAX_REMEMBERED:
                break
            self._remembered.popitem(last=False)
            self._leases.pop(lid, None)

    # ---- closing ----------------------------------------------------

    def close(self) -> None:
        """Stops serving (the serving process ends); every lease ends. Twice
        is fine. In a forked child, nothing: the serving process and the
        thread are the parent's."""
        if os.getpid() != self._pid or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(5)
        if self._proc is not None and self._sock is not None:
            stop(self._proc, self._sock)
            self._proc = self._sock = None
        self._nixl.stop()
        self._end_all()
        self._named.close()


def _release(lease: Lease) -> None:
    try:
        lease.release()
    except PinshmError as e:
        logger.debug("pinshm encoder cache: releasing a served lease: %r", e)
