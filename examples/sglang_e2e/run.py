#!/usr/bin/env python3
"""SGLang end to end, stock against the pinshm plugin, as a user judges it:
a real SGLang 0.5.23 server on CPU (the tiny Qwen2-VL of build_model.py),
fresh for each round, stock and pinshm alternating (stock first in even
rounds, pinshm first in odd ones).

Each server, from its start (``stock``: ``PINSHM_SGLANG=0``; ``pinshm``:
the plugin, loaded by SGLang's entry point):

- ``cold``: its first ``--cold`` requests, one at a time, each a new image;
- ``warm_distinct`` / ``warm_repeat``: ``--n`` more, one at a time, new
  images / two images it has seen;
- ``burst_distinct`` / ``burst_repeat``: ``--burst`` requests from
  ``--clients`` threads, new images / four it has seen: requests/s;
- ``large``: ``--large`` requests of ``--large-images`` new images each
  (features of 14 MiB at 48), from ``--clients`` threads.

Every request streams: time to first token and end to end, p50 and p99 of
each phase; output ids (greedy) are compared with stock's of the same
round, image for image (each round's images are the same for both). An
inotify watch on /dev/shm counts the segments made (SGLang's
``sgl_shm_mm_*``, pinshm's ``pinshm_sgl_*``); after the server stops (or
``--kill``: a SIGKILL of all of it mid-burst), what of it is left.

Deployments: ``--dp 2`` (two schedulers, SGLang's DP controller),
``--tokenizer-workers 2`` (HTTP tokenizer workers), ``--msgpack``
(``SGLANG_USE_PICKLE_IPC=0``), ``--pid1`` (the server is PID 1 of its own
PID namespace, as a container's engine; needs root), ``--shm-mib 64`` (a
private /dev/shm of that size; root). Writes RESULTS.json and RESULTS.md to
``--out``.

    VENV/bin/python examples/sglang_e2e/run.py --python VENV/bin/python \\
        --model MODEL --out OUT [--tp 1,2] [--rounds 5] [--shm-mib 64] [--kill] ...
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shm_watch import PREFIXES, ShmWatch

PAD = "<|vision_start|><|image_pad|><|vision_end|>"



def prompt(images: int) -> str:
    return f"<|im_start|>user\n{PAD * images}Describe this image.<|im_end|>\n<|im_start|>assistant\n"


def image(seed: int) -> str:
    """A deterministic 84x112 noise PNG (as build_model.py's) as a data URL."""
    import numpy as np
    from PIL import Image

    a = np.random.default_rng(seed).integers(0, 256, size=(84, 112, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def post(port: int, images: list[str], timeout: float = 600) -> dict[str, Any]:
    """One streamed /generate: ttft_s, latency_s, ids."""
    body = {
        "text": prompt(len(images)),
        "image_data": images[0] if len(images) == 1 else images,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        "stream": True,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first, last = None, None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - t0
            last = json.loads(line[5:])
    if last is None:
        raise RuntimeError("no streamed chunk")
    return {"ttft_s": first or 0.0, "latency_s": time.perf_counter() - t0, "ids": last.get("output_ids")}


def start(a: argparse.Namespace, tp: int, config: str, log: str) -> subprocess.Popen:
    cmd = [a.python, "-m", "sglang.launch_server", "--model-path", a.model, "--device", "cpu"]
    cmd += ["--attention-backend", "torch_native", "--dtype", "float32", "--tp", str(tp)]
    cmd += ["--disable-cuda-graph", "--skip-server-warmup", "--port", str(a.port)]
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", PINSHM_SGLANG="1" if config == "pinshm" else "0")
    ranks = tp * a.dp
    if a.dp > 1:
        cmd += ["--dp-size", str(a.dp)]
    if a.tokenizer_workers > 1:
        cmd += ["--tokenizer-worker-num", str(a.tokenizer_workers)]
    if a.msgpack:
        env["SGLANG_USE_PICKLE_IPC"] = "0"
    # A rank would size its KV cache from all free memory (and, beside
    # another server still exiting, meet the OOM killer).
    cmd += ["--max-total-tokens", "16384"]
    if ranks > 1:
        cpus = os.cpu_count() or 1
        env.update(SGLANG_CPU_OMP_THREADS_BIND="|".join(str(i % cpus) for i in range(ranks)))
        env.update(SGLANG_NCCL_SO_PATH="/nonexistent")
    # PID 1 of a new PID namespace (with its own /proc, which SGLang's
    # psutil reads), as a container's engine.
    prefix = ["unshare", "-p", "-f", "--kill-child", "--mount-proc"] if a.pid1 else []
    out = open(log, "w")
    return subprocess.Popen(prefix + cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def healthy(port: int, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.time() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not come up")


def _group(pgid: int) -> list[int]:
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(p))
        except (OSError, IndexError, ValueError):
            pass
    return out


def stop(proc: subprocess.Popen, kill: bool, pid1: bool) -> None:
    """SIGTERM (SGLang's shutdown) or SIGKILL of every process of the
    server; with --pid1 a SIGKILL goes to PID 1 alone, and the kernel
    kills the rest of its namespace, as a container runtime's does."""
    try:
        if kill and pid1:
            kids = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
            os.kill(int(kids[0]), signal.SIGKILL)
        else:
            os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
    except (ProcessLookupError, OSError, IndexError):
        pass
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    deadline = time.time() + 60  # the rest of the group
    while time.time() < deadline and _group(proc.pid):
        time.sleep(0.5)
    for pid in _group(proc.pid):
        os.kill(pid, signal.SIGKILL)


def sequential(port: int, reqs: list[tuple[str, list[str]]], watch: ShmWatch) -> list[dict[str, Any]]:
    out = []
    for tag, imgs in reqs:
        t0 = time.time()
        r = post(port, imgs)
        time.sleep(0.05)  # the last inotify events land
        out.append(dict(r, tag=tag, segments=watch.between(t0, time.time())))
    return out


def burst(port: int, reqs: list[tuple[str, list[str]]], clients: int, kill=None) -> dict[str, Any]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        futures = [(tag, ex.submit(post, port, imgs)) for tag, imgs in reqs]
        if kill is not None:
            kill()
        done = []
        for tag, f in futures:
            try:
                done.append(dict(f.result(), tag=tag))
            except Exception as e:  # noqa: BLE001 - a killed server's requests fail
                done.append({"tag": tag, "error": f"{type(e).__name__}: {e}"})
    wall = time.perf_counter() - t0
    ok = [d for d in done if "error" not in d]
    return {"requests": len(reqs), "ok": len(ok), "wall_s": wall, "requests_per_s": len(ok) / wall, "done": done}


def store_puts() -> dict[str, Any]:
    """The pinshm stores of the server: objects put, as ids handed out
    (a store already unlinked, all its ranks attached, is not seen)."""
    import pinshm

    names = [n for n in os.listdir("/dev/shm") if n.startswith("pinshm_sgl_")]
    return {"stores": len(names), "puts": sum(pinshm.inspect_segment(n).next_id - 1 for n in names)}


def one(a: argparse.Namespace, tp: int, config: str, rnd: int, watch: ShmWatch) -> dict[str, Any]:
    log = os.path.join(a.out, f"server-tp{tp}-{config}-r{rnd}.log")
    before = set(os.listdir("/dev/shm"))
    t_start = time.time()
    proc = start(a, tp, config, log)
    row: dict[str, Any] = {"tp": tp, "config": config, "round": rnd, "phases": {}}
    seed = 1000 * (rnd + 1)
    new = [image(seed + i) for i in range(a.cold + a.n + a.burst)]
    seen = new[:4]  # the burst of seen images: d0..d3 (sent in the cold phase)
    try:
        row["startup_s"] = round(healthy(a.port, proc, a.startup_timeout), 1)
        ph = row["phases"]
        ph["cold"] = sequential(a.port, [(f"d{i}", [new[i]]) for i in range(a.cold)], watch)
        base = a.cold
        ph["warm_distinct"] = sequential(a.port, [(f"d{base + i}", [new[base + i]]) for i in range(a.n)], watch)
        ph["warm_repeat"] = sequential(a.port, [(f"d{i % 2}", [new[i % 2]]) for i in range(a.n)], watch)
        base += a.n
        kill = None
        if a.kill:

            def kill() -> None:
                time.sleep(a.kill_after)
                stop(proc, kill=True, pid1=a.pid1)
                row["killed_after_s"] = a.kill_after

        ph["burst_distinct"] = burst(
            a.port, [(f"d{base + i}", [new[base + i]]) for i in range(a.burst)], a.clients, kill
        )
        if not a.kill:
            ph["burst_repeat"] = burst(a.port, [(f"d{i % 4}", [seen[i % 4]]) for i in range(a.burst)], a.clients)
            if a.large:
                big = [[image(seed + 500 + 97 * j + i) for i in range(a.large_images)] for j in range(a.large)]
                ph["large"] = burst(a.port, [(f"L{j}", big[j]) for j in range(a.large)], a.clients)
            if config == "pinshm":
                row["store"] = store_puts()
    except Exception as e:  # noqa: BLE001 - recorded, the next runs
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        if proc.poll() is None or _group(proc.pid):
            stop(proc, kill=False, pid1=a.pid1)
    row["segments"] = watch.between(t_start, time.time())
    time.sleep(a.settle)  # a reaper removes a dead writer's store
    left = sorted(set(os.listdir("/dev/shm")) - before)
    row["left_in_dev_shm"] = [n for n in left if n.startswith(PREFIXES)]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", required=True, help="the SGLang venv's python (setup_venv.sh)")
    ap.add_argument("--model", required=True, help="build_model.py's directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--configs", default="stock,pinshm")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cold", type=int, default=8, help="first requests of a server, each a new image")
    ap.add_argument("--n", type=int, default=8, help="sequential warm requests per kind")
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--large", type=int, default=8, help="requests of many images (0: none)")
    ap.add_argument("--large-images", type=int, default=48)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--tokenizer-workers", type=int, default=1)
    ap.add_argument("--msgpack", action="store_true", help="SGLANG_USE_PICKLE_IPC=0")
    ap.add_argument("--pid1", action="store_true", help="the server is PID 1 of a PID namespace (root)")
    ap.add_argument("--kill", action="store_true", help="SIGKILL the server mid-burst")
    ap.add_argument("--kill-after", type=float, default=2.0)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--shm-mib", type=int, help="run in a mount namespace with a /dev/shm this big")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.shm_mib and os.environ.get("PINSHM_E2E_NS") != "1":
        inner = [sys.executable, *sys.argv]
        sh = f'mount -t tmpfs -o size={a.shm_mib}m tmpfs /dev/shm && exec "$@"'
        env = dict(os.environ, PINSHM_E2E_NS="1")
        return subprocess.call(["unshare", "-m", "sh", "-c", sh, "sh", *inner], env=env)
    watch = ShmWatch()
    watch.start()
    rows = []
    configs = a.configs.split(",")
    for rnd in range(a.rounds):
        for tp in (int(t) for t in a.tp.split(",")):
            for config in configs if rnd % 2 == 0 else configs[::-1]:
                print(f"== round {rnd} TP={tp} {config}", flush=True)
                rows.append(one(a, tp, config, rnd, watch))
                r = rows[-1]
                print(json.dumps({k: r.get(k) for k in ("startup_s", "error", "segments", "left_in_dev_shm")}))
    meta = {"argv": sys.argv[1:], "shm_mib": a.shm_mib, "cpus": os.cpu_count(), "load": os.getloadavg()}
    with open(os.path.join(a.out, "RESULTS.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    from summary import table

    md = table(rows)
    with open(os.path.join(a.out, "RESULTS.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
