"""The producer's NIXL process as its scheduler (:mod:`.producer`) keeps
it: started with UCX's settings (the interface ``serve`` names, no key),
handed the served store's data region to register, read-only, and
started again after it dies (a peer's WRITE into that region kills it).

A region is handed over only where every page of its store is backed: a
READ of a hole of a sparse store (another engine's writer made it without
``reserve``) would make the kernel allocate it, /dev/shm past every
headroom; such a store is not served, and an ERROR says why.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
from typing import Any, Optional

from ...._pinshm import StoreReader
from .._config import ECSettings
from .child import LOCAL_MESSAGE
from .net import devices_for
from .nixl import DEFAULT_UCX_TLS
from .protocol import PeerError, pack, unpack
from .region import region_file
from .spawn import spawn, stop

logger = logging.getLogger("vllm.pinshm.ec")


class Holder:
    """The NIXL process of a producer's `settings.serve`, and what it has
    registered: (reader, agent name, metadata, base, length)."""

    def __init__(self, settings: ECSettings) -> None:
        assert settings.serve is not None
        self.settings = settings
        self.started = 0
        self._proc: Optional[tuple[subprocess.Popen[bytes], socket.socket]] = None
        self._registered: Optional[tuple[StoreReader, str, bytes, int, int]] = None
        self._said_sparse = False

    @property
    def pid(self) -> Optional[int]:
        return None if self._proc is None else self._proc[0].pid

    @property
    def running(self) -> bool:
        return self._proc is not None

    def ended(self) -> bool:
        """Whether the process ended since the last look (said, and
        forgotten: another starts at the next :meth:`register`)."""
        if self._proc is None or self._proc[0].poll() is None:
            return False
        proc, sock = self._proc
        rc = proc.poll()
        logger.warning(
            "pinshm encoder cache: the NIXL process %d ended (%s): every fetch from it fails; another starts "
            "at the next hello",
            proc.pid,
            f"signal {-rc}" if rc is not None and rc < 0 else f"exit status {rc}",
        )
        stop(proc, sock, wait_s=1)
        self._proc, self._registered = None, None
        return True

    def start(self) -> None:
        """Starts the process: the agent, with UCX's settings, and no key."""
        assert self.settings.serve is not None
        host, port = self.settings.serve
        env = {"UCX_TLS": os.environ.get("UCX_TLS") or DEFAULT_UCX_TLS}
        devices = None if "UCX_NET_DEVICES" in os.environ else devices_for(host)
        if devices is not None:
            env["UCX_NET_DEVICES"] = devices
        self.started += 1
        cfg = {
            "agent": f"pinshm-serve-{os.getpid()}-{port}-{self.started}",
            "env": env,
            # Paths its sandbox must not open, whatever else it may.
            "deny": [self.settings.secret_file] if self.settings.secret_file else [],
        }
        self._proc = spawn("nixl_process", [], cfg, "cannot start its NIXL process")
        self._registered = None

    def stop(self) -> None:
        if self._proc is not None:
            stop(*self._proc)
            self._proc = None

    def register(self, reader: StoreReader) -> dict[str, Any]:
        """The agent's name and metadata and the region's base and length,
        registered now where `reader`'s segment is not the one registered
        already; or ``{"error"}``."""
        assert self._proc is not None
        if self._registered is None or self._registered[0] is not reader:
            exported = region_file(reader)
            if exported is None:
                return {"error": "the store is being replaced"}
            fd, offset, length = exported
            st = os.fstat(fd)
            if st.st_blocks * 512 < st.st_size:
                os.close(fd)
                self._say_sparse(st.st_size - st.st_blocks * 512)
                return {"error": "the store is not reserved: not served"}
            proc, sock = self._proc
            try:
                socket.send_fds(sock, [pack({"op": "region", "offset": offset, "length": length})], [fd])
                said = unpack(sock.recv(LOCAL_MESSAGE))
            except (OSError, PeerError) as e:
                proc.kill()
                return {"error": f"the NIXL process did not register the region ({e!r})"}
            finally:
                os.close(fd)
            if "error" in said:
                return {"error": f"the NIXL process cannot register the region: {str(said['error'])[:300]}"}
            self._registered = (reader, str(said["name"]), bytes(said["meta"]), int(said["base"]), length)
        _, name, meta, base, length = self._registered
        return {"agent": name, "meta": meta, "base": base, "length": length}

    def _say_sparse(self, holes: int) -> None:
        if not self._said_sparse:
            self._said_sparse = True
            logger.error(
                "pinshm encoder cache: store %r is sparse (%d bytes of it are holes: its writer, another engine, "
                "made it without 'reserve'): it is not served, for a READ of a hole would allocate /dev/shm; "
                "set 'reserve': true (or 'serve') on the engine that writes it",
                self.settings.store,
                holes,
            )
