"""The producer's NIXL process (``python -m pinshm.vllm.ec.remote.nixl_process
FD``), started by :class:`.producer.Server`: an agent and a read-only
mapping of the store's data region, and nothing else: no key, no
endpoint, no store, and a sandbox (:mod:`.sandbox`) that leaves it no
file, no /proc of the engine and no ptrace. UCX over TCP checks neither the bounds nor the
access of a READ or WRITE: a peer's WRITE into the region faults on its
read-only pages and kills this process (the scheduler starts another;
meanwhile lookups are misses); a READ or WRITE outside it reaches this
process's memory alone (docs/security.md)."""

from __future__ import annotations

import mmap
import os
import socket
import sys
from typing import Any, Optional

from .child import LOCAL_MESSAGE, start


def hold(parent: socket.socket, cfg: dict[str, Any]) -> int:
    """The NIXL process: an agent and the read-only region, registered as
    the scheduler hands it over (``{"op": "region"}`` with the file's
    descriptor: answered with the agent's name, metadata and the region's
    address here), and nothing else: no key, no endpoint, no store. UCX's
    progress thread serves the READs."""
    from .nixl import agent
    from .protocol import pack, unpack
    from .sandbox import confine, drop_uid, probe_if_asked

    parent.settimeout(None)
    try:
        import numpy  # noqa: F401 - imported now: its files may not be the sandbox uid's to read

        # Sandboxed before the agent, while this is the only thread (UCX's
        # progress thread starts with the agent, inside the sandbox).
        status = confine([str(p) for p in cfg.get("deny") or []])
        a = agent(str(cfg["agent"]), progress=True)
    except BaseException as e:  # noqa: BLE001 - said to the scheduler, which raises it
        parent.sendall(pack({"error": f"{type(e).__name__}: {e}"}))
        return 1
    drop_uid(status)
    parent.sendall(pack({"ready": a.name, "sandbox": status}))
    probe_if_asked()
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


def main(argv: list[str]) -> int:
    got = start(argv)
    if got is None:
        return 0
    parent, cfg = got
    parent.settimeout(None)
    return hold(parent, cfg)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
