"""A release gate for torch (see `pinshm.set_release_gate`): a read of a
pinned slot is acknowledged only once the GPU has finished the copies
queued from it.

A worker that turns slots into tensors (the slot is the tensor when the
ring is pinned) and copies them with `.to(device, non_blocking=True)` may
drop the last view before the DMA has read it. `install()` makes every
release, in a process where CUDA is initialised, record a
`torch.cuda.Event` and wait for it without blocking anyone (pinshm's
release poller acknowledges the read once the event has completed): the
slot is reused only after. Where CUDA is not initialised, releases happen
at once, as without a gate. Copies out (`get_copy`, `get_copy_into`) are
never gated.

Which stream. pinshm cannot see which stream a copy from a slot was queued
on. The event is recorded on:

- the current stream (`torch.cuda.current_stream()`, of the current
  device) at the moment the read's last view goes: right when the copies
  were queued on that stream, e.g. the view is dropped inside the same
  `with torch.cuda.stream(s):` block that copied from it, or everything
  runs on the default stream;
- and, with `install(streams=[s, ...])`, on each of those streams too: for
  copies queued on side streams while the view may be dropped elsewhere
  (another stream current, or garbage collection at any moment). The read
  is released once every one of those events has completed.

A copy queued on a stream that is neither current when the view goes nor
named in `streams` is not waited for: the slot may be reused under it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any, Optional

from . import set_release_gate


class AllEvents:
    """Completes once each of its events has (`query()` true for all)."""

    def __init__(self, events: Iterable[Any]) -> None:
        self._events: list[Any] = list(events)

    def query(self) -> bool:
        self._events = [e for e in self._events if not e.query()]
        return not self._events


def torch_cuda_event(streams: Optional[Sequence[Any]] = None) -> Optional[Any]:
    """The gate: an event recorded on the current CUDA stream (and, if
    `streams` is given, one on each of them: see the module doc), or None
    (release now) where torch or CUDA is not in use in this process."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record()
    if not streams:
        return event
    events = [event]
    for stream in streams:
        e = torch.cuda.Event()
        e.record(stream)
        events.append(e)
    return AllEvents(events)


def install(streams: Optional[Iterable[Any]] = None) -> None:
    """Gates every release of this process on the GPU: on the current
    stream when the last view goes, and on each of `streams` (see the
    module doc)."""
    chosen = tuple(streams) if streams is not None else None
    set_release_gate(functools.partial(torch_cuda_event, chosen))


def uninstall() -> None:
    set_release_gate(None)
