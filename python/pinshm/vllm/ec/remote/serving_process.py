"""The producer's serving process (``python -m
pinshm.vllm.ec.remote.serving_process FD``), started by
:class:`.producer.Server`: the control endpoint (ZeroMQ,
CURVE-authenticated with the deployment's derived keys, refused at the
handshake otherwise) and one socket to the scheduler, to which it
forwards every ``hello``, ``lookup`` and ``done``. No NIXL agent (that is
:mod:`.nixl_process`): UCX over TCP lets whoever reaches an agent's
process read its memory, and this one's keys must not be read. No engine
state and no mapping of anything a rank reads: leases, their budgets and
ids live in the scheduler, which checks every request
(docs/security.md). It exits when the scheduler's end of the socket
closes, or with the scheduler.
"""

from __future__ import annotations

import socket
import sys
from typing import Any

from .child import Inbox, start
from .protocol import MAX_KEY, MAX_KEYS

#: How long a connection may take to authenticate before it is closed.
HANDSHAKE_MS = 2000
#: ZMTP heartbeats: a peer that stops answering them is disconnected.
HEARTBEAT_MS, HEARTBEAT_TIMEOUT_MS = 5000, 15000


class Gate:
    """The endpoint: ZeroMQ, ZAP, and the forwarding of requests to the scheduler."""

    def __init__(self, parent: socket.socket, cfg: dict[str, Any]) -> None:
        import zmq

        from .keys import secure_server

        self._parent = parent
        self._inbox = Inbox()
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
        from .protocol import pack, unpack

        try:
            self._parent.sendall(pack(msg))
            data = self._inbox.recv(self._parent)
        except OSError:  # no answer in time (socket.timeout), or gone
            raise SystemExit(1) from None  # the scheduler starts another
        if not data:
            raise SystemExit(0)  # the scheduler is gone
        return unpack(data)

    # ---- peers ------------------------------------------------------

    def answer(self, peer: bytes, data: bytes, addr: str = "") -> dict[str, Any]:
        from .protocol import PeerError, field, unpack

        try:
            msg = unpack(data)
            op = field(msg, "op", str)
            if op == "hello":
                # The NIXL process's agent and registration, which the
                # scheduler keeps: none of it is in this process.
                return self._ask({"op": "hello"})
            if op == "lookup":
                keys = field(msg, "keys", list)
                if not 0 < len(keys) <= MAX_KEYS or not all(isinstance(k, str) and len(k) <= MAX_KEY for k in keys):
                    raise PeerError(f"a lookup of {len(keys)} keys (at most {MAX_KEYS}, each a string)")
                return self._ask({"op": "lookup", "peer": peer, "addr": addr[:64], "keys": keys})
            if op == "done":
                leases = field(msg, "leases", list)
                if not 0 < len(leases) <= MAX_KEYS or not all(
                    isinstance(x, bytes) and len(x) <= MAX_KEY for x in leases
                ):
                    raise PeerError(f"a done of {len(leases)} leases (at most {MAX_KEYS})")
                return self._ask({"op": "done", "peer": peer, "leases": leases})
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

        from .protocol import pack

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


def main(argv: list[str]) -> int:
    from .protocol import pack

    got = start(argv)
    if got is None:
        return 0
    parent, cfg = got
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
