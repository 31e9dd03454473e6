"""Evicting one entry of vLLM's own encoder cache, from the scheduler.

When a worker could not load an output, a placeholder stood in for it in
the workers' encoder cache, and vLLM's scheduler-side
``EncoderCacheManager`` counts that entry as cached: a later request of the
same image would be served from it, as a success. :func:`evict` removes the
entry the way the manager's own eviction does (``can_allocate``): it leaves
``cached``, its embeddings are counted free again, and its hash goes on
``freed``, so the next scheduler output tells the workers to drop their
copy. It returns the requests that referenced it: they read the
placeholder, and are failed.

The manager is found without a change to vLLM: the connector is made by
the ``Scheduler``'s constructor, which is up the call stack then
(:func:`owner_candidates`); the one whose ``ec_connector`` is the
connector is its scheduler (:func:`manager_of`). No vLLM import: the
manager is read by its attributes (vLLM 0.32 and 0.33 name them alike),
and one that does not have them is left alone (and said so once).
"""

from __future__ import annotations

import logging
import sys
import weakref
from types import FrameType
from typing import Any, Callable, Optional

logger = logging.getLogger("vllm.pinshm.ec")

#: Frames above the connector's constructor searched for its scheduler.
MAX_FRAMES = 12

_ATTRS = ("cached", "num_embeds_by_hash", "freeable", "freed", "num_free_slots", "num_freeable_slots")


def owner_candidates(skip: object, depth: int = 2) -> list[Callable[[], Any]]:
    """References to the objects whose methods are on the call stack above
    the caller (`skip`, the connector, left out): one of them is the
    scheduler that is making the connector."""
    out: list[Callable[[], Any]] = []
    frame: Optional[FrameType] = sys._getframe(depth)
    for _ in range(MAX_FRAMES):
        if frame is None:
            break
        obj = frame.f_locals.get("self")
        if obj is not None and obj is not skip:
            try:
                out.append(weakref.ref(obj))
            except TypeError:  # no weak references: held strongly
                out.append(_strong(obj))
        frame = frame.f_back
    return out


def _strong(obj: object) -> Callable[[], Any]:
    return lambda: obj


def manager_of(connector: object, candidates: list[Callable[[], Any]]) -> Optional[Any]:
    """The encoder cache manager of the candidate whose ``ec_connector`` is
    `connector` (None if there is none, or it lacks what :func:`evict` uses)."""
    for ref in candidates:
        owner = ref()
        if owner is not None and getattr(owner, "ec_connector", None) is connector:
            manager = getattr(owner, "encoder_cache_manager", None)
            # vLLM's own manager only: a custom one (ec_manager_config) may
            # keep other books under the same names.
            if type(manager).__qualname__ == "EncoderCacheManager" and all(hasattr(manager, a) for a in _ATTRS):
                return manager
    return None


def evict(manager: Any, mm_hash: str) -> set[str]:
    """Evicts `mm_hash` from vLLM's encoder cache manager, referenced or
    not; returns the requests that referenced it. A hash not cached is
    left alone (an empty set)."""
    cached = manager.cached
    if mm_hash not in cached:
        return set()
    refs = set(cached.pop(mm_hash))
    n = int(manager.num_embeds_by_hash.pop(mm_hash, 0))
    if refs:
        # Referenced: allocate() took it from both counts.
        manager.num_free_slots += n
        manager.num_freeable_slots += n
    else:
        # Unreferenced: in freeable, already counted freeable.
        manager.freeable.pop(mm_hash, None)
        manager.num_free_slots += n
    manager.freed.append(mm_hash)
    return refs
