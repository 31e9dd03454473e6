"""The ``sglang.srt.plugins`` entry point (``pinshm``), declared in
pyproject.toml. SGLang calls :func:`register` early in its launcher,
scheduler, detokenizer and DP-controller processes, then applies the
hooks registered. It binds one thing: ``ShmPointerMMData`` in
``sglang.srt.managers.mm_utils`` (a class replacement: SGLang's
``HookRegistry`` rebinds the name there and every ``from ... import``
copy of it). SGLang's ``SGLANG_PLUGINS`` allowlist (entry-point names)
and ``PINSHM_SGLANG=0`` both leave SGLang's own path.
"""

from __future__ import annotations

import logging
import os

from . import _fit

logger = logging.getLogger("pinshm.sglang")

#: Whether this process bound pinshm's class.
bound = False


def register() -> None:
    """Binds pinshm's ``ShmPointerMMData`` where it fits; never raises."""
    global bound
    if bound:
        return
    if os.environ.get("PINSHM_SGLANG", "1").strip().lower() in ("0", "false", "off", "no"):
        logger.info("pinshm sglang: PINSHM_SGLANG=0: SGLang's own multimodal segments stay")
        return
    why = _fit.misfit()
    if why is not None:
        logger.warning("pinshm sglang: not bound: %s; SGLang's own multimodal segments stay", why)
        return
    try:
        import importlib

        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        from . import _pointer

        base = getattr(importlib.import_module(_fit.MM_UTILS), _fit.CLASS)
        if getattr(base, "_pinshm_bound", False):  # already ours (a re-registration)
            bound = True
            return
        cls = _pointer.make(base)
        HookRegistry.register(f"{_fit.MM_UTILS}.{_fit.CLASS}", cls, HookType.REPLACE)
        HookRegistry.register(f"{_fit.MM_UTILS}.wrap_shm_features", _pointer.hash_first, HookType.AROUND)
        bound = True
        _settle_environment()
        logger.info("pinshm sglang: multimodal features go through a pinshm store (pid %d)", os.getpid())
    except Exception as e:  # noqa: BLE001 - SGLang's path stays
        logger.warning("pinshm sglang: not bound: %s: %s; SGLang's own multimodal segments stay", type(e).__name__, e)


#: The package SGLang's tokenizer processes import modules of (its
#: ``SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE``): the plugin's, which binds it
#: in the HTTP tokenizer workers SGLang starts without plugins.
WORKERS = "pinshm.sglang.workers"


def _settle_environment() -> None:
    """What the processes this one starts inherit (SGLang reads both
    variables at each request, and its tokenizer workers are spawned from
    here): items hashed in SGLang's own thread pool, off the tokenizer's
    event loop (``SGLANG_MM_PRECOMPUTE_HASH=1``, unless set, or
    ``PINSHM_SGLANG_HASH=0``), and the tokenizer workers bound
    (``SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE``, unless set: then those
    workers keep SGLang's segments, and ``pinshm doctor`` says so)."""
    if os.environ.get("PINSHM_SGLANG_HASH", "1") != "0":
        os.environ.setdefault("SGLANG_MM_PRECOMPUTE_HASH", "1")
    have = os.environ.get("SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE")
    if not have:
        os.environ["SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE"] = WORKERS
    elif have != WORKERS:
        logger.warning(
            "pinshm sglang: SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE=%s is set: HTTP tokenizer workers "
            "(--tokenizer-worker-num > 1) keep SGLang's own segments",
            have,
        )
