"""The ``vllm.general_plugins`` entry point (``pinshm``), declared in
pyproject.toml.

vLLM calls :func:`register` in the API server, the engine core and every
worker before their caches are built. It rebinds the names vLLM's
shared-memory multimodal cache looks up in ``vllm.multimodal.cache.shm``
(rebinding them in ``shm_object_storage`` alone would be too late: the
cache module imported them already), so ``--mm-processor-cache-type shm``
runs on pinshm. vLLM's own ``VLLM_PLUGINS`` allowlist switches it off
(list the plugins you want without ``pinshm``).

With ``PINSHM_VLLM_MESSAGE_QUEUE=1`` it also makes vLLM's executor and
``GroupCoordinator`` use :class:`pinshm.vllm.message_queue.MessageQueue`
(opt-in).
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Optional

from . import storage

#: Where vLLM 0.33's multimodal cache looks the storage classes up.
CACHE_MODULE = "vllm.multimodal.cache.shm"
#: The names rebound there.
REBOUND = ("SingleWriterShmRingBuffer", "SingleWriterShmObjectStorage", "MsgpackSerde")

_registered = False


def _logger() -> logging.Logger:
    try:
        from vllm.logger import init_logger
    except ImportError:
        return logging.getLogger(__name__)
    # Under "vllm", so vLLM's own logging configuration shows it.
    return init_logger("vllm.plugins.pinshm")


def register(module: Optional[ModuleType] = None) -> None:
    """Rebinds vLLM's shared-memory cache classes to pinshm's (in
    ``module``, default :data:`CACHE_MODULE`). Idempotent: vLLM may load
    plugins more than once in a process. Logs one line. Never raises: vLLM
    calls plugins unguarded in every command, so a vLLM this plugin does
    not know gets a warning and stays as it is."""
    global _registered
    try:
        if module is None:
            module = importlib.import_module(CACHE_MODULE)
        missing = [name for name in REBOUND if not hasattr(module, name)]
        if missing:
            raise RuntimeError(
                f"{module.__name__} has no {', '.join(missing)}: not the vLLM 0.33 "
                f"layout pinshm.vllm was built for"
            )
        queue = os.environ.get("PINSHM_VLLM_MESSAGE_QUEUE") == "1"
        if queue:
            from .message_queue import install

            install()
    except Exception as e:  # noqa: BLE001 - see the docstring
        _logger().warning("pinshm not in use: %s", e)
        return
    for name in REBOUND:
        setattr(module, name, getattr(storage, name))
    if not _registered:
        _registered = True
        from .. import __version__

        _logger().info(
            "pinshm %s in use: %s on pinshm",
            __version__,
            "the shm multimodal cache and MessageQueue run"
            if queue
            else "the shm multimodal cache (--mm-processor-cache-type shm) runs",
        )
