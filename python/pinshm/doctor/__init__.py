"""``python -m pinshm doctor``: checks a machine before an engine starts
on it. Each check says what will and will not work, and why, as lines of
one report (:mod:`.report`):

- :mod:`.shm`: /dev/shm against the planned cache and queues (vLLM's own
  check of each queue it builds, the node budget's sizes);
- :mod:`.gpu`: whether this build has the ``cuda`` feature, whether the
  driver loads, whether host registration works (``--gpu``: the GPU kit's
  copies and NUMA placement too);
- :mod:`.vllm`: vLLM's version, the entry point, the names the plugin
  rebinds and their fit, the worker start method;
- :mod:`.sglang`: SGLang's version and fit, the entry point, what stays
  SGLang's.

Nothing here needs vLLM, SGLang, torch or a GPU: a check whose subject is
absent says so. The engine adapters are read through their facades
(``pinshm.vllm.facade``, ``pinshm.sglang.facade``), never their private
modules.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

from .. import _pinshm
from .gpu import check_cuda
from .report import FAIL, INFO, OK, SKIP, WARN, Check, Plan, format_report
from .sglang import check_sglang
from .shm import budget_plan, check_shm
from .vllm import check_fit, check_start_method, check_vllm

__all__ = [
    "FAIL",
    "INFO",
    "OK",
    "SKIP",
    "WARN",
    "Check",
    "Plan",
    "budget_plan",
    "check_cuda",
    "check_fit",
    "check_sglang",
    "check_shm",
    "check_start_method",
    "check_vllm",
    "format_report",
    "run",
]


def run(plan: Plan, checks: Optional[list[Callable[[], list[Check]]]] = None) -> list[Check]:
    """Every check, in report order; a check that raises is a FAIL line."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = [Check("pinshm", INFO, f"pinshm {_pinshm.__version__} at {here}")]
    for check in checks or [lambda: check_shm(plan), check_cuda, check_vllm, check_sglang, check_start_method]:
        try:
            out.extend(check())
        except Exception as e:  # noqa: BLE001 - one broken check must not hide the rest
            out.append(Check("doctor", FAIL, f"a check failed: {type(e).__name__}: {e}"))
    return out
