"""The ``vllm.general_plugins`` entry point (``pinshm``), declared in
pyproject.toml, and the one place that rebinds names inside vLLM.

vLLM calls :func:`register` in the API server, the engine core and every
worker before their caches and queues are built. It makes two independent
rebindings, each in its own ``try``: one that fails (any exception, a
``NameError`` from an optional dependency included) is reported and the
other still happens.

- **The cache** (always): the names vLLM's shared-memory multimodal cache
  looks up in ``vllm.multimodal.cache.shm`` (rebinding them in
  ``shm_object_storage`` alone would be too late: the cache module imported
  them already), so ``--mm-processor-cache-type shm`` runs on pinshm.
- **The queue** (``PINSHM_VLLM_MESSAGE_QUEUE``): ``MessageQueue`` in every
  module of :data:`QUEUE_MODULES` that imports, so vLLM's executor and
  ``GroupCoordinator`` build their queues through pinshm. ``auto`` (the
  default): each queue is vLLM's where vLLM's own /dev/shm check passes
  and pinshm's where it would refuse to start (a container's 64 MiB;
  :mod:`pinshm.vllm.queue._auto`); ``1``: always pinshm's
  (:class:`pinshm.vllm.queue.MessageQueue`, and ``Handle`` too);
  ``0``: always vLLM's, nothing rebound. Each module is its own attempt
  (``ray_executor_v2`` raises ``NameError`` without ray).

vLLM's own ``VLLM_PLUGINS`` allowlist switches the plugin off (list the
plugins you want without ``pinshm``). A vLLM whose modules lack the names
pinshm replaces is left alone, with a warning. So is a vLLM whose classes
pinshm's do not fit (:mod:`pinshm.vllm._fit`: a public method vLLM's
class has and pinshm's lacks, a parameter pinshm's would not take): that
part runs on vLLM's own class, with one WARNING naming what is missing and
the vLLM version. The encoder-cache connector, which the user names in
``ec_transfer_config``, is checked against vLLM's ``ECConnectorBase`` the
same way and a misfit is warned about.

The status line (the "in use" line, held back until vLLM's logging is
configured, and the warnings) is :mod:`pinshm.vllm._status`'s.
"""

from __future__ import annotations

import importlib
import logging
import threading
from types import ModuleType
from typing import Any, Optional

from . import _fit, _status

# What the plugin rebinds lives in a leaf module, so that `python -m
# pinshm doctor` can check it without importing the plugin.
from ._fit import CACHE_MODULE, QUEUE_MODULES, REBOUND
from .cache import storage

_lock = threading.Lock()
#: What this process rebound: {"cache": [module], "queue": [modules]}.
rebound: dict[str, list[str]] = {}


def _rebind_cache(module: Optional[ModuleType]) -> str:
    if module is None:
        module = importlib.import_module(CACHE_MODULE)
    missing = [name for name in REBOUND if not hasattr(module, name)]
    if missing:
        raise RuntimeError(
            f"{module.__name__} has no {', '.join(missing)}: not the vLLM 0.33 "
            f"layout pinshm.vllm was built for; vLLM's own classes stay"
        )
    bad = [f for f in _fit.cache_fits(module) if not f.ok]
    if bad:
        raise _fit.NotFit("; ".join(_fit.not_fit_line(f, _fit.vllm_version()) for f in bad))
    for name in REBOUND:
        setattr(module, name, getattr(storage, name))
    return module.__name__


#: vLLM's own MessageQueue, once ``auto`` has put its chooser in its place.
_vllm_queue: Optional[type] = None


def _queue_classes(mode: str) -> tuple[type, Optional[type]]:
    """What to bind to ``MessageQueue`` and ``Handle`` (None: leave it)."""
    global _vllm_queue
    from .queue import Handle, MessageQueue

    if mode == "1":
        return MessageQueue, Handle
    from .queue import _auto

    if _vllm_queue is None:
        current = importlib.import_module(QUEUE_MODULES[0]).MessageQueue
        # Rebinding again (vLLM loads plugins more than once) keeps the
        # first: vLLM's own class, not a chooser or pinshm's.
        _vllm_queue = _fit.vllm_queue_class(current)
        if _vllm_queue is MessageQueue:
            raise RuntimeError("MessageQueue is pinshm's already (PINSHM_VLLM_MESSAGE_QUEUE=1 earlier)")
    return _auto.make(_vllm_queue), None


def _rebind_queue(modules: tuple[str, ...], mode: str = "1") -> tuple[list[str], list[str]]:
    """Rebinds MessageQueue (and, in mode 1, Handle) in each of `modules`
    that imports. Returns (rebound, failures); the first module is
    required."""
    done, failed = [], []
    try:
        fit = _fit.queue_fit(_vllm_queue or importlib.import_module(modules[0]).MessageQueue)
        MessageQueue, Handle = _queue_classes(mode)
    except Exception as e:  # noqa: BLE001 - the required module, as below
        raise RuntimeError(f"{modules[0]}: {type(e).__name__}: {e}") from e
    if not fit.ok:
        raise _fit.NotFit(_fit.not_fit_line(fit, _fit.vllm_version()))
    for i, modname in enumerate(modules):
        try:
            mod: Any = importlib.import_module(modname)
            if not hasattr(mod, "MessageQueue"):
                raise RuntimeError(f"{modname} has no MessageQueue")
        except Exception as e:  # noqa: BLE001 - NameError from a missing ray, too
            if i == 0:
                raise RuntimeError(f"{modname}: {type(e).__name__}: {e}") from e
            # An optional executor (ray's) that cannot import cannot run
            # either: nothing to rebind there.
            failed.append(f"{modname} ({type(e).__name__}: {e})")
            continue
        mod.MessageQueue = MessageQueue
        if Handle is not None and hasattr(mod, "Handle"):
            mod.Handle = Handle
        done.append(modname)
    return done, failed


def install_message_queue(mode: str = "1") -> list[str]:
    """Rebinds vLLM's ``MessageQueue`` in every module of
    :data:`QUEUE_MODULES` that imports, to pinshm's (mode ``1``) or to the
    chooser of ``auto``; returns those rebound. Raises only if the
    required one (shm_broadcast) cannot be rebound."""
    done, failed = _rebind_queue(QUEUE_MODULES, mode)
    for f in failed:
        logging.getLogger("vllm.plugins.pinshm").debug("pinshm: MessageQueue not rebound in %s", f)
    with _lock:
        rebound["queue"] = done
    return done


def register(module: Optional[ModuleType] = None) -> None:
    """Rebinds vLLM's shared-memory cache classes (in ``module``, default
    :data:`CACHE_MODULE`) and, unless ``PINSHM_VLLM_MESSAGE_QUEUE=0``, its
    MessageQueue (see the module doc). Idempotent: vLLM may load plugins more than once in a
    process. Never raises: vLLM calls plugins unguarded in every command."""
    parts, problems = [], []
    try:
        rebound["cache"] = [_rebind_cache(module)]
        parts.append("the shm multimodal cache (--mm-processor-cache-type shm)")
    except _fit.NotFit as e:
        rebound.pop("cache", None)
        problems.append(str(e))
    except Exception as e:  # noqa: BLE001 - see the docstring
        rebound.pop("cache", None)
        problems.append(f"the shm multimodal cache stays vLLM's: {type(e).__name__}: {e}")
    from .queue._auto import queue_mode  # lazily, as the queue rebinding below imports the queue package

    mode = queue_mode()
    if mode != "0":
        try:
            install_message_queue(mode)
            parts.append("MessageQueue" if mode == "1" else "MessageQueue where vLLM's would not fit /dev/shm (auto)")
        except _fit.NotFit as e:
            rebound.pop("queue", None)
            problems.append(str(e))
        except Exception as e:  # noqa: BLE001
            rebound.pop("queue", None)
            problems.append(f"MessageQueue stays vLLM's: {type(e).__name__}: {e}")
    try:
        connector = _fit.connector_fit(importlib.import_module)
    except Exception as e:  # noqa: BLE001 - a diagnostic: never stops the rest
        connector = None
        logging.getLogger("vllm.plugins.pinshm").debug("pinshm: the connector's fit was not checked: %r", e)
    if connector is not None and not connector.ok:
        problems.append(_fit.not_fit_line(connector, _fit.vllm_version()))
    for p in problems:
        _status.warn("pinshm: %s", p)
    if not parts:
        return
    from .. import __version__

    _status.hold(f"pinshm {__version__} in use: {' and '.join(parts)} on pinshm")
