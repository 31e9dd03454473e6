"""The consumer's handle on its fetch process (:mod:`.fetch_process`, the
only place a consumer holds a NIXL agent: docs/security.md): started at
once, started again after it dies, asked over a socket pair; and the
staging buffer it READs into (a memfd, mapped read-only here). Used by
the fetching thread of :mod:`.consumer` alone.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import threading
from typing import Any, NoReturn, Optional

from .child import Inbox
from .net import devices_towards
from .nixl import DEFAULT_UCX_TLS
from .protocol import PeerError, pack, unpack
from .spawn import spawn

logger = logging.getLogger("vllm.pinshm.ec")

#: How long the scheduler waits for an answer beyond a request's own time.
SLACK_S = 5.0


class FetcherError(PeerError):
    """This node's fetch process failed or is starting again: a miss that
    is no peer's fault."""


class Fetcher:
    """The remote tier's handle on its fetch process: started at once, again
    after it dies; `staging` is the buffer it READs into (read-only here)."""

    def __init__(self, capacity: int, name: str, peers: tuple[str, ...] = (), deny: tuple[str, ...] = ()) -> None:
        self.capacity = max(capacity, mmap.PAGESIZE)
        self.name = name
        #: Paths its sandbox must not open (the secret file).
        self.deny = list(deny)
        #: The peers' hosts: its UCX listens only where they are reached
        #: from (worked out again at each start: a name may resolve later).
        self.peers = peers
        #: ``UCX_NET_DEVICES`` of the process now.
        self.devices: Optional[str] = None
        self._pid = os.getpid()
        self._proc: Any = None
        self._sock: Optional[socket.socket] = None
        self._fd = os.memfd_create("pinshm-fetch-staging", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, self.capacity)
        self.staging = mmap.mmap(self._fd, self.capacity, mmap.MAP_SHARED, mmap.PROT_READ)
        self.starts = 0
        self._inbox = Inbox()
        # A dead process is started again by a thread that lives as long as
        # this (PR_SET_PDEATHSIG follows the thread that started it), in
        # the background: a fetch meanwhile is a miss, never a wait.
        self._wake = threading.Event()
        self._restarter: Optional[threading.Thread] = None
        self._closed = False
        self._start()

    @property
    def pid(self) -> Optional[int]:
        return None if self._proc is None else self._proc.pid

    @property
    def alive(self) -> bool:
        return self._sock is not None and self._proc is not None and self._proc.poll() is None

    def _kick(self) -> None:
        """Has the restarting thread start the process again."""
        if self._restarter is None:
            self._restarter = threading.Thread(target=self._restart_loop, name="pinshm-ec-fetch", daemon=True)
            self._restarter.start()
        self._wake.set()

    def _restart_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            if not self.alive:
                try:
                    self._stop()
                    self._start()
                except Exception as e:  # noqa: BLE001 - said, and tried again at the next fetch
                    logger.warning("pinshm encoder cache: the fetch process cannot start again: %r", e)
                if self._closed:  # closed while it started: it goes too
                    self._stop()
                    return

    def _start(self) -> None:
        self.starts += 1
        cfg = {"agent": f"{self.name}-{self.starts}", "size": self.capacity, "deny": self.deny}
        # The environment's own UCX_NET_DEVICES wins, as on the producer.
        if self.peers and "UCX_NET_DEVICES" not in os.environ:
            self.devices = devices_towards(list(self.peers))
            if self.devices is None:
                logger.warning(
                    "pinshm encoder cache: no peer of %s resolves to a route: the fetch process's UCX listens on "
                    "every interface until it starts again",
                    ", ".join(self.peers),
                )
        self._proc, self._sock = spawn(
            "fetch_process",
            [str(self._fd)],
            cfg,
            "the fetch process cannot start",
            pass_fds=(self._fd,),
            env={
                "UCX_TLS": os.environ.get("UCX_TLS") or DEFAULT_UCX_TLS,
                **({"UCX_NET_DEVICES": self.devices} if self.devices else {}),
            },
        )

    def ask(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Its answer to `msg`; PeerError if it gives none in `timeout` +
        SLACK_S (it is killed then, and started again at the next ask)."""
        self.post(msg, timeout)
        return self.take(timeout)

    def post(self, msg: dict[str, Any], timeout: float) -> None:
        """Sends `msg`, its answer to be taken later (:meth:`take`, in
        order): the next READ runs while this side checks the last."""
        if not self.alive:
            self._kick()
            raise FetcherError("the fetch process is starting again: a miss")
        assert self._sock is not None
        try:
            self._sock.settimeout(timeout + SLACK_S)
            self._sock.sendall(pack(msg))
        except OSError as e:
            self._failed(e)

    def take(self, timeout: float) -> dict[str, Any]:
        """The answer to the oldest request posted and not taken."""
        if self._sock is None:
            raise FetcherError("the fetch process is gone: a miss")
        try:
            self._sock.settimeout(timeout + SLACK_S)
            data = self._inbox.recv(self._sock)
            if not data:
                raise OSError("it exited")
            reply = unpack(data)
        except (OSError, PeerError) as e:
            self._failed(e)
        if "error" in reply:
            raise PeerError(str(reply["error"])[:300])
        return reply

    def _failed(self, e: BaseException) -> NoReturn:
        self._stop()
        self._kick()
        raise FetcherError(f"the fetch process failed ({e!r})") from None

    def _stop(self) -> None:
        sock, proc, self._sock, self._proc = self._sock, self._proc, None, None
        if sock is not None:
            sock.close()
        if proc is not None:
            try:
                proc.wait(2)
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
                proc.kill()
                proc.wait()

    def close(self) -> None:
        """Ends the process (in a forked child: lets go of its copy only)."""
        if os.getpid() != self._pid:
            # A forked child's copies: its own descriptors go, the process
            # (its parent's) stays.
            self._sock = self._proc = None
            try:
                self.staging.close()
            except BufferError:
                pass
            os.close(self._fd)
            return
        self._closed = True
        self._wake.set()
        self._stop()
        try:
            self.staging.close()
        except BufferError:
            pass  # a view still out: the mapping goes with it
        os.close(self._fd)
