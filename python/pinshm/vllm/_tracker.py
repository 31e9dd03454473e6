"""Segment names registered with multiprocessing's resource tracker, as
vLLM's ``SharedMemory`` segments are: a process killed without closing
(vLLM SIGKILLs its engine core and workers) leaves its names to the
tracker, which unlinks them. Used by the cache and the queue alike."""

from __future__ import annotations

import os


def track(name: str) -> None:
    """Registers segment `name` (best effort, as in the stdlib)."""
    try:
        from multiprocessing import resource_tracker

        resource_tracker.register("/" + name, "shared_memory")
    except Exception:  # noqa: BLE001
        pass


def untrack(name: str) -> None:
    """Takes `name` back (it was removed, or will be by its owner)."""
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister("/" + name, "shared_memory")
    except Exception:  # noqa: BLE001
        pass


class Tracked:
    """The names one object registered, taken back one by one or all at
    once (when it closes, or when it is collected: its segments go with
    it, and the tracker must not unlink a name again)."""

    def __init__(self) -> None:
        self._names: list[str] = []
        # A forked child shares its parent's tracker: its copy of this
        # object must not take back the parent's names (a child that closes
        # or drops it would leave a SIGKILLed parent's segments behind).
        self._pid = os.getpid()

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def add(self, name: str) -> None:
        self._names.append(name)
        track(name)

    def discard(self, name: str) -> None:
        if name in self._names:
            self._names.remove(name)
            if os.getpid() == self._pid:
                untrack(name)

    def clear(self) -> None:
        for name in list(self._names):
            self.discard(name)
