"""The Python side of the GPU kit (run by run.sh with the machine's own
torch, pinshm from the kit's wheel): a multimodal input to the GPU the way
vLLM's worker does it today (decode a copy, pin_memory() copies it again,
then H2D) against the path from a pinned slot (the slot is the tensor:
pin_memory() returns it, H2D is a DMA from it), and the event-gated
release under a deliberately slow copy, on the current stream and on a
side stream, with the bytes on the device checked. Prints one line per figure and ends with PASS or FAIL."""

import statistics
import sys
import time

import numpy as np
import torch

import pinshm
from pinshm import cuda_release

MIB = 1 << 20
# pixel_values of a large image: float32 [1, 3, 1400, 1400], about 23 MB.
SHAPE = (1, 3, 1400, 1400)
RUNS = 15


def timed(fn):
    ts = []
    out = None
    for _ in range(RUNS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[2:]), out


def main():
    failures = []
    dev = torch.device("cuda")
    x = np.random.default_rng(7).random(SHAPE, dtype=np.float32)
    nbytes = x.nbytes
    store = pinshm.ObjectStore(512 * MIB, 64 * MIB, 1, reserve=True)
    reader = pinshm.StoreReader.attach(store.handle(), 0)
    print(f"reader mapping pinned: {reader.is_pinned}")
    if not reader.is_pinned:
        failures.append("the reader's mapping is not pinned (a cuda build with a driver should pin it)")
    h = store.put_tensor("pixel_values", x)
    expect = torch.from_numpy(x).to(dev)

    def vllm_path():
        # vLLM's MsgpackDecoder copies the tensor out of the buffer, then
        # pin_memory() copies it into torch's pinned cache, then H2D.
        t = torch.from_numpy(np.array(reader.get_tensor(h)))
        return t.pin_memory().to(dev, non_blocking=True)

    def slot_path():
        t = torch.from_dlpack(reader.get_tensor(h))
        p = t.pin_memory()
        return p.to(dev, non_blocking=True), p.data_ptr() == t.data_ptr()

    t_vllm, g = timed(vllm_path)
    ok_vllm = bool(torch.equal(g, expect))
    t_slot, (g, same) = timed(slot_path)
    ok_slot = bool(torch.equal(g, expect))
    print(f"vLLM path (copy, pin_memory copy, H2D): {t_vllm * 1e3:.2f} ms per item, {nbytes / t_vllm / 1e9:.1f} GB/s")
    print(f"pinned slot (no copy, H2D by DMA):      {t_slot * 1e3:.2f} ms per item, {nbytes / t_slot / 1e9:.1f} GB/s")
    print(f"ratio vLLM path / slot path: {t_vllm / t_slot:.2f}; pin_memory() returned the slot itself: {same}")
    if not (ok_vllm and ok_slot):
        failures.append("bytes on the device differ")

    # The event-gated release: the copy from the slot is queued behind a
    # long kernel, and every view is dropped before it runs.
    big = np.full(16 * MIB, 5, dtype=np.uint8)
    hb = store.put_tensor("big", big)
    cuda_release.install()
    try:
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time before the copy
        view = torch.from_dlpack(reader.get_tensor(hb))
        on_dev = view.to(dev, non_blocking=True)
        del view
    finally:
        # Only this read is gated: the fills below release at once.
        cuda_release.uninstall()
    pending = pinshm.flush_releases()
    still = store.is_cached("big")
    # Over a lap of puts, each read at once: none may reuse the slot.
    for i in range(40):
        reader.get(store.put(f"fill{i}", bytes(16 * MIB))).release()
    kept = store.is_cached("big")
    torch.cuda.synchronize()
    left = pinshm.flush_releases()
    good = bool((on_dev == 5).all())
    print(f"gated release: pending after the views went {pending}, slot kept through 40 puts {kept and still}, pending after sync {left}, device bytes right {good}")
    if pending < 1 or not kept or left != 0 or not good:
        failures.append("gated release")

    # The same on a side stream: the copy is queued on `side`, behind a
    # long kernel there, and the last view goes with the default stream
    # current. install(streams=[side]) records the release's event on
    # `side` too, so the slot is kept until that copy is done; the release
    # poller then releases it with no further call on the reader.
    side = torch.cuda.Stream()
    hs = store.put_tensor("side", np.full(16 * MIB, 7, dtype=np.uint8))
    cuda_release.install(streams=[side])
    try:
        view = torch.from_dlpack(reader.get_tensor(hs))
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time on `side`
            on_side = view.to(dev, non_blocking=True)
        del view  # the default stream is current again
    finally:
        cuda_release.uninstall()
    pending_side = pinshm.flush_releases()
    for i in range(40):
        reader.get(store.put(f"side-fill{i}", bytes(16 * MIB))).release()
    kept_side = store.is_cached("side")
    side.synchronize()
    deadline = time.monotonic() + 5
    while pinshm.flush_releases() and time.monotonic() < deadline:
        time.sleep(0.01)
    left_side = pinshm.flush_releases()
    torch.cuda.current_stream().wait_stream(side)
    good_side = bool((on_side == 7).all())
    print(f"gated release, side stream: pending after the views went {pending_side}, slot kept through 40 puts {kept_side}, pending after sync {left_side}, device bytes right {good_side}")
    if pending_side < 1 or not kept_side or left_side != 0 or not good_side:
        failures.append("gated release on a side stream")
    reader.close()
    store.close()
    if failures:
        print("py_pinned: FAIL: " + "; ".join(failures))
        return 1
    print("py_pinned: PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
