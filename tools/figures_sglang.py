"""Renderer of tools/figures.py for SGLang end to end (docs/sglang.md).

The results file holds `runs`: each the rows one invocation of
`examples/sglang_e2e/run.py` wrote to its RESULTS.json, with a `label`
(its /dev/shm and deployment). The table is the harness's own
(`examples/sglang_e2e/summary.py`, loaded by path: the same code writes
RESULTS.md there and the figure here). Standard library only.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

SUMMARY = os.path.join(os.path.dirname(__file__), "..", "examples", "sglang_e2e", "summary.py")


def _summary() -> Any:
    spec = importlib.util.spec_from_file_location("sglang_e2e_summary", SUMMARY)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def r_sglang(data: Any) -> str:
    table = _summary().table
    return "\n".join(f"**{run['label']}**\n\n{table(run['rows'])}" for run in data["runs"])


RENDERERS = {"sglang": r_sglang, "sglang-host": r_sglang}
