"""The served store's data region, as the producer's scheduler
(:mod:`.producer`) hands it to its NIXL process: the file under a
reader's mapping of it, and where a leased tensor's elements lie in it.
A leaf."""

from __future__ import annotations

import math
import os
from typing import Optional

from ...._pinshm import ObjectHandle, StoreReader
from .protocol import ITEMSIZE, digest

#: Digests kept (the oldest go first).
MAX_DIGESTS = 4096


def region_file(reader: StoreReader) -> Optional[tuple[int, int, int]]:
    """A read-only descriptor of the file under `reader`'s data region, and
    the region's offset and length in it; None where the name no longer
    names that file (replaced, unlinked). The mapping's file and offset
    come from /proc/self/maps; the file opened by its name is checked to be
    that one (device and inode) before it is handed on."""
    base, length = reader.data_region()
    found = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= base < hi:
                if base + length <= hi and len(parts) == 6:
                    found = parts
                break
    if found is None:
        return None
    path = found[5].rstrip("\n")
    if not path.startswith("/dev/shm/") or path.endswith(" (deleted)"):
        return None
    offset = int(found[2], 16) + base - lo
    major, minor = (int(x, 16) for x in found[3].split(":"))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if st.st_ino != int(found[4]) or (os.major(st.st_dev), os.minor(st.st_dev)) != (major, minor):
        os.close(fd)
        return None
    return fd, offset, int(length)


def place(
    reader: StoreReader, handle: ObjectHandle, digests: Optional[dict[tuple[int, int], bytes]] = None
) -> tuple[int, int, str, tuple[int, ...], bytes]:
    """(offset in the data region, bytes, dtype, shape, digest) of a
    tensor's elements. The digest is taken here, from this (trusted)
    process's reader, once per object: `digests` keeps them by (epoch, id),
    an object's bytes never changing once published."""
    import numpy as np

    base, length = reader.data_region()
    guard = reader.get(handle)
    try:
        dtype, shape, at = guard.tensor_meta()
        view = np.frombuffer(guard, dtype=np.uint8)
        start = int(view.ctypes.data) + at - base
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        if at + nbytes > len(guard):
            raise ValueError(f"a {dtype} tensor of shape {shape} in an object of {len(guard)} bytes")
        known = None if digests is None else digests.get((handle.epoch, handle.monotonic_id))
        sums = known if known is not None else digest(view[at : at + nbytes])
        del view
    finally:
        guard.release()
    if not 0 <= start <= length - nbytes:
        raise ValueError(f"a payload at {start} outside the region of {length}")
    if digests is not None and known is None:
        digests[(handle.epoch, handle.monotonic_id)] = sums
        while len(digests) > MAX_DIGESTS:
            del digests[next(iter(digests))]
    return start, nbytes, dtype, tuple(shape), sums
