"""Whether the installed SGLang is one whose internals the plugin was
checked against, and still has the names it binds: the plugin binds
nothing otherwise (one WARNING), and SGLang's own path stays."""

from __future__ import annotations

import importlib
import inspect
from typing import Optional

#: SGLang versions whose ``mm_utils`` and request receiver were read and
#: run with the plugin bound (docs/sglang.md).
TESTED = ("0.5.23",)

MM_UTILS = "sglang.srt.managers.mm_utils"
CLASS = "ShmPointerMMData"
#: What SGLang's helpers and hops use of the class, besides its name.
METHODS = ("__init__", "__getstate__", "__setstate__", "materialize", "close_and_unlink")
#: The functions that wrap, test, unwrap and discard features by the class.
HELPERS = (
    "_wrap_shm_or_inline",
    "wrap_shm_features",
    "has_shm_features",
    "unwrap_shm_features",
    "discard_shm_features",
    "_get_is_default_transport",
    "get_serving",
)


def sglang_version() -> Optional[str]:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - not installed
        return None


def misfit() -> Optional[str]:
    """Why the plugin must not bind here, or None where it fits."""
    v = sglang_version()
    if v is None:
        return "SGLang is not installed"
    if v not in TESTED:
        return f"SGLang {v} is not one the plugin was checked against ({', '.join(TESTED)})"
    try:
        mm = importlib.import_module(MM_UTILS)
    except Exception as e:  # noqa: BLE001 - reported
        return f"{MM_UTILS} does not import: {type(e).__name__}: {e}"
    cls = getattr(mm, CLASS, None)
    if not isinstance(cls, type):
        return f"{MM_UTILS}.{CLASS} is gone"
    missing = [m for m in METHODS if not callable(getattr(cls, m, None))]
    missing += [f for f in HELPERS if not callable(getattr(mm, f, None))]
    if missing:
        return f"SGLang {v}'s {MM_UTILS} lacks {', '.join(missing)}"
    params = list(inspect.signature(cls).parameters)
    if params[:1] != ["tensor"] or "precomputed_hash" not in params:
        return f"SGLang {v}'s {CLASS} takes {params}, not (tensor, precomputed_hash)"
    return None
