"""The report every doctor check writes into: one line per finding
(:class:`Check`), the plan the checks judge against (:class:`Plan`), and
the verdict under them (:func:`format_report`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from .._node.budget import GIB, MIB

OK, WARN, FAIL, INFO = "ok", "warn", "FAIL", "info"
#: A check whose subject is not here (no vLLM, no GPU): not passed, said.
SKIP = "skip"

__all__ = ["FAIL", "GIB", "INFO", "MIB", "OK", "SKIP", "WARN", "Check", "Plan", "format_report"]


@dataclasses.dataclass
class Plan:
    """What vLLM will be started with (doctor's options)."""

    #: ``--mm-processor-cache-gb`` (vLLM's default: 4; 0 switches it off).
    cache_gib: float = 4.0
    #: ``--tensor-parallel-size`` (local workers).
    tp: int = 1
    #: ``VLLM_MQ_MAX_CHUNK_BYTES_MB``, the executor queue's chunk (MiB).
    mq_chunk_mib: int = 16
    #: ``--enable-shm-tensor-arena``.
    tensor_arena: bool = False
    #: /dev/shm's size to plan for (MiB); None: this machine's.
    shm_mib: Optional[int] = None


@dataclasses.dataclass
class Check:
    """One line of the report."""

    topic: str
    status: str
    text: str


def _mib(n: float) -> str:
    return f"{n / MIB:,.0f} MiB"


def format_report(checks: list[Check]) -> str:
    """The lines, then one verdict that claims only what was checked."""
    lines = [f"[{c.status:^4}] {c.topic:<8} {c.text}" for c in checks]
    bad = [c for c in checks if c.status == FAIL]
    warned = [c for c in checks if c.status == WARN]
    skipped = sorted({c.topic for c in checks if c.status == SKIP})
    head = f"{len(bad)} problem(s), {len(warned)} warning(s)"
    ran = [
        e for e, t in (("vLLM", "vllm"), ("SGLang", "sglang")) if t not in skipped and any(c.topic == t for c in checks)
    ]
    if bad:
        verdict = "fix the FAIL lines before starting the engine"
    elif "vllm" in skipped and "sglang" in skipped:
        verdict = "nothing failed, but neither vLLM nor SGLang is here: install one and run doctor again"
    elif "vllm" in skipped and "SGLang" not in ran:
        verdict = "nothing failed, but vLLM is not here: install it and run doctor again"
    else:
        verdict = f"{' and '.join(ran or ['vLLM'])} can start with pinshm"
    not_checked = f"; not checked: {', '.join(skipped)}" if skipped else ""
    lines.append(f"{head}{not_checked}: {verdict}")
    return "\n".join(lines)
