"""Remote readers (other machines) keep vLLM's transport: the writer binds
a ZMQ XPUB socket over TCP, each remote reader subscribes, and every
message goes as a multipart (the pickle, then its out-of-band buffers).
pyzmq is imported only when a queue has remote readers."""

from __future__ import annotations

import pickle
import time
from typing import Any, Optional


def _zmq() -> Any:
    try:
        import zmq
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("remote readers of pinshm's MessageQueue need pyzmq (pip install pyzmq)") from e
    return zmq


def _get_ip() -> str:
    try:
        from vllm.utils.network_utils import get_ip

        return str(get_ip())
    except ImportError:
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect(("8.8.8.8", 80))  # no packet is sent
                return str(s.getsockname()[0])
            except OSError:
                return "127.0.0.1"


class Remote:
    """One ZMQ socket and its context: the writer's XPUB or a reader's SUB."""

    def __init__(self, kind: str) -> None:
        zmq = _zmq()
        self._zmq = zmq
        self.context = zmq.Context()
        self.socket = self.context.socket(getattr(zmq, kind))

    @classmethod
    def publisher(cls, connect_ip: Optional[str]) -> tuple[Remote, str, bool]:
        """The writer's socket, bound on `connect_ip` (default: this
        machine's address, as vLLM finds it); returns it, the address
        readers subscribe to, and whether it is IPv6."""
        self = cls("XPUB")
        zmq = self._zmq
        self.socket.setsockopt(zmq.XPUB_VERBOSE, True)
        ip = connect_ip or _get_ip()
        ipv6 = False
        if ":" in ip and not ip.startswith("["):
            self.socket.setsockopt(zmq.IPV6, 1)
            ipv6 = True
            ip = f"[{ip}]"
        self.socket.bind(f"tcp://{ip}:0")
        endpoint = self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        port = endpoint.rsplit(":", 1)[1]
        return self, f"tcp://{ip}:{port}", ipv6

    @classmethod
    def subscriber(cls, addr: str, ipv6: bool) -> Remote:
        self = cls("SUB")
        self.socket.setsockopt_string(self._zmq.SUBSCRIBE, "")
        if ipv6:
            self.socket.setsockopt(self._zmq.IPV6, 1)
        self.socket.connect(addr)
        return self

    def send(self, bufs: list[Any]) -> None:
        self.socket.send_multipart(bufs, copy=False)

    def wait_for_subscribers(self, n: int) -> None:
        """The writer's half of vLLM's handshake: `n` subscriptions, then
        READY."""
        for _ in range(n):
            self.socket.recv()  # a subscription message
        self.socket.send(b"READY")

    def wait_for_ready(self) -> None:
        """A reader's half of the handshake."""
        recv = self.socket.recv()
        if recv != b"READY":
            raise RuntimeError(f"wait_until_ready: expected b'READY', got {recv[:16]!r}")

    def recv(self, timeout: Optional[float], cancelled: Any) -> Any:
        """The next object; TimeoutError after `timeout` seconds;
        RuntimeError("cancelled") once `cancelled()` (checked every
        100 ms)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        sock = self.socket
        while True:
            if cancelled():
                raise RuntimeError("cancelled")
            step_ms = 100
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 and not sock.poll(timeout=0):
                    raise TimeoutError("dequeue: nothing from the remote writer")
                step_ms = max(0, min(step_ms, int(left * 1000)))
            if sock.poll(timeout=step_ms):
                main, *oob = sock.recv_multipart(copy=False)
                return pickle.loads(main, buffers=oob)

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()
