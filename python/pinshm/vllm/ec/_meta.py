"""What the scheduler tells the workers to load, and what the workers tell
the scheduler back: plain data, pickled by vLLM with the scheduler output
and the model runner output. A leaf."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LoadSpec:
    """One encoder output to load this step: the handle the scheduler
    leased (address, id, epoch), the rows vLLM expects, and the request,
    input and modality it serves (for a failed load: the request to fail,
    and the width of the placeholder that stands in for the output)."""

    mm_hash: str
    address: int
    monotonic_id: int
    epoch: int
    num_embeds: int
    request_id: str
    input_index: int
    modality: str = ""
    #: In the store of outputs fetched from other nodes (``remote_store``).
    remote: bool = False


@dataclass(frozen=True)
class RankState:
    """Whether one worker (a TP rank of the engine) reads the store: the
    epoch of the segment it is attached to, or None and why not (every
    reader entry taken, the store not there yet). The scheduler says yes
    only for outputs of an epoch that every rank of its engine reads."""

    rank: int
    epoch: Optional[int]
    why: str = ""
    no_entry: bool = False
    #: The epoch of the store of fetched outputs it reads (None: none).
    remote_epoch: Optional[int] = None


@dataclass(frozen=True)
class FailedLoad:
    """An output a worker could not load: the request it served, and the
    object (epoch, id) that failed, which the scheduler treats as a miss
    until the key names another object (saved again)."""

    request_id: str
    mm_hash: str
    epoch: int
    monotonic_id: int


@dataclass(frozen=True)
class LoadReport:
    """A worker's account since its last report: the steps it loaded, the
    loads that failed (a placeholder went into vLLM's encoder cache in
    their place: the scheduler fails every request that uses it, and has
    vLLM evict it), and its rank's state when that changed. Merged over
    ranks and steps by union."""

    steps: frozenset[int] = frozenset()
    failed: frozenset[FailedLoad] = frozenset()
    ranks: frozenset[RankState] = frozenset()

    def merge(self, other: LoadReport) -> LoadReport:
        return LoadReport(self.steps | other.steps, self.failed | other.failed, self.ranks | other.ranks)

    @property
    def failed_requests(self) -> frozenset[str]:
        return frozenset(f.request_id for f in self.failed)

    def __bool__(self) -> bool:
        return bool(self.steps or self.failed or self.ranks)
