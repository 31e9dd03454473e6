"""What a store's reader table and key index say, read by the scheduler
without a lease: whether a key is there, and how many of this engine's
workers hold a reader entry of a segment (a rank that has not reported
yet). A leaf but for the binding."""

from __future__ import annotations

import os
from typing import Optional

from ..._pinshm import PinshmError, StoreReader


def holds(reader: Optional[StoreReader], key: str) -> bool:
    """Whether `reader`'s store has `key` now (no lease)."""
    try:
        return reader is not None and reader.lookup(key) is not None
    except PinshmError:
        return False


def workers_holding(reader: Optional[StoreReader], epoch: int) -> int:
    """How many distinct child processes of this one hold a live reader
    entry of segment `epoch`, by the table of the segment `reader` reads
    (0 when this process reads no such segment)."""
    if reader is None:
        return 0
    try:
        if reader.epoch != epoch:
            return 0
        live = reader.live_readers()
    except PinshmError:  # closed or gone: no answer from the table
        return 0
    me = os.getpid()
    pids = {pid for _, pid in live if pid != me}
    return sum(1 for pid in pids if _parent_of(pid) == me)


def _parent_of(pid: int) -> Optional[int]:
    """The parent of process `pid` (/proc/PID/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # pid (comm) state ppid ...: comm may hold spaces and parentheses.
        return int(stat[stat.rindex(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def entries(store: str) -> tuple[Optional[int], Optional[int]]:
    """Reader entries of `store`: free for an attach now, and in all (None:
    unknown). Advice for an engine that could not attach, so it has no
    reader to ask: the inspector reads the table."""
    try:
        from ...segments import inspect_segment

        snap = inspect_segment(store)
        return snap.entries_free, len(snap.readers)
    except Exception:  # noqa: BLE001 - advice only
        return None, None
