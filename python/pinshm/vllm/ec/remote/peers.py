"""A consumer's peers (``peers`` in ``ec_connector_extra_config``): one
ZeroMQ DEALER socket each, owned by the fetching thread
(:mod:`.consumer`), with the peer's hello, its answer times and its
backoff. Nothing here waits: requests are sent at once, answers are read
as they arrive, each matched to its request by the id its envelope
carries (a late answer to an earlier batch is still matched, so its
leases are ended, never mistaken for another's)."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Any, Optional

from .keys import Keys, secure_client
from .protocol import MAX_MESSAGE, VERSION, PeerError, pack, unpack
from .protocol import field as wire_field

logger = logging.getLogger("vllm.pinshm.ec")

#: The longest a failed peer is skipped (the backoff doubles up to it).
MAX_BACKOFF_S = 60.0
#: A peer whose lookup takes longer than this share of ``remote_timeout_s``
#: is slow: its answer is used, and it is backed off as one that failed,
#: so that it never uses up the budget of the requests after it.
SLOW_SHARE = 0.5
#: Requests remembered per peer (their answers may come late).
MAX_ASKED = 256
#: Bytes of a request id.
RID_BYTES = 8


@dataclass
class Asked:
    """A request sent and not answered yet."""

    op: str
    sent: float
    keys: tuple[str, ...] = ()
    batch: int = -1


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
    asked: dict[bytes, Asked] = field(default_factory=dict)
    hello_sent: bool = False
    hello_at: float = 0.0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def connect(self, ctx: Any, keys: Optional[Keys]) -> Any:
        """Its socket, connected (ZeroMQ connects in the background: this
        never waits)."""
        import zmq

        if self.sock is None:
            sock = ctx.socket(zmq.DEALER)
            try:
                self._setup(sock, keys)
            except zmq.ZMQError as e:  # no CURVE in this libzmq, an address it cannot parse
                sock.close(0)
                raise PeerError(f"cannot connect: {e}") from None
            self.sock = sock
        return self.sock

    def _setup(self, sock: Any, keys: Optional[Keys]) -> None:
        import zmq

        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        # A peer that stops reading is not queued for without end.
        sock.setsockopt(zmq.SNDHWM, 64)
        # The producer binds leases to this id: random for each socket
        # (ZeroMQ's own reconnects keep it), sent only inside the encrypted
        # handshake.
        sock.setsockopt(zmq.ROUTING_ID, b"c" + secrets.token_bytes(15))
        if keys is not None:
            secure_client(sock, keys)
        sock.connect(f"tcp://{self.host}:{self.port}")

    def send(self, msg: dict[str, Any], now: float, keys: tuple[str, ...] = (), batch: int = -1) -> None:
        """Sends `msg` (PeerError where it cannot be queued at once)."""
        import zmq

        rid = secrets.token_bytes(RID_BYTES)
        try:
            self.sock.send_multipart([rid, b"", pack(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise PeerError(f"cannot send: {e}") from None
        self.asked[rid] = Asked(str(msg["op"]), now, keys, batch)
        while len(self.asked) > MAX_ASKED:
            del self.asked[next(iter(self.asked))]

    def receive(self) -> list[tuple[Optional[Asked], dict[str, Any]]]:
        """Every answer that has arrived, each with the request it answers
        (None: one this side does not remember). PeerError for an answer
        that is not a message, or that says it is an error."""
        import zmq

        out: list[tuple[Optional[Asked], dict[str, Any]]] = []
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) != 3 or frames[1] != b"":
                raise PeerError(f"an answer of {len(frames)} frames")
            asked = self.asked.pop(frames[0], None)
            reply = unpack(frames[2])
            if "error" in reply and asked is not None and asked.op != "done":
                raise PeerError(f"it says: {str(reply['error'])[:200]}")
            out.append((asked, reply))

    def hello(self, reply: dict[str, Any]) -> tuple[str, bytes, int, int, int]:
        """A hello's answer, checked: (agent, metadata, base, length, gen)."""
        if reply.get("v") != VERSION:
            raise PeerError(f"protocol version {str(reply.get('v'))[:20]}, not {VERSION} (another pinshm release)")
        name = wire_field(reply, "agent", str)
        meta = wire_field(reply, "meta", bytes)
        base, length = wire_field(reply, "base", int), wire_field(reply, "length", int)
        gen = wire_field(reply, "gen", int)
        if base <= 0 or length <= 0:
            raise PeerError(f"a region at {base} of {length} bytes")
        return name, meta, base, length, gen

    def answered(self, seconds: float, budget: float) -> bool:
        """Notes a lookup answered in `seconds`; whether that was within
        its share of `budget` (a fast answer ends any backoff)."""
        if seconds <= budget * SLOW_SHARE:
            self.backoff, self.failures = 0.0, 0
            return True
        return False

    def back_off(self, now: float, floor: float, why: str, close: bool) -> None:
        """Skips this peer for a doubling backoff (at least `floor`);
        `close`: its connection too (it broke the protocol), so the next
        ask starts a new one."""
        self.failures += 1
        self.hello_sent = False  # a hello unanswered is sent again after the backoff
        self.backoff = min(MAX_BACKOFF_S, max(floor, self.backoff * 2))
        self.skip_until = now + self.backoff
        if close:
            self.close()
        log = logger.warning if self.failures == 1 else logger.debug
        log(
            "pinshm encoder cache: peer %s failed (%s): a miss; skipped for %.3g s (%s)",
            self.address,
            why,
            self.backoff,
            "first" if self.failures == 1 else "again",
        )

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        self.asked.clear()
        self.hello_sent = False
