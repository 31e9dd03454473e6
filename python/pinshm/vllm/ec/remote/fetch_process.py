"""The consumer's fetch process (``python -m
pinshm.vllm.ec.remote.fetch_process FD STAGING_FD``), started and watched
by :class:`.fetcher.Fetcher`: the only place a consumer holds a NIXL agent
(docs/security.md). UCX over TCP lets whoever reaches an agent's process
READ and WRITE its memory, so the agent is here, beside a staging buffer
(a memfd the scheduler maps read-only), and nothing of the engine: no
key, no mapping of a store, and a sandbox (:mod:`.sandbox`) that leaves
it no file, no /proc of the engine and no ptrace.

Requests, one msgpack map each over the socket pair, one answer each:
``{"op": "add", "meta"}`` → ``{"name"}``; ``{"op": "remove", "name"}`` →
``{}``; ``{"op": "read", "name", "parts": [[addr, nbytes, at], ...],
"timeout"}`` → ``{"state": "DONE" | "ERR" | "PROC"}`` (PROC: not done in
time): one NIXL READ of every part, each into the staging buffer at
`at`. The scheduler copies the bytes into their slots and publishes them
only where the copy matches the digest the producer sent over the
authenticated channel: whatever a stranger writes here is a miss, never
an output.
"""

from __future__ import annotations

import ctypes
import mmap
import socket
import sys
import time
from typing import Any

from .child import Inbox, start

#: The most parts one READ takes (a request's items: at most MAX_KEYS).
MAX_PARTS = 256


def parts_of(msg: dict[str, Any], size: int) -> list[tuple[int, int, int]]:
    """The (remote address, bytes, staging offset) of a read, each within
    the staging buffer of `size` bytes (ValueError if not)."""
    parts = msg["parts"]
    if not isinstance(parts, list) or not 0 < len(parts) <= MAX_PARTS:
        raise ValueError(f"a read of {len(parts) if isinstance(parts, list) else '?'} parts")
    out = []
    for part in parts:
        addr, nbytes, at = (int(x) for x in part)
        if not (0 < nbytes and 0 <= at and at + nbytes <= size and addr >= 0):
            raise ValueError(f"{nbytes} bytes at {at} for a staging buffer of {size}")
        out.append((addr, nbytes, at))
    return out


def read(agent: Any, base: int, name: str, parts: list[tuple[int, int, int]], timeout: float) -> str:
    """One NIXL READ of `parts` from agent `name`; its final state, or PROC
    where it was not done in `timeout` (this process then exits: a late
    write lands in staging, which the scheduler checks, and a fresh
    process starts at the next request)."""
    deadline = time.monotonic() + max(0.0, timeout)
    local = agent.get_xfer_descs([(base + at, n, 0) for _, n, at in parts], "DRAM")
    remote = agent.get_xfer_descs([(addr, n, 0) for addr, n, _ in parts], "DRAM")
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
        except Exception:  # noqa: BLE001 - still in flight: exit, and start clean
            if state == "PROC":
                raise SystemExit(1) from None
    return str(state)


def serve(sock: socket.socket, agent: Any, base: int, size: int) -> None:
    from .protocol import pack, unpack

    inbox = Inbox()
    while True:
        data = inbox.recv(sock)
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
                parts = parts_of(msg, size)
                reply = {"state": read(agent, base, str(msg["name"]), parts, float(msg["timeout"]))}
            else:
                reply = {"error": f"no such op {str(op)[:40]!r}"}
        except SystemExit:
            raise
        except Exception as e:  # noqa: BLE001 - NIXL's errors: said to the scheduler
            reply = {"error": repr(e)[:500]}
        sock.sendall(pack(reply))


def main(argv: list[str]) -> int:
    from .nixl import agent
    from .protocol import pack
    from .sandbox import confine, drop_uid, probe_if_asked

    got = start(argv)
    if got is None:
        return 0
    sock, cfg = got
    sock.settimeout(None)  # it waits for the scheduler's requests
    size = int(cfg["size"])
    try:
        view = mmap.mmap(int(argv[2]), size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(view))
        # Sandboxed before the agent, while this is the only thread.
        status = confine([str(p) for p in cfg.get("deny") or []])
        a = agent(str(cfg["agent"]), progress=False)
        a.register_memory([(base, size, 0, "")], "DRAM")
        drop_uid(status)
    except BaseException as e:  # noqa: BLE001 - said to the scheduler, which raises it
        sock.sendall(pack({"error": f"{type(e).__name__}: {e}"}))
        return 1
    sock.sendall(pack({"ready": True, "sandbox": status}))
    probe_if_asked()
    try:
        serve(sock, a, base, size)
    except SystemExit:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
