"""/dev/shm here, and what pinshm and vLLM will do with it for a plan:
the functions the code itself sizes its queues and caches with."""

from __future__ import annotations

import os
from typing import Optional

from .._node import budget as _budget
from .._node.budget import SHM_PATH, shm_headroom
from ..vllm import facade as vllm
from .report import FAIL, GIB, INFO, MIB, OK, WARN, Check, Plan, _mib


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
    node budget sizes them (:mod:`pinshm._node.budget`), the overflow
    stores and the multimodal cache within the headroom the cache leaves
    (:func:`pinshm.vllm.cache.storage.shm_headroom`): the functions the
    code calls, so the plan is what it will do."""
    queue_mode, vllm_fits, vllm_queue_bytes = vllm.queue_mode, vllm.vllm_fits, vllm.vllm_queue_bytes
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
