"""NUMA placement for ``doctor --gpu``: which node a GPU hangs off (from
sysfs) and which nodes a mapping's pages are on (``move_pages(2)`` in query
mode: it moves nothing). A copy between a GPU and pinned pages on another
node crosses the inter-socket link, at a fraction of the bandwidth.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
from collections import Counter
from typing import Optional

#: ``move_pages``'s syscall number (glibc has no wrapper without libnuma).
SYS_MOVE_PAGES = {"x86_64": 279, "aarch64": 239}


def gpu_node(domain: int, bus: int, device: int) -> Optional[int]:
    """The NUMA node of the PCI device ``domain:bus:device.0``, or None
    where sysfs does not say (no such device, or a kernel without NUMA:
    -1)."""
    path = f"/sys/bus/pci/devices/{domain:04x}:{bus:02x}:{device:02x}.0/numa_node"
    try:
        with open(path) as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def page_nodes(address: int, length: int, samples: int = 256) -> Counter[int]:
    """How many of up to ``samples`` pages spread over ``address ..
    address + length`` (a mapping of this process) are on each NUMA node.
    A page not yet allocated is left out. Raises OSError where the kernel
    refuses (no NUMA support: ENOSYS) or on an unknown architecture."""
    number = SYS_MOVE_PAGES.get(platform.machine())
    if number is None:
        raise OSError(f"move_pages: unknown syscall number on {platform.machine()}")
    page = mmap.PAGESIZE
    first, last = address // page, (address + max(length, 1) - 1) // page
    step = max(1, (last - first + 1) // max(samples, 1))
    pages = [p * page for p in range(first, last + 1, step)][:samples]
    n = len(pages)
    addrs = (ctypes.c_void_p * n)(*pages)
    status = (ctypes.c_int * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # pid 0 (this process), nodes NULL (query only), flags 0.
    r = libc.syscall(ctypes.c_long(number), 0, ctypes.c_ulong(n), addrs, None, status, 0)
    if r != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"move_pages: {os.strerror(err)}")
    return Counter(s for s in status if s >= 0)
