"""What every process of the remote tier does first (the serving process,
the NIXL process, the fetch process), and the limits of the socket pair
each shares with the scheduler that started it (:mod:`.spawn`). A leaf
but for :mod:`.protocol`.

A child takes one config message over its socket (keys included: never
in argv or the environment), dies with the scheduler
(``PR_SET_PDEATHSIG``), writes no core file (a peer's WRITE into a
read-only region kills it: its heap would go to disk each time), cannot
be ptraced by the engine's other processes (not dumpable), and takes the
environment the config gives it (UCX's settings, read as an agent is
made).
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import socket
from typing import Any, Optional

#: The most one message over a socket pair takes (a hello's answer carries
#: NIXL's metadata; a lookup of a request's keys, up to MAX_KEYS of them).
LOCAL_MESSAGE = 1 << 21
#: How long either side of a socket pair waits to send or for an answer
#: (then the child exits, or the scheduler stops it, and another starts).
LOCAL_TIMEOUT_S = 5.0
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4


class Inbox:
    """One socket pair's end, read into a buffer made once: a message is at
    most LOCAL_MESSAGE bytes, and ``recv(LOCAL_MESSAGE)`` would allocate
    (and map) that much for every one of them, on the hit's path."""

    def __init__(self) -> None:
        self._buf = bytearray(LOCAL_MESSAGE)

    def recv(self, sock: socket.socket) -> bytes:
        """The next message (b"" when the other end closed)."""
        n = sock.recv_into(self._buf)
        return bytes(memoryview(self._buf)[:n])


def start(argv: list[str]) -> Optional[tuple[socket.socket, dict[str, Any]]]:
    """The socket to the scheduler (``argv[1]``, a descriptor) and the
    config it sent, with this process set up as the module doc says; None
    where the scheduler is gone already."""
    from .protocol import unpack

    parent = socket.socket(fileno=int(argv[1]))
    data = parent.recv(LOCAL_MESSAGE)
    if not data:
        return None
    cfg = unpack(data)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(cfg["parent"]):
        return None  # it died before the line above
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    parent.settimeout(LOCAL_TIMEOUT_S)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = int(cfg.get("nofile") or hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    os.environ.update({str(k): str(v) for k, v in (cfg.get("env") or {}).items()})
    return parent, cfg
