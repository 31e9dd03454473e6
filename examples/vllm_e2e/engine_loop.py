"""vLLM 0.34's own engine loop over pinshm's queue: the executor's real
``MultiprocExecutor.collective_rpc(non_block=True)`` and the engine core's
real ``EngineCoreProc._wait_for_output``, with forked worker processes
that play vLLM's ``WorkerProc.worker_busy_loop`` (dequeue the RPC, run it,
enqueue the response). Needs vLLM 0.34 (its classes: ../shared/venvs);
never run in CI.

    V/bin/python examples/vllm_e2e/engine_loop.py --mode 1 [--shm-mib 64] [--json OUT]

``--mode`` is ``PINSHM_VLLM_MESSAGE_QUEUE`` (``0``: vLLM's own queue, the
baseline; ``1``: pinshm's; ``auto``). ``--shm-mib`` runs the whole thing
in a private /dev/shm of that size (``unshare -m``, root), as a default
Docker container's 64 MiB, where ``auto`` must pick pinshm's queue.

Each step is what the engine core does: ``collective_rpc`` broadcasts the
step to every worker and returns vLLM's ``FutureWrapper``;
``_wait_for_output`` polls it (``readable()``) and waits in
``spin_until_readable`` while an input thread adds requests, which it
must handle during the step. Every response's bytes are checked. Steps
alternate fast and slow workers (``--work-ms``), and small and large
outputs (the large ones go through the queue's overflow store). Prints
one JSON line: steps, inputs handled during steps, the median step time
and the engine process's CPU seconds per wall second while it waited.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections import deque

MIB = 1 << 20


def output(step: int, size: int) -> bytes:
    return (step.to_bytes(8, "little") * (size // 8 + 1))[:size]


def worker(rank: int, rpc_handle, conn) -> None:
    """vLLM's WorkerProc, reduced to its queues: make the response queue
    (``MessageQueue(1, 1)``), attach the executor's broadcast, then serve."""
    from vllm.v1.executor import multiproc_executor as mpe

    resp = mpe.MessageQueue(1, 1)
    conn.send(resp.export_handle())
    rpc = mpe.MessageQueue.create_from_handle(rpc_handle, rank)
    rpc.wait_until_ready()
    resp.wait_until_ready()
    while True:
        method, args, kwargs, output_rank = rpc.dequeue(indefinite=True)
        if method == "stop":
            break
        step, size, work_s = args
        time.sleep(work_s)
        if output_rank is None or output_rank == rank:
            resp.enqueue((mpe.WorkerProc.ResponseStatus.SUCCESS, (rank, output(step, size))))
    os._exit(0)


class Core:
    """What ``EngineCoreProc._wait_for_output`` reads of its engine core."""

    def __init__(self) -> None:
        self.input_queue: queue.Queue = queue.Queue()
        self._deferred_inputs: deque = deque()
        self.handled: list = []

    def _handle_client_request(self, request_type, request) -> None:
        self.handled.append(request)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["0", "1", "auto"], default="1")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--work-ms", type=float, default=5.0, help="a slow step's worker time")
    ap.add_argument("--large", type=int, default=2 * MIB, help="a large output's bytes")
    ap.add_argument("--shm-mib", type=int, help="run in a private /dev/shm of this size")
    ap.add_argument("--all-reply", action="store_true", help="every rank replies (no unique_reply_rank)")
    ap.add_argument("--json", help="append the result line to this file")
    a = ap.parse_args()
    if a.shm_mib and os.environ.get("ENGINE_LOOP_IN_NS") != "1":
        script = f'mount -t tmpfs -o size={a.shm_mib}m engine-loop /dev/shm && exec "$@"'
        env = dict(os.environ, ENGINE_LOOP_IN_NS="1")
        cmd = ["unshare", "-m", "sh", "-c", script, "sh", sys.executable, *sys.argv]
        sys.exit(subprocess.run(cmd, env=env).returncode)

    os.environ["PINSHM_VLLM_MESSAGE_QUEUE"] = a.mode
    import multiprocessing as mp

    import vllm
    from vllm.v1.engine.core import EngineCoreProc, EngineCoreRequestType
    from vllm.v1.executor import multiproc_executor as mpe

    from pinshm.vllm import plugin

    if a.mode != "0":
        plugin.register()
    ctx = mp.get_context("fork")  # vLLM's default: the executor's queue is built first
    rpc = mpe.MessageQueue(a.tp, a.tp, max_chunk_bytes=16 * MIB)
    kinds = {"rpc": type(rpc).__module__}
    pipes, procs = [], []
    for rank in range(a.tp):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=worker, args=(rank, rpc.export_handle(), child), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    responses = [mpe.MessageQueue.create_from_handle(c.recv(), 0) for c in pipes]
    rpc.wait_until_ready()
    for r in responses:
        r.wait_until_ready()
    kinds["response"] = type(responses[0]).__module__

    ex = mpe.MultiprocExecutor.__new__(mpe.MultiprocExecutor)
    ex.rpc_broadcast_mq, ex.response_mqs, ex.futures_queue, ex.is_failed = rpc, responses, deque(), False
    core = Core()
    feeding = threading.Event()

    def feed(step: int) -> None:
        feeding.wait()
        core.input_queue.put((EngineCoreRequestType.ADD, (f"req-{step}", 0)))

    times, cpu, wall, during = [], 0.0, 0.0, 0
    for step in range(a.steps):
        slow = step % 2 == 1
        size = a.large if step % 5 == 4 else 4096
        work_s = a.work_ms / 1000 if slow else 0.0
        feeder = threading.Thread(target=feed, args=(step,)) if slow else None
        if feeder is not None:
            feeder.start()
        t0, c0 = time.perf_counter(), time.process_time()
        reply = None if a.all_reply else step % a.tp
        fut = ex.collective_rpc("step", args=(step, size, work_s), non_block=True, unique_reply_rank=reply)
        assert hasattr(fut, "poll") and hasattr(fut, "wait_briefly"), "not vLLM 0.34's FutureWrapper"
        feeding.set()
        got = EngineCoreProc._wait_for_output(core, fut)
        t1, c1 = time.perf_counter(), time.process_time()
        feeding.clear()
        if feeder is not None:
            feeder.join()
        want = [(r, output(step, size)) for r in range(a.tp)] if reply is None else (reply, output(step, size))
        assert got == want, f"step {step}: wrong response"
        times.append(t1 - t0)
        cpu += c1 - c0
        wall += t1 - t0
        if slow:
            during += 1
        # What arrived during the step was handled then (or deferred);
        # anything still queued was missed by the wait.
        while not core.input_queue.empty():
            core.input_queue.get_nowait()
    handled_during = len(core.handled) + len(core._deferred_inputs)
    rpc.enqueue(("stop", (), {}, None))
    for p in procs:
        p.join(30)
    result = {
        "vllm": vllm.__version__,
        "mode": a.mode,
        "shm_mib": a.shm_mib,
        "tp": a.tp,
        "all_reply": a.all_reply,
        "queues": kinds,
        "steps": a.steps,
        "ok": all(p.exitcode == 0 for p in procs),
        "inputs": during,
        "inputs_handled": handled_during,
        "step_ms_median": round(statistics.median(times) * 1000, 3),
        "slow_step_ms_median": round(statistics.median(times[1::2]) * 1000, 3),
        "engine_cpu_per_wall": round(cpu / wall, 3),
    }
    line = json.dumps(result)
    print(line)
    if a.json:
        with open(a.json, "a") as f:
            f.write(line + "\n")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
