"""The encoder cache's copies on a GPU (run by run.sh with the machine's
torch, pinshm from the kit's wheel): an encoder-sized output, bf16
[4096, 4096] (32 MiB), saved device to host and loaded host to device.

Save: `pinshm.device.put_tensor` (D2H straight into a slot of a reserved,
pinned store, completed on an event) against `.cpu()` and then a put of
its bytes (what a connector without pinshm does: a pageable copy, then a
second copy into shared memory), with a D2H into torch's own pinned buffer
for scale. Load: `pinshm.device.get_tensor(reader, h, "cuda")` (H2D from
the pinned slot) against H2D from pageable memory. Every loaded tensor is
compared with the original.

A step with a save in flight: a "step" (a chain of bf16 matmuls, ended by
a sync of the current stream, as vLLM's step ends on its sampled tokens)
timed alone, with a blocking save before it (`put_tensor`, which waits for
the copy), and with a non-blocking save (`put_tensor(..., wait=False)`,
published by pinshm's poller on the copy's event), queued on the current
stream and on a side stream, into the reserved (pinned) store and into a
sparse one (staged through pinned memory). Expected: the side-stream
save's step near the step alone, the blocking save's longer by about a
copy. Every
non-blocking save is checked published with the right bytes. One line per
figure, then PASS or FAIL."""

import statistics
import sys
import time

import torch

import pinshm
import pinshm.device

MIB = 1 << 20
SHAPE = (4096, 4096)
RUNS = 12


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
    x = torch.randn(SHAPE, device=dev).to(torch.bfloat16)
    nbytes = x.numel() * x.element_size()
    # A reserved store is pinned in this process where a driver is found.
    cap = 4 * pinshm.ObjectStore.slot_len(2, nbytes + 4096)
    store = pinshm.ObjectStore(cap, nbytes + 4096, 2, cache=True, key_index=64)
    reader = pinshm.StoreReader.attach(store.handle())
    print(f"store pinned: {reader.is_pinned}; object {nbytes / MIB:.0f} MiB bf16 {list(SHAPE)}")
    n = iter(range(10**6))

    def save_pinshm():
        return pinshm.device.put_tensor(store, f"a{next(n)}", x)

    def save_cpu_then_put():
        host = x.cpu()
        return store.put(f"b{next(n)}", host.view(torch.uint8).numpy())

    pinned = torch.empty(SHAPE, dtype=torch.bfloat16, pin_memory=True)

    def d2h_torch_pinned():
        pinned.copy_(x, non_blocking=True)

    t_pinshm, _ = timed(save_pinshm)
    t_two, _ = timed(save_cpu_then_put)
    t_pinned, _ = timed(d2h_torch_pinned)
    gbps = lambda t: nbytes / t / 1e9  # noqa: E731
    print(f"save pinshm.device.put_tensor (D2H into the slot): {t_pinshm * 1e3:.2f} ms, {gbps(t_pinshm):.1f} GB/s")
    print(f"save .cpu() then put:                             {t_two * 1e3:.2f} ms, {gbps(t_two):.1f} GB/s")
    print(f"D2H into torch's pinned buffer (scale):           {t_pinned * 1e3:.2f} ms, {gbps(t_pinned):.1f} GB/s")
    print(f"save ratio pinshm / (.cpu() + put): {t_pinshm / t_two:.3f}")

    # The store holds 4 objects: the last save timed above was evicted by
    # the .cpu() puts after it (its handle is rightly stale now), so the
    # loads read a save made here.
    h = pinshm.device.put_tensor(store, "load", x)
    t_load, out = timed(lambda: pinshm.device.get_tensor(reader, h, dev))
    if not torch.equal(out, x):
        failures.append("the tensor loaded from the slot differs from the one saved")
    pageable = x.cpu()
    t_pageable, out2 = timed(lambda: pageable.to(dev))
    if not torch.equal(out2, x):
        failures.append("the pageable reference differs")
    print(f"load pinshm.device.get_tensor (H2D from the slot): {t_load * 1e3:.2f} ms, {gbps(t_load):.1f} GB/s")
    print(f"load H2D from pageable memory:                     {t_pageable * 1e3:.2f} ms, {gbps(t_pageable):.1f} GB/s")
    print(f"load ratio pinshm / pageable: {t_load / t_pageable:.3f}")
    if store.free_unused() < 1:
        failures.append("a loaded object was still held after get_tensor returned")
    failures += step_with_a_save_in_flight(store, reader, x)
    reader.close()
    store.close()
    for f in failures:
        print("FAIL:", f)
    print("PASS" if not failures else "FAIL")
    return 1 if failures else 0


STEP_MATMULS = 8


def step_with_a_save_in_flight(store, reader, x):
    """Times a step alone and with a save of `x` in flight (see the module
    doc); returns the failures."""
    failures = []
    dev = x.device
    a = torch.randn(SHAPE, device=dev, dtype=torch.bfloat16) / 64
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    n = iter(range(10**6))
    saves = []

    def gpu_step():
        y = a
        for _ in range(STEP_MATMULS):
            y = y @ a
        main.synchronize()  # the step ends on its results, as vLLM's does
        return y

    def alone():
        gpu_step()

    def blocking_save():
        pinshm.device.put_tensor(store, f"s{next(n)}", x)
        gpu_step()

    def save_on_current_stream():
        saves.append(pinshm.device.put_tensor(store, f"s{next(n)}", x, wait=False))
        gpu_step()

    copy_stream = pinshm.device.copy_stream(dev)
    call_s = []

    def connector_save():
        # The connector's path: pinshm's own stream of the device, after an
        # event on the current stream; the call's host time kept apart.
        t0 = time.perf_counter()
        saves.append(pinshm.device.put_tensor(store, f"s{next(n)}", x, wait=False, stream=copy_stream))
        call_s.append(time.perf_counter() - t0)
        gpu_step()

    def save_on_side_stream(into=store):
        side.wait_stream(main)  # x is written on the current stream
        with torch.cuda.stream(side):
            saves.append(pinshm.device.put_tensor(into, f"s{next(n)}", x, wait=False))
        gpu_step()

    # The connector's default: a sparse store, never pinned, so the save
    # is staged through pinned memory and copied into the slot on completion.
    sparse = pinshm.ObjectStore(
        4 * pinshm.ObjectStore.slot_len(1, x.numel() * x.element_size() + 4096),
        x.numel() * x.element_size() + 4096,
        1,
        cache=True,
        reserve=False,
    )

    def timed_steps(fn):
        ts = []
        for _ in range(RUNS):
            torch.cuda.synchronize()
            for st in (store, sparse):
                st.flush_pending(timeout=30)  # no save of a run before is in flight
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        for st in (store, sparse):
            st.flush_pending(timeout=30)
        return statistics.median(ts[2:])

    t_alone = timed_steps(alone)
    t_block = timed_steps(blocking_save)
    t_current = timed_steps(save_on_current_stream)
    t_side = timed_steps(save_on_side_stream)
    t_sparse = timed_steps(lambda: save_on_side_stream(sparse))
    t_conn = timed_steps(connector_save)
    t_call = statistics.median(call_s[2:])
    ms = lambda t: t * 1e3  # noqa: E731
    print(f"step alone ({STEP_MATMULS} bf16 matmuls {list(SHAPE)}):       {ms(t_alone):.2f} ms")
    print(f"step after a blocking save (wait=True):          {ms(t_block):.2f} ms, {t_block / t_alone:.2f}x alone")
    print(f"step with a save in flight, current stream:      {ms(t_current):.2f} ms, {t_current / t_alone:.2f}x alone")
    print(f"step with a save in flight, side stream:         {ms(t_side):.2f} ms, {t_side / t_alone:.2f}x alone")
    print(f"the same into a sparse store (staged):           {ms(t_sparse):.2f} ms, {t_sparse / t_alone:.2f}x alone")
    print(f"the connector's save (copy_stream) in flight:    {ms(t_conn):.2f} ms, {t_conn / t_alone:.2f}x alone")
    print(f"  of which the save call's host time:            {ms(t_call):.3f} ms ({t_call / t_alone:.2f}x the step)")
    print(f"  target <= 1.05x alone: {'met' if t_conn <= 1.05 * t_alone else 'NOT met'}")
    if store.flush_pending(timeout=30) or sparse.flush_pending(timeout=30):
        failures.append("non-blocking saves still pending 30 s after their steps")
    bad = [s.key for s in saves if s.state != "published"]
    if bad:
        failures.append(f"non-blocking saves not published: {bad[:4]} ({len(bad)} of {len(saves)})")
    last = saves[-1].handle if saves else None  # the sparse store's
    if last is None or sparse.lookup(saves[-1].key) != last:
        failures.append("the last non-blocking save is not the key's object")
    else:
        sparse_reader = pinshm.StoreReader.attach(sparse.handle())
        if not torch.equal(pinshm.device.get_tensor(sparse_reader, last, dev), x):
            failures.append("a staged non-blocking save's bytes differ from the tensor saved")
        sparse_reader.close()
    last_pinned = next((s for s in reversed(saves) if store.lookup(s.key) == s.handle), None)
    if last_pinned is None or not torch.equal(pinshm.device.get_tensor(reader, last_pinned.handle, dev), x):
        failures.append("a non-blocking save's bytes differ from the tensor saved")
    sparse.close()
    return failures


if __name__ == "__main__":
    sys.exit(main())
