"""The processes that other nodes reach of a producer engine
(docs/security.md), started by the engine's scheduler (:mod:`._serve`)
and nothing else, each holding what the other must not:

- the **serving process** (``python -m pinshm.vllm.ec._served FD``): the
  control endpoint (ZeroMQ, CURVE-authenticated with the deployment's
  derived keys, refused at the handshake otherwise) and one socket to the
  scheduler, to which it forwards every ``hello``, ``lookup`` and
  ``done``. No NIXL agent: UCX over TCP lets whoever reaches an agent's
  process read its memory, and its keys must not be read;
- the **NIXL process** (``... FD nixl``, :func:`hold`): the agent and a
  read-only mapping of the store's data region, no key, no endpoint. UCX
  over TCP checks neither the bounds nor the access of a READ or WRITE: a
  peer's WRITE into the region faults on its read-only pages and kills
  it (the scheduler starts another; meanwhile lookups are misses); a READ
  or WRITE outside it reaches this process's memory alone.

Neither holds engine state or a writable mapping of anything a rank
reads; leases, their budgets and ids live in the scheduler, which checks
every request. The scheduler sends each one config message over its
socket (keys included: never in argv or the environment); each answers
``{"ready": ...}`` or ``{"error": why}``. They exit when the scheduler's
end of the socket closes, or with the scheduler (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import ipaddress
import mmap
import os
import resource
import signal
import socket
import sys
from typing import Any, Optional

#: The most one scheduler message (a request, an answer) takes.
LOCAL_MESSAGE = 1 << 16
#: How long a connection may take to authenticate before it is closed.
HANDSHAKE_MS = 2000
#: ZMTP heartbeats: a peer that stops answering them is disconnected.
HEARTBEAT_MS, HEARTBEAT_TIMEOUT_MS = 5000, 15000
#: Keys, lease ids and the like that a peer sends are at most this long.
MAX_KEY = 1024
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
#: How long an answer of the scheduler may take (then this process exits,
#: and the scheduler starts another).
LOCAL_TIMEOUT_S = 10.0


def devices_for(host: str) -> Optional[str]:
    """``UCX_NET_DEVICES`` for a serving process bound to `host`: the
    interface that holds that address (and the host's RDMA ports, which
    UCX names apart), so that UCX's TCP listener listens there alone.
    None for a wildcard address, or where no interface holds it."""
    try:
        addr = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])
    except (OSError, ValueError, IndexError):
        return None
    if addr.is_unspecified:
        return None
    names = [name for name, a in _interface_addresses() if a == addr]
    if not names:
        return None
    ib = "/sys/class/infiniband"
    rdma = []
    if os.path.isdir(ib):
        for dev in sorted(os.listdir(ib)):
            ports = os.path.join(ib, dev, "ports")
            rdma += [f"{dev}:{p}" for p in sorted(os.listdir(ports))] if os.path.isdir(ports) else []
    return ",".join([names[0], *rdma])


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [
    ("next", ctypes.POINTER(_Ifaddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.c_void_p),
    ("netmask", ctypes.c_void_p),
    ("ifu", ctypes.c_void_p),
    ("data", ctypes.c_void_p),
]


def _interface_addresses() -> list[tuple[str, Any]]:
    """(interface, address) of every IPv4 and IPv6 address (getifaddrs(3))."""
    libc = ctypes.CDLL(None, use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        return []
    out: list[tuple[str, Any]] = []
    try:
        node = head
        while node:
            entry = node.contents
            if entry.addr:
                family = ctypes.c_ushort.from_address(entry.addr).value
                if family == socket.AF_INET:
                    raw = ctypes.string_at(entry.addr + 4, 4)
                    out.append((entry.name.decode(), ipaddress.IPv4Address(raw)))
                elif family == socket.AF_INET6:
                    raw = ctypes.string_at(entry.addr + 8, 16)
                    out.append((entry.name.decode(), ipaddress.IPv6Address(raw)))
            node = entry.next
    finally:
        libc.freeifaddrs(head)
    return out


class Gate:
    """The endpoint: ZeroMQ, ZAP, and the forwarding of requests to the scheduler."""

    def __init__(self, parent: socket.socket, cfg: dict[str, Any]) -> None:
        import zmq

        from ._secret import secure_server

        self._parent = parent
        self._ctx = zmq.Context()
        keys = cfg.get("keys")
        self._zap = None
        if keys is not None:
            self._client_key = bytes(keys["client_public"])
            # ZAP (ZeroMQ RFC 27), answered here: a client's handshake that
            # does not prove the derived client key is refused before any
            # message of it is read.
            self._zap = self._ctx.socket(zmq.REP)
            self._zap.setsockopt(zmq.LINGER, 0)
            self._zap.bind("inproc://zeromq.zap.01")
        self.refused = 0
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.RCVHWM, 1000)
        if keys is not None:
            secure_server(sock, bytes(keys["server_public"]), bytes(keys["server_secret"]))
            sock.setsockopt(zmq.ZAP_DOMAIN, b"pinshm-ec")
        sock.bind(f"tcp://{cfg['host']}:{int(cfg['port'])}")
        self._sock = sock

    # ---- the scheduler ----------------------------------------------

    def _ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        from ._wire import pack, unpack

        try:
            self._parent.sendall(pack(msg))
            data = self._parent.recv(LOCAL_MESSAGE)
        except OSError:  # no answer in time (socket.timeout), or gone
            raise SystemExit(1) from None  # the scheduler starts another
        if not data:
            raise SystemExit(0)  # the scheduler is gone
        return unpack(data)

    # ---- peers ------------------------------------------------------

    def answer(self, peer: bytes, data: bytes, addr: str = "") -> dict[str, Any]:
        from ._wire import PeerError, field, unpack

        try:
            msg = unpack(data)
            op = field(msg, "op", str)
            if op == "hello":
                # The NIXL process's agent and registration, which the
                # scheduler keeps: none of it is in this process.
                return self._ask({"op": "hello"})
            if op == "lookup":
                key = field(msg, "key", str)
                if len(key) > MAX_KEY:
                    raise PeerError(f"a key of {len(key)} characters")
                return self._ask({"op": "lookup", "peer": peer, "addr": addr[:64], "key": key})
            if op == "done":
                lease = field(msg, "lease", bytes)
                if len(lease) > MAX_KEY:
                    raise PeerError(f"a lease id of {len(lease)} bytes")
                return self._ask({"op": "done", "peer": peer, "lease": lease})
            raise PeerError(f"no such op {op[:40]!r}")
        except PeerError as e:
            return {"error": str(e)}
        except Exception as e:  # noqa: BLE001 - said to the peer, and here
            print(f"pinshm serving process: {e!r}", file=sys.stderr)
            return {"error": f"the serving process cannot serve: {type(e).__name__}"}

    def _authenticate(self) -> None:
        import hmac

        import zmq
        from zmq.utils import z85

        assert self._zap is not None
        frames = self._zap.recv_multipart(zmq.NOBLOCK)
        if len(frames) < 6:
            return  # not a ZAP request: libzmq sends none such
        version, request_id, mechanism = frames[0], frames[1], frames[5]
        key = frames[6] if len(frames) > 6 else b""
        ok = mechanism == b"CURVE" and len(key) == 32 and hmac.compare_digest(z85.encode(key), self._client_key)  # type: ignore[no-untyped-call]
        if not ok:
            self.refused += 1
        status = (b"200", b"OK") if ok else (b"400", b"not a peer of this deployment")
        self._zap.send_multipart([version, request_id, *status, b"", b""])

    def run(self) -> None:
        import zmq

        from ._wire import pack

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._parent.fileno(), zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(1000))
            if self._parent.fileno() in ready:
                return  # the scheduler closed its end (or said stop): done
            if self._zap is not None and self._zap in ready:
                self._authenticate()
            if self._sock in ready:
                for _ in range(64):
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if len(frames) < 2 or not 0 < len(frames[0].bytes) <= 256:
                        continue
                    try:
                        addr = str(frames[-1].get("Peer-Address"))  # type: ignore[arg-type]  # a metadata name
                    except zmq.ZMQError:
                        addr = "?"
                    reply = self.answer(frames[0].bytes, frames[-1].bytes, addr)
                    self._sock.send_multipart([*(f.bytes for f in frames[:-1]), pack(reply)], zmq.NOBLOCK)

    def close(self) -> None:
        self._sock.close(0)
        if self._zap is not None:
            self._zap.close(0)
        self._ctx.term()


def hold(parent: socket.socket, cfg: dict[str, Any]) -> int:
    """The NIXL process: an agent and the read-only region, registered as
    the scheduler hands it over (``{"op": "region"}`` with the file's
    descriptor: answered with the agent's name, metadata and the region's
    address here), and nothing else: no key, no endpoint, no store. UCX's
    progress thread serves the READs."""
    from ._wire import agent, pack, unpack

    parent.settimeout(None)
    try:
        a = agent(str(cfg["agent"]), progress=True)
    except BaseException as e:  # noqa: BLE001 - said to the scheduler, which raises it
        parent.sendall(pack({"error": f"{type(e).__name__}: {e}"}))
        return 1
    parent.sendall(pack({"ready": a.name}))
    view: Optional[mmap.mmap] = None
    descs: Any = None
    while True:
        data, fds, _, _ = socket.recv_fds(parent, LOCAL_MESSAGE, 1)
        if not data:
            return 0  # the scheduler is gone
        reply: dict[str, Any] = {}
        try:
            msg = unpack(data)
            if descs is not None:
                a.deregister_memory(descs)
                descs = None
            if view is not None:
                view.close()
                view = None
            if fds:
                offset, length = int(msg["offset"]), int(msg["length"])
                page = mmap.ALLOCATIONGRANULARITY
                start = offset - offset % page
                view = mmap.mmap(fds[0], length + offset - start, mmap.MAP_SHARED, mmap.PROT_READ, offset=start)
                base = _address(view) + offset - start
                descs = a.register_memory([(base, length, 0, "")], "DRAM")
                reply = {"name": a.name, "meta": a.get_agent_metadata(), "base": base}
        except Exception as e:  # noqa: BLE001 - NIXL's and mmap's: said to the scheduler
            reply = {"error": repr(e)[:500]}
        finally:
            for fd in fds:
                os.close(fd)
        parent.sendall(pack(reply))


def _address(view: mmap.mmap) -> int:
    """The address of a read-only mapping's first byte."""
    import numpy as np

    array = np.frombuffer(view, dtype=np.uint8)
    try:
        return int(array.ctypes.data)
    finally:
        del array


def _die_with(parent: int) -> None:
    """SIGKILL when the scheduler dies (vLLM SIGKILLs its engines)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)  # it died before the line above


def main(argv: list[str]) -> int:
    from ._wire import pack, unpack

    parent = socket.socket(fileno=int(argv[1]))
    data = parent.recv(LOCAL_MESSAGE)
    if not data:
        return 0
    cfg = unpack(data)
    _die_with(int(cfg["parent"]))
    # No core file (a peer's WRITE kills this process: its keys and heap
    # would go to disk each time), and no ptrace by the engine's other
    # processes.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    parent.settimeout(LOCAL_TIMEOUT_S)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = int(cfg.get("nofile") or hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    # This process's own environment, read by UCX as the agent is made.
    os.environ.update({str(k): str(v) for k, v in (cfg.get("env") or {}).items()})
    if len(argv) > 2 and argv[2] == "nixl":
        return hold(parent, cfg)
    try:
        gate = Gate(parent, cfg)
    except BaseException as e:  # noqa: BLE001 - said to the scheduler, which raises it
        parent.sendall(pack({"error": f"{type(e).__name__}: {e}"}))
        return 1
    parent.sendall(pack({"ready": True}))
    try:
        gate.run()
    except SystemExit:
        pass
    finally:
        gate.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
