"""What the scheduler tells the workers to load, and what the workers tell
the scheduler back: plain data, pickled by vLLM with the scheduler output
and the model runner output. A leaf."""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class LoadReport:
    """A worker's account of one step's loads: the step it loaded, and the
    requests whose input it could not load (a placeholder went into the
    encoder cache in its place: the scheduler fails those requests)."""

    steps: frozenset[int] = frozenset()
    failed: frozenset[str] = frozenset()

    def merge(self, other: LoadReport) -> LoadReport:
        return LoadReport(self.steps | other.steps, self.failed | other.failed)

    def __bool__(self) -> bool:
        return bool(self.steps or self.failed)
