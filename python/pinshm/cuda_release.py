"""A release gate for torch (see `pinshm.set_release_gate`): a read of a
pinned slot is acknowledged only once the GPU has finished the copies
queued from it.

A worker that turns slots into tensors (the slot is the tensor when the
ring is pinned) and copies them with `.to(device, non_blocking=True)` may
drop the last view before the DMA has read it. `install()` makes every
release, in a process where CUDA is initialised, record a
`torch.cuda.Event` on the current stream (after the copies queued on it)
and wait for it without blocking anyone: the slot is reused only after.
Where CUDA is not initialised, releases happen at once, as without a gate.
"""

from __future__ import annotations

from typing import Any, Optional

from . import set_release_gate


def torch_cuda_event() -> Optional[Any]:
    """The gate: an event recorded on the current CUDA stream, or None
    (release now) where torch or CUDA is not in use in this process."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def install() -> None:
    """Gates every release of this process on the GPU (see the module doc)."""
    set_release_gate(torch_cuda_event)


def uninstall() -> None:
    set_release_gate(None)
