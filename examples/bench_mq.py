"""Benchmark: pinshm.vllm.queue.MessageQueue against vLLM 0.33.0's MessageQueue
(when vLLM is importable), in the same run, with the same harness.

    python examples/bench_mq.py              # full run (several minutes)
    python examples/bench_mq.py --quick      # about two minutes
    python examples/bench_mq.py --png out.png --json out.json
    python examples/bench_mq.py --replot out.json   # table and plot again

Two modes, each for messages of 1 KiB, 64 KiB, 1 MiB, 8 MiB and 64 MiB and
for 1 and 2 readers:
- back to back: the writer sends the next message as soon as every reader
  has answered the last one;
- cadence: one message every 5 ms (a decode step), the pattern under which
  a spinning reader burns a core between steps.

Latency: the writer stamps CLOCK_MONOTONIC (shared by every process of the
machine) before `enqueue`; each reader stamps it when `dequeue` has
returned the decoded object, and replies through its own response queue
(vLLM's pattern: rpc_broadcast_mq + worker_response_mq), which also paces
the writer: one message in flight. Per message the slowest reader counts;
the table gives the median and p99 over messages (the first tenth warms
up). Payloads are numpy uint8 arrays (1 MiB and more travel out of band in
both queues). Queues use vLLM's defaults: 10 chunks of 24 MiB, so 64 MiB
overflows (vLLM: a ZMQ socket; pinshm: its store).

CPU: user + system time of each process (all threads) over a phase,
divided by the phase's wall time: % of one core. Reader: the busiest
reader. Writer: the writer process, which also reads the replies.

/dev/shm: the allocated bytes (st_blocks) of every /dev/shm file mapped by
the writer process (its queue, the readers' reply queues, and pinshm's
overflow store), unlinked or not, after the 1 KiB phases and at the end.

Idle CPU: a reader that has just read a message waits in `dequeue` for the
next one, which comes after the idle window; it reports the CPU time it
used meanwhile.
"""

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np

KIB, MIB = 1 << 10, 1 << 20
SIZES = [KIB, 64 * KIB, MIB, 8 * MIB, 64 * MIB]
CADENCE_S = 0.005
MODES = ["b2b", "cadence"]
READERS = [1, 2]


def queue_class(impl):
    if impl.startswith("pinshm"):
        from pinshm.vllm.queue import MessageQueue
    else:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    return MessageQueue


def shm_bytes():
    """Allocated bytes of the /dev/shm files this process maps (each once)."""
    seen, total = set(), 0
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/dev/shm/"):
                continue
            try:
                st = os.stat(f"/proc/self/map_files/{parts[0]}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def wait_stats(mq):
    """pinshm's reader counts of how its receives found their messages
    (None for vLLM's queue)."""
    rx = getattr(mq, "_rx", None)
    return dict(rx.wait_stats()) if rx is not None and hasattr(rx, "wait_stats") else None


def reader(impl, handle, rank, handles_out):
    MQ = queue_class(impl)
    rpc = MQ.create_from_handle(handle, rank)
    rpc.wait_until_ready()
    resp = MQ(1, 1)
    handles_out.put((rank, resp.export_handle()))
    resp.wait_until_ready()
    c0 = w0 = 0.0
    s0 = wait_stats(rpc)
    while True:
        before = wait_stats(rpc) if s0 is not None else None
        cmd, t0, _payload = rpc.dequeue(indefinite=True)
        t1 = time.monotonic_ns()
        del _payload
        if cmd == "msg":
            after = wait_stats(rpc) if before is not None else None
            caught = next((k for k in after if after[k] != before[k]), None) if after else None
            resp.enqueue((t1 - t0, caught))
        elif cmd == "begin":
            c0, w0 = time.process_time(), time.monotonic()
            s0 = wait_stats(rpc)
            resp.enqueue(0)
        elif cmd == "end":
            s1 = wait_stats(rpc)
            caught = {k: s1[k] - s0[k] for k in s1} if s0 and s1 else None
            resp.enqueue((time.process_time() - c0, time.monotonic() - w0, caught))
        elif cmd == "idle":
            resp.enqueue(0)
            c0, w0 = time.process_time(), time.monotonic()
            rpc.dequeue(indefinite=True)
            resp.enqueue((time.process_time() - c0, time.monotonic() - w0))
        else:
            resp.enqueue(0)
            break
    time.sleep(0.5)  # let the writer read the last reply before this exits


def phase(rpc, resps, mode, size, n):
    """One mode and size: (latencies in µs, reader CPU %, writer CPU %, how
    pinshm's readers caught their messages (summed; None for vLLM's))."""
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    warm = max(n // 10, 2)
    rpc.enqueue(("begin", 0, None))
    for r in resps:
        r.dequeue()
    c0, w0 = time.process_time(), time.monotonic()
    lat, hows = [], []
    tick = time.monotonic()
    for k in range(n + warm):
        if mode == "cadence":
            tick += CADENCE_S
            delay = tick - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                tick = time.monotonic()  # a message slower than the cadence
        rpc.enqueue(("msg", time.monotonic_ns(), payload))
        one, how = max((r.dequeue() for r in resps), key=lambda x: x[0])
        if k >= warm:
            lat.append(one / 1e3)
            hows.append(how)
    wcpu, wwall = time.process_time() - c0, time.monotonic() - w0
    rpc.enqueue(("end", 0, None))
    ends = [r.dequeue() for r in resps]
    rcpu = max(cpu / wall for cpu, wall, _ in ends)
    caught = [c for _, _, c in ends if c]
    summed = {k: sum(c[k] for c in caught) for k in caught[0]} if caught else None
    if summed:
        # The slowest reader's catch, per message: the latency each way of
        # catching costs (median, µs).
        by = {}
        for one, how in zip(lat, hows):
            by.setdefault(how, []).append(one)
        summed = {"counts": summed, "median_us": {k: statistics.median(v) for k, v in by.items() if k}}
    return lat, 100 * rcpu, 100 * wcpu / wwall, summed


def run(impl, n_readers, iters, idle_s):
    ctx = mp.get_context("spawn")
    MQ = queue_class(impl)
    rpc = MQ(n_readers, n_readers)
    handles = ctx.Queue()
    procs = [ctx.Process(target=reader, args=(impl, rpc.export_handle(), r, handles)) for r in range(n_readers)]
    for p in procs:
        p.start()
    rpc.wait_until_ready()
    got = dict(handles.get(timeout=300) for _ in procs)
    resps = [MQ.create_from_handle(got[r], 0) for r in range(n_readers)]
    for r in resps:
        r.wait_until_ready()
    out = {"phases": {}}
    for size in SIZES:
        for mode in MODES:
            lat, rcpu, wcpu, caught = phase(rpc, resps, mode, size, count(iters[mode], size))
            q = statistics.quantiles(lat, n=100, method="inclusive")
            out["phases"][f"{mode} {size}"] = {
                "median": statistics.median(lat),
                "p99": q[98],
                "reader_cpu": rcpu,
                "writer_cpu": wcpu,
                "n": len(lat),
                "caught": caught,
            }
        if size == KIB:
            out["shm_small"] = shm_bytes()
    out["shm_end"] = shm_bytes()
    if idle_s:
        rpc.enqueue(("idle", 0, None))
        for r in resps:
            r.dequeue()
        time.sleep(idle_s)
        rpc.enqueue(("wake", 0, None))
        out["idle"] = max(r.dequeue() for r in resps)
    rpc.enqueue(("stop", 0, None))
    for r in resps:
        r.dequeue()
    for p in procs:
        p.join(60)
    for q in [rpc, *resps]:
        close = getattr(q, "close", None)
        if close:
            close()
    return out


def count(table, size):
    """Messages for a phase of `size`: the table's entry for the largest
    size not above it (sizes outside the five have no entry of their own)."""
    return table[max((s for s in table if s <= size), default=min(table))]


def vllm_importable():
    try:
        queue_class("vllm")
        return True
    except Exception as e:  # noqa: BLE001 - any failure means "not here"
        print(f"vLLM's MessageQueue is not importable ({e}); pinshm alone", file=sys.stderr)
        return False


def label(size):
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def us(x):
    return f"{x / 1e3:.2f} ms" if x >= 1000 else f"{x:.0f} µs"


def report(res, impls):
    both = "vllm" in impls
    print("\n| mode | message | readers | pinshm median | p99 | vLLM median | p99 | vLLM/pinshm median | p99 "
          "| reader CPU pinshm | vLLM | writer CPU pinshm | vLLM |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in MODES:
        for size in SIZES:
            for n in READERS:
                p = res["pinshm", n]["phases"][f"{mode} {size}"]
                v = res["vllm", n]["phases"][f"{mode} {size}"] if both else None
                row = f"| {mode} | {label(size)} | {n} | {us(p['median'])} | {us(p['p99'])} |"
                if v:
                    row += (f" {us(v['median'])} | {us(v['p99'])} | {v['median'] / p['median']:.2f}× |"
                            f" {v['p99'] / p['p99']:.2f}× |")
                else:
                    row += " | | | |"
                row += f" {p['reader_cpu']:.1f} % | {v['reader_cpu']:.1f} % |" if v else f" {p['reader_cpu']:.1f} % | |"
                row += f" {p['writer_cpu']:.1f} % | {v['writer_cpu']:.1f} % |" if v else f" {p['writer_cpu']:.1f} % | |"
                print(row)
    print()
    for mode in MODES:
        for size in SIZES:
            for n in READERS:
                c = res["pinshm", n]["phases"][f"{mode} {size}"].get("caught")
                if c:
                    print(f"pinshm readers' receives, {mode} {label(size)} x{n}: "
                          + ", ".join(f"{k} {v}" for k, v in c["counts"].items() if v)
                          + "; slowest reader's median by catch: "
                          + ", ".join(f"{k} {us(v)}" for k, v in c["median_us"].items()))
    print()
    if len(impls) > 2 or "pinshm" not in impls:
        compare(res, impls)
    for impl in impls:
        for n in READERS:
            r = res[impl, n]
            if "shm_small" not in r:  # a run without the 1 KiB phases
                continue
            print(f"/dev/shm, {impl}, {n} reader(s): {r['shm_small'] / MIB:.1f} MiB after 1 KiB messages, "
                  f"{r['shm_end'] / MIB:.1f} MiB after 64 MiB ones")
    for impl in impls:
        if "idle" not in res[impl, READERS[0]]:
            continue
        cpu, wall = res[impl, READERS[0]]["idle"]
        print(f"idle reader, {impl}: {cpu * 1e3:.1f} ms CPU in {wall:.2f} s = {1e3 * cpu / wall:.2f} ms per s")


def compare(res, impls):
    """Every implementation against vLLM's (ratios > 1: faster than vLLM's)."""
    base = "vllm" if "vllm" in impls else None
    print("| mode | message | readers | impl | median | p99 | vLLM/impl median | p99 | reader CPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in MODES:
        for size in SIZES:
            for n in READERS:
                for impl in impls:
                    p = res[impl, n]["phases"][f"{mode} {size}"]
                    v = res[base, n]["phases"][f"{mode} {size}"] if base else None
                    ratio = f"{v['median'] / p['median']:.2f}× | {v['p99'] / p['p99']:.2f}×" if v else " | "
                    print(f"| {mode} | {label(size)} | {n} | {impl} | {us(p['median'])} | {us(p['p99'])} | {ratio} "
                          f"| {p['reader_cpu']:.1f} % |")
    print()


def plot(res, impls, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001 - optional
        print(f"(no plot: matplotlib is not importable: {e})", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, mode in zip(axes, MODES):
        for impl in impls:
            for n in READERS:
                ph = res[impl, n]["phases"]
                med = [ph[f"{mode} {s}"]["median"] for s in SIZES]
                p99 = [ph[f"{mode} {s}"]["p99"] for s in SIZES]
                style = "-" if impl.startswith("pinshm") else "--"
                line = ax.plot(SIZES, med, style, marker="o", label=f"{impl}, {n} reader(s), median")[0]
                ax.plot(SIZES, p99, style, color=line.get_color(), alpha=0.35, marker=".",
                        label=f"{impl}, {n} reader(s), p99")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(SIZES, [label(s) for s in SIZES])
        ax.set_title("back to back" if mode == "b2b" else "one message per 5 ms")
        ax.set_xlabel("message size")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("one-way latency (µs)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--idle", type=float, default=None, help="idle window, seconds (default 5; --quick 2)")
    ap.add_argument("--png", default="bench_mq.png", help="where the plot goes")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--impl", choices=["both", "pinshm", "vllm"], default="both")
    ap.add_argument("--sizes", default=None, help="message sizes, e.g. 1K,64K,1M (default: all five)")
    ap.add_argument("--modes", default=None, help="b2b,cadence (default: both)")
    ap.add_argument("--readers", default="1,2", help="reader counts (default 1,2)")
    ap.add_argument("--cadence-n", type=int, default=None, help="messages per cadence phase")
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="only print the table and make the plot from a --json file of an earlier run")
    args = ap.parse_args()
    global SIZES, MODES, READERS
    if args.sizes:
        mult = {"K": KIB, "M": MIB}
        SIZES = [int(x[:-1]) * mult[x[-1].upper()] for x in args.sizes.split(",")]
    if args.modes:
        MODES = args.modes.split(",")
    READERS = [int(x) for x in args.readers.split(",")]
    if args.replot:
        with open(args.replot) as f:
            raw = json.load(f)
        res = {(k.split()[0], int(k.split()[1])): r for k, r in raw.items()}
        READERS = sorted({n for _, n in res})
        impls = list(dict.fromkeys(i for i, _ in res))
        report(res, impls)
        plot(res, impls, args.png)
        return
    if args.quick:
        b2b = {KIB: 300, 64 * KIB: 200, MIB: 100, 8 * MIB: 30, 64 * MIB: 8}
        cad = {KIB: 100, 64 * KIB: 100, MIB: 100, 8 * MIB: 40, 64 * MIB: 8}
    else:
        b2b = {KIB: 2000, 64 * KIB: 1000, MIB: 300, 8 * MIB: 60, 64 * MIB: 15}
        cad = {KIB: 400, 64 * KIB: 400, MIB: 400, 8 * MIB: 100, 64 * MIB: 20}
    if args.cadence_n:
        cad = {k: args.cadence_n for k in cad}
    iters = {"b2b": b2b, "cadence": cad}
    idle_s = args.idle if args.idle is not None else (2.0 if args.quick else 5.0)
    impls = [] if args.impl == "vllm" else ["pinshm"]
    if args.impl != "pinshm" and vllm_importable():
        impls.append("vllm")
    res = {}
    for impl in impls:
        for n in READERS:
            t = time.monotonic()
            res[impl, n] = run(impl, n, iters, idle_s if n == READERS[0] else 0)
            print(f"{impl}, {n} reader(s): done in {time.monotonic() - t:.0f} s", file=sys.stderr)
    report(res, impls)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{i} {n}": r for (i, n), r in res.items()}, f, indent=1)
    plot(res, impls, args.png)


if __name__ == "__main__":
    main()
