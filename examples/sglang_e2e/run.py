#!/usr/bin/env python3
"""SGLang end to end, stock against the pinshm plugin: a real SGLang 0.5.23
server on CPU (the tiny Qwen2-VL of build_model.py), TP=1 and TP=2.

For each TP and configuration (``stock``: ``PINSHM_SGLANG=0``; ``pinshm``:
the plugin, loaded by SGLang's entry point), one server:

- a sequential pass of ``--n`` requests over distinct and repeated images:
  output ids (greedy), end-to-end latency, time to first token (streamed),
  and the /dev/shm segments each request made (inotify on /dev/shm:
  SGLang's ``sgl_shm_mm_*``, pinshm's ``pinshm_sgl_*``);
- a burst of ``--burst`` requests from ``--clients`` threads: requests/s;
- the pinshm store: features put (its ids handed out) and so served from
  it (features sent minus puts);
- shutdown (SIGTERM), or with ``--kill`` a SIGKILL of the whole server
  mid-burst; then what is left in /dev/shm of that server.

``--shm-mib 64`` runs it all inside a mount namespace whose /dev/shm is a
64 MiB tmpfs (root: ``unshare -m``). Writes RESULTS.json and a Markdown
table to ``--out``.

    VENV/bin/python examples/sglang_e2e/run.py --python VENV/bin/python \\
        --model MODEL --out OUT [--tp 1,2] [--configs stock,pinshm] [--kill] [--shm-mib 64]
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import ctypes.util
import json
import os
import select
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

PROMPT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
    "Describe this image.<|im_end|>\n<|im_start|>assistant\n"
)
PATTERN = [0, 1, 0, 2, 1, 3, 2, 3]  # distinct and repeated images
PREFIXES = ("sgl_shm_mm_", "pinshm_sgl_")


class ShmWatch(threading.Thread):
    """Every segment created in /dev/shm under PREFIXES (inotify: exact,
    where a poll misses segments that live a millisecond)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, b"/dev/shm", 0x100) < 0:  # IN_CREATE
            raise OSError(ctypes.get_errno(), "inotify")
        self.created: list[tuple[float, str]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if not select.select([self.fd], [], [], 0.05)[0]:
                continue
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                continue
            now, i = time.time(), 0
            while i + 16 <= len(buf):
                ln = struct.unpack_from("iIII", buf, i)[3]
                name = buf[i + 16 : i + 16 + ln].rstrip(b"\0").decode(errors="replace")
                i += 16 + ln
                if name.startswith(PREFIXES):
                    with self.lock:
                        self.created.append((now, name))

    def between(self, t0: float, t1: float) -> dict[str, int]:
        with self.lock:
            names = [n for t, n in self.created if t0 <= t <= t1]
        return {p: sum(n.startswith(p) for n in names) for p in PREFIXES}


def post(port: int, payload: dict[str, Any], timeout: float = 600) -> tuple[dict[str, Any], float, float]:
    """(the response, seconds to the first streamed chunk, seconds in all)."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate", json.dumps(payload).encode(), {"Content-Type": "application/json"}
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
    return last, first or 0.0, time.perf_counter() - t0


def payload(image: str, stream: bool = True) -> dict[str, Any]:
    return {
        "text": PROMPT,
        "image_data": image,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        "stream": stream,
    }


def start(a: argparse.Namespace, tp: int, config: str, log: str) -> subprocess.Popen:
    cmd = [
        a.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        a.model,
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--dtype",
        "float32",
        "--tp",
        str(tp),
        "--disable-cuda-graph",
        "--skip-server-warmup",
        "--port",
        str(a.port),
    ]
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", PINSHM_SGLANG="1" if config == "pinshm" else "0")
    if tp > 1:
        # Each rank would size its KV cache from all free memory.
        cmd += ["--max-total-tokens", "16384"]
        env.update(SGLANG_CPU_OMP_THREADS_BIND="0|1", SGLANG_NCCL_SO_PATH="/nonexistent")
    return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


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
        time.sleep(1)
    raise RuntimeError("the server did not come up")


def stop(proc: subprocess.Popen, kill: bool) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    deadline = time.time() + 60  # the rest of the group (schedulers, reapers of their own session)
    while time.time() < deadline and _group(proc.pid):
        time.sleep(0.5)
    for pid in _group(proc.pid):
        os.kill(pid, signal.SIGKILL)


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


def store_counts() -> dict[str, Any]:
    """The pinshm store of the server (the newest pinshm_sgl_*): objects
    put, as ids handed out."""
    import pinshm

    names = sorted(
        (n for n in os.listdir("/dev/shm") if n.startswith("pinshm_sgl_")),
        key=lambda n: os.stat(f"/dev/shm/{n}").st_mtime,
    )
    if not names:
        return {"store": None, "puts": 0}
    snap = pinshm.inspect_segment(names[-1])
    return {"store": names[-1], "puts": snap.next_id - 1}


def one(a: argparse.Namespace, tp: int, config: str, watch: ShmWatch, images: list[str]) -> dict[str, Any]:
    log = os.path.join(a.out, f"server-tp{tp}-{config}.log")
    before = set(os.listdir("/dev/shm"))
    proc = start(a, tp, config, log)
    row: dict[str, Any] = {"tp": tp, "config": config}
    try:
        row["startup_s"] = round(healthy(a.port, proc, a.startup_timeout), 1)
        seq = []
        for i in range(a.n):
            k = PATTERN[i % len(PATTERN)] % len(images)
            t0 = time.time()
            out, ttft, total = post(a.port, payload(images[k]))
            time.sleep(0.2)  # the last inotify events land
            seq.append(
                {
                    "image": k,
                    "ids": out.get("output_ids"),
                    "ttft_s": ttft,
                    "latency_s": total,
                    "segments": watch.between(t0, time.time()),
                }
            )
        row["sequential"] = seq
        burst = [images[PATTERN[i % len(PATTERN)] % len(images)] for i in range(a.burst)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(a.clients) as ex:
            futures = [ex.submit(post, a.port, payload(im)) for im in burst]
            if a.kill:
                time.sleep(a.kill_after)
                stop(proc, kill=True)
                row["killed_after_s"] = a.kill_after
            done = []
            for f in futures:
                try:
                    done.append(f.result())
                except Exception as e:  # noqa: BLE001 - a killed server's requests fail
                    done.append(e)
        wall = time.perf_counter() - t0
        ok = [d for d in done if not isinstance(d, Exception)]
        row["burst"] = {
            "requests": len(burst),
            "ok": len(ok),
            "wall_s": wall,
            "requests_per_s": len(ok) / wall if wall else 0.0,
            "ttft_median_s": statistics.median(d[1] for d in ok) if ok else None,
        }
        if config == "pinshm" and not a.kill:
            row["store"] = store_counts()
    finally:
        if proc.poll() is None or _group(proc.pid):
            stop(proc, kill=False)
    time.sleep(a.settle)  # a reaper removes a dead writer's store
    left = sorted(set(os.listdir("/dev/shm")) - before)
    row["left_in_dev_shm"] = [n for n in left if n.startswith(PREFIXES)]
    row["left_other"] = [n for n in left if not n.startswith(PREFIXES)]
    return row


def summary(rows: list[dict[str, Any]]) -> str:
    stock = {r["tp"]: r for r in rows if r["config"] == "stock" and "sequential" in r}
    ref = next(iter(stock.values()), None)
    out = [
        "| TP | config | tokens = stock | sgl_shm_mm segments / request | pinshm segments made | "
        "features put / sent | TTFT median (ms) | latency median (ms) | burst requests/s | left in /dev/shm |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        seq = r.get("sequential", [])
        same = "n/a"
        if ref is not None and seq:
            want = {s["image"]: s["ids"] for s in ref["sequential"]}
            same = "yes" if all(s["ids"] == want.get(s["image"]) for s in seq) else "NO"
        per = [s["segments"]["sgl_shm_mm_"] for s in seq]
        made = sum(s["segments"]["pinshm_sgl_"] for s in seq)
        put = f"{r['store']['puts']} / {len(seq) + r['burst']['requests']}" if "store" in r else "-"
        med = lambda k: f"{1000 * statistics.median(s[k] for s in seq):.0f}" if seq else "-"
        b = r.get("burst", {})
        out.append(
            f"| {r['tp']} | {r['config']}{' (SIGKILL mid-burst)' if 'killed_after_s' in r else ''} | "
            f"{same} | {sum(per) / len(per) if per else 0:.2f} | {made} | {put} | {med('ttft_s')} | "
            f"{med('latency_s')} | {b.get('requests_per_s', 0):.2f} | "
            f"{', '.join(r['left_in_dev_shm']) or 'nothing'} |"
        )
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", required=True, help="the SGLang venv's python (setup_venv.sh)")
    ap.add_argument("--model", required=True, help="build_model.py's directory")
    ap.add_argument("--images", help="PNGs (default: MODEL/imgs)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--configs", default="stock,pinshm")
    ap.add_argument("--n", type=int, default=16, help="sequential requests")
    ap.add_argument("--burst", type=int, default=32)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--kill", action="store_true", help="SIGKILL the server mid-burst")
    ap.add_argument("--kill-after", type=float, default=2.0)
    ap.add_argument("--settle", type=float, default=5.0)
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
    images_dir = a.images or os.path.join(a.model, "imgs")
    images = [os.path.join(images_dir, f) for f in sorted(os.listdir(images_dir)) if f.endswith(".png")]
    images = ["data:image/png;base64," + base64.b64encode(open(p, "rb").read()).decode() for p in images]
    watch = ShmWatch()
    watch.start()
    rows = []
    for tp in (int(t) for t in a.tp.split(",")):
        for config in a.configs.split(","):
            print(f"== TP={tp} {config}", flush=True)
            try:
                rows.append(one(a, tp, config, watch, images))
            except Exception as e:  # noqa: BLE001 - recorded, the next runs
                rows.append(
                    {
                        "tp": tp,
                        "config": config,
                        "error": f"{type(e).__name__}: {e}",
                        "left_in_dev_shm": [],
                        "burst": {},
                    }
                )
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "sequential"}), flush=True)
    meta = {"argv": sys.argv[1:], "shm_mib": a.shm_mib, "cpus": os.cpu_count(), "load": os.getloadavg()}
    with open(os.path.join(a.out, "RESULTS.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    table = summary(rows)
    with open(os.path.join(a.out, "RESULTS.md"), "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
