"""SGLang here: its version against the plugin's fit check, pinshm's
entry point, and what of SGLang stays SGLang's (its HTTP tokenizer
workers' segments, hashing on the event loop). What the adapter knows of
itself comes through its facade (:mod:`pinshm.sglang.facade`)."""

from __future__ import annotations

import importlib.metadata
import os
import sys

from ..sglang import facade
from .report import FAIL, INFO, OK, SKIP, WARN, Check


def check_sglang() -> list[Check]:
    """SGLang's version against the plugin's fit check, its entry point,
    and what of SGLang stays SGLang's (its tokenizer workers' segments,
    hashing on the event loop) in this environment."""
    version = facade.sglang_version()
    if version is None:
        return [Check("sglang", SKIP, "SGLang is not installed in this environment: its checks did not run")]
    why = facade.misfit()
    out = [
        Check(
            "sglang",
            OK if why is None else FAIL,
            f"SGLang {version}: pinshm's ShmPointerMMData fits" if why is None else f"the plugin will not bind: {why}",
        )
    ]
    if sys.version_info >= (3, 10):
        eps = list(importlib.metadata.entry_points(group="sglang.srt.plugins"))
    else:
        eps = list(importlib.metadata.entry_points().get("sglang.srt.plugins", []))
    if not any(e.name == "pinshm" for e in eps):
        out.append(Check("sglang", FAIL, "no 'pinshm' sglang.srt.plugins entry point: SGLang will not load it"))
    allowed = os.environ.get("SGLANG_PLUGINS")
    if allowed is not None and "pinshm" not in [p.strip() for p in allowed.split(",")]:
        out.append(Check("sglang", WARN, f"SGLANG_PLUGINS={allowed!r} leaves pinshm out: SGLang will not load it"))
    if os.environ.get("PINSHM_SGLANG", "1").strip().lower() in ("0", "false", "off", "no"):
        out.append(Check("sglang", INFO, "PINSHM_SGLANG=0: SGLang's own multimodal segments stay"))
    pkg = os.environ.get("SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE")
    if pkg and pkg != facade.WORKERS:
        out.append(
            Check(
                "sglang",
                WARN,
                f"SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE={pkg}: SGLang's HTTP tokenizer workers "
                "(--tokenizer-worker-num > 1) keep SGLang's own segments (one per feature; they leak on a SIGKILL)",
            )
        )
    else:
        out.append(Check("sglang", OK, "HTTP tokenizer workers (--tokenizer-worker-num > 1) are bound too"))
    if os.environ.get("SGLANG_MM_PRECOMPUTE_HASH", "").strip().lower() in ("0", "false", "off", "no"):
        out.append(
            Check("sglang", WARN, "SGLANG_MM_PRECOMPUTE_HASH=0: features are hashed on the tokenizer's event loop")
        )
    return out
