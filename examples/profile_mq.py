"""Where the microseconds of pinshm.vllm.queue.MessageQueue go at a decode
cadence: one writer, one reader process, one message every 5 ms, each
phase stamped with CLOCK_MONOTONIC (shared by the processes):

    pickle   writer: enqueue entered -> the message encoded
    send     writer: encoded -> the channel's send returned
    deliver  encoded -> the reader's wait returned the message's view
    decode   reader: view -> object unpickled
    total    enqueue entered -> object unpickled

with the reader's default wait. The stamps wrap the queue's own
functions; nothing else changes.

    python examples/profile_mq.py [--sizes 1K,1M] [--n 300]
"""

import argparse
import multiprocessing as mp
import statistics
import time

import numpy as np

CADENCE_S = 0.005


def _reader(handle, n, out):
    from pinshm.vllm.queue import _encoding as enc
    from pinshm.vllm.queue import _overflow as ov
    from pinshm.vllm.queue import MessageQueue

    stamps = []
    recv_view = MessageQueue._recv_view
    loads_inline = enc.loads_inline

    def timed_recv_view(self, *a):
        v = recv_view(self, *a)
        stamps.append([time.monotonic_ns()])
        return v

    def timed_loads_inline(data, *a, **k):
        obj = loads_inline(data, *a, **k)
        stamps[-1].append(time.monotonic_ns())
        return obj

    MessageQueue._recv_view = timed_recv_view
    enc.loads_inline = timed_loads_inline
    # A message beyond a slot is decoded by the overflow reader, from the store.
    ov.loads_inline = timed_loads_inline
    mq = MessageQueue.create_from_handle(handle, 0)
    mq.wait_until_ready()
    stamps.clear()
    try:
        for _ in range(n):
            mq.dequeue(timeout=60)
    finally:
        mq.close()
    out.put(stamps)


def run(size, n):
    from pinshm.vllm.queue import _encoding as enc
    from pinshm.vllm.queue import MessageQueue

    ctx = mp.get_context("spawn")
    mq = MessageQueue(1, 1, max_chunk_bytes=24 << 20, max_chunks=10)
    out = ctx.Queue()
    p = ctx.Process(target=_reader, args=(mq.export_handle(), n, out))
    p.start()
    mq.wait_until_ready()
    dumps = enc.dumps
    w = []

    def timed_dumps(obj, *a):
        bufs = dumps(obj, *a)
        w[-1].append(time.monotonic_ns())
        return bufs

    enc.dumps = timed_dumps
    payload = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    try:
        for _ in range(n):
            time.sleep(CADENCE_S)
            w.append([time.monotonic_ns()])
            mq.enqueue(payload)
            w[-1].append(time.monotonic_ns())
        r = out.get(timeout=120)
    finally:
        enc.dumps = dumps
        p.join(60)
        mq.close()
    skip = n // 10  # warm-up
    phases = {"pickle": [], "send": [], "deliver": [], "decode": [], "total": []}
    for (t0, t1, t2), (t3, t4) in list(zip(w, r))[skip:]:
        phases["pickle"].append(t1 - t0)
        phases["send"].append(t2 - t1)
        phases["deliver"].append(t3 - t1)
        phases["decode"].append(t4 - t3)
        phases["total"].append(t4 - t0)
    return {k: statistics.median(v) / 1e3 for k, v in phases.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1K,1M")
    ap.add_argument("--n", type=int, default=300)
    args = ap.parse_args()
    sizes = [int(s[:-1]) << (10 if s[-1] == "K" else 20) for s in args.sizes.split(",")]
    print("| message | reader wait | pickle | send | deliver | decode | total |")
    print("|---|---|---|---|---|---|---|")
    for size in sizes:
        m = run(size, args.n)
        label = f"{size >> 10} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
        cells = " | ".join(f"{m[k]:.0f} µs" for k in ("pickle", "send", "deliver", "decode", "total"))
        print(f"| {label} | default | {cells} |", flush=True)


if __name__ == "__main__":
    main()
