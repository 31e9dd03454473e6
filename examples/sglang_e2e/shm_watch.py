"""Every segment created in /dev/shm under a prefix, by inotify (exact,
where a poll misses segments that live a millisecond)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import struct
import threading
import time

#: SGLang's segments, and pinshm's stores.
PREFIXES = ("sgl_shm_mm_", "pinshm_sgl_")


class ShmWatch(threading.Thread):
    """Records (time, name) of each segment made in /dev/shm under PREFIXES."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, b"/dev/shm", 0x100) < 0:  # IN_CREATE
            raise OSError(ctypes.get_errno(), "inotify")
        self.created: list[tuple[float, str]] = []
        self.lock = threading.Lock()

    def run(self) -> None:
        while True:
            if not select.select([self.fd], [], [], 0.05)[0]:
                continue
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                continue
            now, i = time.time(), 0
            while i + 16 <= len(buf):
                ln = struct.unpack_from("iIII", buf, i)[3]
                name = buf[i + 16 : i + 16 + ln].rstrip(b"\0").decode(errors="replace")
                i += 16 + ln
                if name.startswith(PREFIXES):
                    with self.lock:
                        self.created.append((now, name))

    def between(self, t0: float, t1: float) -> dict[str, int]:
        """Segments made from `t0` to `t1`, by prefix."""
        with self.lock:
            names = [n for t, n in self.created if t0 <= t <= t1]
        return {p: sum(n.startswith(p) for n in names) for p in PREFIXES}
