"""The consumer's fetch process: the only place a consumer holds a NIXL
agent (docs/security.md). UCX over TCP listens in every process with an
agent and lets whoever reaches it READ and WRITE that process's memory,
so the agent is not in the engine core: it is here, in a process of its
own (``python -m pinshm.vllm.ec._fetcher FD``), started and watched by
the remote tier (:class:`Fetcher`).

This process holds the agent and a staging buffer (a memfd the
scheduler maps read-only); nothing of the engine, no key, no mapping of
a store. It READs a peer's bytes into the staging buffer when asked. The
scheduler copies them into the slot and publishes them only if the copy
matches the digest the producer's scheduler sent over the authenticated
channel: whatever a stranger writes here is a miss, never an output.

Requests, one msgpack map each over a socket pair, one answer each:
``{"op": "add", "meta"}`` → ``{"name"}``; ``{"op": "remove", "name"}`` →
``{}``; ``{"op": "read", "name", "addr", "nbytes", "timeout"}`` →
``{"state": "DONE" | "ERR" | "PROC"}`` (PROC: not done in time).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import resource
import signal
import socket
import sys
import threading
import time
from typing import Any, Optional

logger = logging.getLogger("vllm.pinshm.ec")

#: The largest message either side sends (an add carries NIXL's metadata).
LOCAL_MESSAGE = 1 << 21
#: How long the scheduler waits for an answer beyond a request's own time.
SLACK_S = 5.0


class Fetcher:
    """The remote tier's handle on its fetch process: started at once, again
    after it dies; `staging` is the buffer it READs into (read-only here)."""

    def __init__(self, capacity: int, name: str) -> None:
        self.capacity = max(capacity, mmap.PAGESIZE)
        self.name = name
        self._pid = os.getpid()
        self._proc: Any = None
        self._sock: Optional[socket.socket] = None
        self._fd = os.memfd_create("pinshm-fetch-staging", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, self.capacity)
        self.staging = mmap.mmap(self._fd, self.capacity, mmap.MAP_SHARED, mmap.PROT_READ)
        self.starts = 0
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
        from ._spawn import spawn
        from ._wire import DEFAULT_UCX_TLS

        self.starts += 1
        cfg = {"agent": f"{self.name}-{self.starts}", "size": self.capacity}
        self._proc, self._sock = spawn(
            [str(self._fd)],
            cfg,
            "the fetch process cannot start",
            module="pinshm.vllm.ec._fetcher",
            pass_fds=(self._fd,),
            env={"UCX_TLS": os.environ.get("UCX_TLS") or DEFAULT_UCX_TLS},
        )

    def ask(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Its answer to `msg`; PeerError if it gives none in `timeout` +
        SLACK_S (it is killed then, and started again at the next ask)."""
        from ._wire import PeerError, pack, unpack

        if not self.alive:
            self._kick()
            raise PeerError("the fetch process is starting again: a miss")
        assert self._sock is not None
        try:
            self._sock.settimeout(timeout + SLACK_S)
            self._sock.sendall(pack(msg))
            data = self._sock.recv(LOCAL_MESSAGE)
            if not data:
                raise OSError("it exited")
            reply = unpack(data)
        except (OSError, PeerError) as e:
            self._stop()
            self._kick()
            raise PeerError(f"the fetch process failed ({e!r})") from None
        if "error" in reply:
            raise PeerError(str(reply["error"])[:300])
        return reply

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


# ---- the process ---------------------------------------------------------


def _read(agent: Any, base: int, msg: dict[str, Any]) -> str:
    name, addr, nbytes = str(msg["name"]), int(msg["addr"]), int(msg["nbytes"])
    deadline = time.monotonic() + max(0.0, float(msg["timeout"]))
    local = agent.get_xfer_descs([(base, nbytes, 0)], "DRAM")
    remote = agent.get_xfer_descs([(addr, nbytes, 0)], "DRAM")
    xfer = agent.initialize_xfer("READ", local, remote, name)
    state = "ERR"
    try:
        state = agent.transfer(xfer)
        pause = 20e-6
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
            state = agent.check_xfer_state(xfer)
    finally:
        try:
            agent.release_xfer_handle(xfer)
        except Exception:  # noqa: BLE001 - still in flight: a late write lands in staging, which is checked
            if state == "PROC":
                raise SystemExit(1) from None  # started again, clean, at the next ask
    return str(state)


def _serve(sock: socket.socket, agent: Any, base: int, size: int) -> None:
    from ._wire import pack, unpack

    while True:
        data = sock.recv(LOCAL_MESSAGE)
        if not data:
            return  # the scheduler is gone
        reply: dict[str, Any]
        try:
            msg = unpack(data)
            op = msg.get("op")
            if op == "add":
                added = agent.add_remote_agent(bytes(msg["meta"]))
                reply = {"name": added.decode() if isinstance(added, bytes) else str(added)}
            elif op == "remove":
                agent.remove_remote_agent(str(msg["name"]))
                reply = {}
            elif op == "read":
                if not 0 < int(msg["nbytes"]) <= size:
                    raise ValueError(f"{msg['nbytes']} bytes for a staging buffer of {size}")
                reply = {"state": _read(agent, base, msg)}
            else:
                reply = {"error": f"no such op {str(op)[:40]!r}"}
        except SystemExit:
            raise
        except Exception as e:  # noqa: BLE001 - NIXL's errors: said to the scheduler
            reply = {"error": repr(e)[:500]}
        sock.sendall(pack(reply))


def main(argv: list[str]) -> int:
    from ._wire import agent, pack, unpack

    sock = socket.socket(fileno=int(argv[1]))
    staging_fd = int(argv[2])
    data = sock.recv(LOCAL_MESSAGE)
    if not data:
        return 0
    cfg = unpack(data)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: dies with the engine
    if os.getppid() != int(cfg["parent"]):
        return 0
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    size = int(cfg["size"])
    try:
        view = mmap.mmap(staging_fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(view))
        a = agent(str(cfg["agent"]), progress=False)
        a.register_memory([(base, size, 0, "")], "DRAM")
    except BaseException as e:  # noqa: BLE001 - said to the scheduler, which raises it
        sock.sendall(pack({"error": f"{type(e).__name__}: {e}"}))
        return 1
    sock.sendall(pack({"ready": True}))
    try:
        _serve(sock, a, base, size)
    except SystemExit:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
