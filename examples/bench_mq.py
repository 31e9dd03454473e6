"""Benchmark: pinshm.vllm.MessageQueue against vLLM 0.33.0's MessageQueue
(when vLLM is importable), in the same run, with the same harness.

    python examples/bench_mq.py            # full run (about a minute or two)
    python examples/bench_mq.py --quick    # fewer iterations, 2 s idle window

Latency: the writer stamps CLOCK_MONOTONIC (shared by every process of the
machine) before `enqueue`; each reader stamps it when `dequeue` has
returned the decoded object, and replies through its own response queue
(vLLM's pattern: rpc_broadcast_mq + worker_response_mq), which also paces
the writer: one message in flight. The figure is the median over messages
of the slowest reader's one-way latency. Payloads are numpy uint8 arrays
(1 MiB and more travel out of band). Queues use vLLM's defaults: 10 chunks
of 24 MiB, so 64 MiB overflows (vLLM: a ZMQ socket; pinshm: its store).

Idle CPU: a reader that has just read a message waits in `dequeue` for the
next one, which comes after the idle window; the reader reports the CPU
time (user + system, all threads) it used meanwhile.

Local ZMQ: each pinshm reader reports whether pyzmq was ever imported in
its process (it never imports vLLM).
"""

import argparse
import multiprocessing as mp
import statistics
import sys
import time

import numpy as np

KIB, MIB = 1 << 10, 1 << 20
SIZES = [KIB, MIB, 64 * MIB]


def queue_class(impl):
    if impl == "pinshm":
        from pinshm.vllm.message_queue import MessageQueue
    else:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    return MessageQueue


def reader(impl, handle, rank, handles_out):
    MQ = queue_class(impl)
    rpc = MQ.create_from_handle(handle, rank)
    rpc.wait_until_ready()
    resp = MQ(1, 1)
    handles_out.put((rank, resp.export_handle()))
    resp.wait_until_ready()
    while True:
        cmd, t0, _payload = rpc.dequeue(indefinite=True)
        t1 = time.monotonic_ns()
        if cmd == "msg":
            resp.enqueue(t1 - t0)
        elif cmd == "idle":
            resp.enqueue(0)
            c0, w0 = time.process_time(), time.monotonic()
            rpc.dequeue(indefinite=True)
            c1, w1 = time.process_time(), time.monotonic()
            resp.enqueue((c1 - c0, w1 - w0))
        else:
            resp.enqueue("zmq" in sys.modules)
            break
    time.sleep(0.5)  # let the writer read the last reply before this exits


def run(impl, n_readers, iters, idle_s):
    ctx = mp.get_context("spawn")
    MQ = queue_class(impl)
    rpc = MQ(n_readers, n_readers)
    handles = ctx.Queue()
    procs = [ctx.Process(target=reader, args=(impl, rpc.export_handle(), r, handles)) for r in range(n_readers)]
    for p in procs:
        p.start()
    rpc.wait_until_ready()
    got = dict(handles.get(timeout=120) for _ in procs)
    resps = [MQ.create_from_handle(got[r], 0) for r in range(n_readers)]
    for r in resps:
        r.wait_until_ready()
    out = {}
    for size in SIZES:
        payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        n = iters[size]
        lat = []
        for k in range(n + max(n // 10, 2)):  # the first tenth warms up
            rpc.enqueue(("msg", time.monotonic_ns(), payload))
            one = max(r.dequeue() for r in resps)
            if k >= max(n // 10, 2):
                lat.append(one / 1e3)
        out[size] = statistics.median(lat)
    idle = None
    if idle_s:
        rpc.enqueue(("idle", 0, None))
        for r in resps:
            r.dequeue()
        time.sleep(idle_s)
        rpc.enqueue(("wake", 0, None))
        idle = max(r.dequeue() for r in resps)
    rpc.enqueue(("stop", 0, None))
    zmq_loaded = any(r.dequeue() for r in resps)
    for p in procs:
        p.join(60)
    for q in [rpc, *resps]:
        close = getattr(q, "close", None)
        if close:
            close()
    return out, idle, zmq_loaded


def vllm_importable():
    try:
        queue_class("vllm")
        return True
    except Exception as e:  # noqa: BLE001 - any failure means "not here"
        print(f"vLLM's MessageQueue is not importable ({e}); pinshm alone", file=sys.stderr)
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--idle", type=float, default=None, help="idle window, seconds (default 5; --quick 2)")
    args = ap.parse_args()
    iters = {KIB: 300, MIB: 60, 64 * MIB: 6} if args.quick else {KIB: 2000, MIB: 200, 64 * MIB: 20}
    idle_s = args.idle if args.idle is not None else (2.0 if args.quick else 5.0)
    impls = ["pinshm"] + (["vllm"] if vllm_importable() else [])
    res = {}
    for impl in impls:
        for n in (1, 2):
            res[impl, n] = run(impl, n, iters, idle_s if n == 1 else 0)
            print(f"{impl}, {n} reader(s): done", file=sys.stderr)
    print("\n| message | readers | pinshm (µs) | " + ("vLLM 0.33.0 (µs) | vLLM / pinshm |" if "vllm" in impls else ""))
    print("|---|---|---|" + ("---|---|" if "vllm" in impls else ""))
    for size in SIZES:
        label = f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"
        for n in (1, 2):
            p = res["pinshm", n][0][size]
            row = f"| {label} | {n} | {p:.1f} |"
            if "vllm" in impls:
                v = res["vllm", n][0][size]
                row += f" {v:.1f} | {v / p:.1f}× |"
            print(row)
    print()
    for impl in impls:
        cpu, wall = res[impl, 1][1]
        print(f"idle reader, {impl}: {cpu * 1e3:.1f} ms CPU in {wall:.2f} s = {100 * cpu / wall:.2f} % of a core")
    print(f"pinshm readers imported pyzmq: {any(res['pinshm', n][2] for n in (1, 2))}")


if __name__ == "__main__":
    main()
