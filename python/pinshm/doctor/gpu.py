"""CUDA here (:func:`check_cuda`: the driver, and host registration of one
small region; every doctor run), and ``python -m pinshm doctor --gpu``
(:func:`run`): the GPU kit's checks, from the
installed wheel, on this machine's GPU, in about a minute.

- register (pin) a reserved store's mapping, in the writer and in a reader
  (``pin="require"``);
- host to device from a slot through torch (the slot is the tensor: its
  copy is a DMA from pinned memory), and device to host into a slot
  (:func:`pinshm.device.put_tensor`), every byte checked on the other side;
- each copy timed against the same copy from or into pageable memory
  (medians; the ratio below 1 is the pinned path's gain);
- how long the registration took (bytes, calls of at most 64 GiB,
  seconds), and each GPU's NUMA node beside the nodes of the store's pages
  (``move_pages`` in query mode), with a warning where they differ.

Where there is no torch, no CUDA device, or a build without the ``cuda``
feature, it says so and checks nothing more. Pinning can be switched off
for the vLLM drop-ins with ``PINSHM_VLLM_PIN=0`` if these checks fail.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import Counter
from typing import Any, Callable, Optional

from .. import _pinshm
from .._node import numa as _numa
from .report import FAIL, INFO, MIB, OK, SKIP, WARN, Check

#: The size copied: a large image's pixel values (float32 [3, 1400, 1400]).
SHAPE = (3, 1400, 1400)
RUNS = 15
SWITCH_OFF = "switch pinning off for vLLM with PINSHM_VLLM_PIN=0"


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


def run() -> list[Check]:
    status = _pinshm.cuda_status()
    if not status["feature"]:
        return [Check("gpu", WARN, "this build of pinshm has no cuda feature: nothing is pinned, nothing to check")]
    try:
        import torch
    except ImportError:
        return [Check("gpu", SKIP, "torch is not installed: the GPU checks need it")]
    if not torch.cuda.is_available():
        return [Check("gpu", SKIP, "no CUDA device is visible to torch: the GPU checks did not run")]
    try:
        return _checks(torch)
    except Exception as e:  # noqa: BLE001 - a report, not a crash
        return [Check("gpu", FAIL, f"{type(e).__name__}: {e}; {SWITCH_OFF}")]


def _median_s(torch: Any, fn: Callable[[], Any]) -> float:
    ts = []
    for _ in range(RUNS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[2:])


def _checks(torch: Any) -> list[Check]:
    from .. import ObjectStore, StoreReader
    from ..device import put_tensor

    dev = torch.device("cuda")
    out = [Check("gpu", INFO, f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}")]
    x = torch.rand(SHAPE, dtype=torch.float32)
    nbytes = x.numel() * x.element_size()
    # A cache: its objects owe no reads, so the timed puts reuse its room.
    store = ObjectStore(8 * nbytes, 2 * nbytes, 1, reserve=True, pin="require", cache=True)
    reader = StoreReader.attach(store.handle(), 0, pin="require")
    try:
        out.append(Check("pin", OK if reader.is_pinned else FAIL, f"the reader's mapping pinned: {reader.is_pinned}"))
        out.append(pinning_check(reader.pinning))
        out.append(numa_check(_gpu_nodes(torch), _store_nodes(reader)))
        h = store.put_tensor("x", x.numpy())
        view = torch.from_dlpack(reader.get_tensor(h))
        on_dev = view.to(dev, non_blocking=True)
        torch.cuda.synchronize()
        same = bool(torch.equal(on_dev.cpu(), x))
        out.append(Check("h2d", OK if same else FAIL, f"host to device from a slot: every byte right: {same}"))
        slot_s = _median_s(torch, lambda: view.to(dev, non_blocking=True))
        pageable_s = _median_s(torch, lambda: x.to(dev, non_blocking=True))
        out.append(_timing("h2d", nbytes, slot_s, pageable_s))
        y = torch.rand(SHAPE, dtype=torch.float32, device=dev)
        hy = put_tensor(store, "y", y)
        back = torch.from_dlpack(reader.get_tensor(hy)).clone()
        same = bool(torch.equal(back, y.cpu()))
        out.append(Check("d2h", OK if same else FAIL, f"device to host into a slot: every byte right: {same}"))
        n = [0]

        def d2h_slot() -> None:
            n[0] += 1
            put_tensor(store, f"y{n[0]}", y)

        slot_s = _median_s(torch, d2h_slot)
        pageable_s = _median_s(torch, lambda: y.cpu())
        out.append(_timing("d2h", nbytes, slot_s, pageable_s))
    finally:
        reader.close()
        store.close()
    if any(c.status == FAIL for c in out):
        out.append(Check("gpu", FAIL, SWITCH_OFF))
    return out


def pinning_check(p: Optional[dict[str, Any]]) -> Check:
    """The reader's registration: size, calls and time."""
    if not p:
        return Check("pin", INFO, "the reader's mapping was not registered: no time to report")
    gib = p["bytes"] / (1 << 30)
    per = p["seconds"] / gib if gib else 0.0
    calls = f"{p['chunks']} call" + ("" if p["chunks"] == 1 else "s")
    return Check(
        "pin",
        INFO,
        f"registering {p['bytes'] / MIB:.0f} MiB took {p['seconds']:.3f} s in {calls} ({per:.2f} s per GiB; "
        "every process that maps a store pays this when it attaches)",
    )


def _gpu_nodes(torch: Any) -> dict[int, Optional[int]]:
    """Each visible GPU's NUMA node, None where sysfs does not say."""
    nodes: dict[int, Optional[int]] = {}
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        ids: list[int] = [
            v for k in ("domain", "bus", "device") if (v := getattr(props, f"pci_{k}_id", None)) is not None
        ]
        nodes[i] = _numa.gpu_node(*ids) if len(ids) == 3 else None
    return nodes


def _store_nodes(reader: Any) -> Optional[Counter[int]]:
    """The NUMA nodes of the reader's pages (sampled), None where the kernel
    does not say."""
    try:
        return _numa.page_nodes(*reader.data_region())
    except OSError:
        return None


def numa_check(gpus: dict[int, Optional[int]], pages: Optional[Counter[int]]) -> Check:
    """Where the GPUs and the store's pages are; WARN where a GPU is on
    another node than the pages (its copies cross the sockets' link)."""
    if pages is None or not pages:
        return Check("numa", INFO, "the store's pages' NUMA nodes are unknown (move_pages refused)")
    where = ", ".join(f"node {n}: {c}" for n, c in sorted(pages.items()))
    known = {i: n for i, n in gpus.items() if n is not None}
    if not known:
        return Check("numa", INFO, f"store pages sampled on {where}; the GPUs' NUMA nodes are unknown (sysfs)")
    away = {i: n for i, n in known.items() if n not in pages}
    gpus_at = ", ".join(f"GPU {i} on node {n}" for i, n in sorted(known.items()))
    if away:
        i, n = next(iter(sorted(away.items())))
        return Check(
            "numa",
            WARN,
            f"{gpus_at}; store pages sampled on {where}: GPU {i}'s copies cross to another node "
            f"(a store per node, or the engine bound to node {n} with numactl, keeps them local)",
        )
    return Check("numa", OK, f"{gpus_at}; store pages sampled on {where}")


def _timing(what: str, nbytes: int, slot_s: float, pageable_s: float) -> Check:
    gbs = nbytes / slot_s / 1e9
    return Check(
        what,
        INFO,
        f"{nbytes / MIB:.0f} MiB: {slot_s * 1e3:.2f} ms from the pinned slot ({gbs:.1f} GB/s), "
        f"{pageable_s / slot_s:.2f}x faster than pageable memory ({pageable_s * 1e3:.2f} ms)",
    )
