"""The serving benchmark the queue default is chosen by: a real vLLM engine
(TP=2, mp executor) behind its OpenAI HTTP server, streaming chat requests
with one 224-px image each, at concurrency 1, 8 and 32, with images that
are all distinct and images that repeat. Per cell it records requests/s,
and time to first token and end-to-end latency (median and p99) of every
request, with the token ids (compared with stock's).

    python serve_bench.py --python /path/to/venv/bin/python [--repeat 3] [--out DIR]

Configurations (run.py's): ``stock`` (vLLM alone), ``auto`` (pinshm's
plugin as installed: its cache, each queue vLLM's or pinshm's by vLLM's
/dev/shm check) and ``queue`` (pinshm's cache and queue). Each repeat
starts one server per configuration, in a rotated order (so no
configuration always runs first or last), runs every cell on it, and stops
it as a user does. ``results.json`` (every request) and ``serving.json``
(the medians over repeats, and the ratios to stock paired by repeat) go to
``--out``; tools/figures.py renders ``serving.json`` into docs/vllm.md.

This script needs only the standard library; the venv's Python makes the
images and the model (build_model.py).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run import Sampler, base_env, data_urls, server_cmd, server_ready, shm_usage, stop_server, tiny_model  # noqa: E402 - the harness's own module

CONCURRENCY = (1, 8, 32)
#: Requests per cell at each concurrency: enough for a p99 that is not
#: the one slowest request at 32, few enough that a repeat takes minutes.
REQUESTS = {1: 12, 8: 32, 32: 64}
#: The images a "repeated" cell draws from (each seen before the cell).
REPEATED = 4
MAX_TOKENS = 8


def cells(concurrency: tuple[int, ...]) -> list[dict]:
    """Every cell with the image ids of its requests: distinct cells use
    ids no other cell uses (a miss in every cache), repeated ones cycle
    over REPEATED ids that the warm-up showed."""
    out, next_id = [], 1000
    for c in concurrency:
        n = REQUESTS.get(c, 2 * c)
        out.append({"cell": f"c{c}-distinct", "concurrency": c, "images": list(range(next_id, next_id + n))})
        next_id += n
        out.append({"cell": f"c{c}-repeated", "concurrency": c, "images": [500 + i % REPEATED for i in range(n)]})
    return out


URLS: dict[int, str] = {}


def stream_chat(port: int, image: int) -> dict:
    """One streamed chat request: seconds to the first token and to the
    end, and the token ids."""
    body = {
        "model": "tiny-llava",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": URLS[image]}},
                    {"type": "text", "text": "describe the image"},
                ],
            }
        ],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.monotonic()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    ttft, tokens = None, []
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        for choice in chunk.get("choices", []):
            ids = choice.get("token_ids") or []
            text = (choice.get("delta") or {}).get("content")
            if ttft is None and (ids or text):
                ttft = time.monotonic() - t0
            tokens.extend(ids)
    e2e = time.monotonic() - t0
    conn.close()
    return {"ttft_s": ttft if ttft is not None else e2e, "e2e_s": e2e, "tokens": tokens}


def run_cell(port: int, cell: dict) -> dict:
    t = time.monotonic()
    with ThreadPoolExecutor(cell["concurrency"]) as ex:
        got = list(ex.map(lambda i: stream_chat(port, i), cell["images"]))
    wall = time.monotonic() - t
    return {"cell": cell["cell"], "wall_s": wall, "requests": got}


def serve(py: str, model: Path, cfg: str, out: Path, tag: str, port: int, plan: list[dict]) -> dict:
    probe, log = out / f"{tag}.probe.jsonl", out / f"{tag}.log"
    probe.unlink(missing_ok=True)
    before = set(shm_usage())
    cmd = server_cmd(py, model, port, max_model_len=512, max_num_seqs=32, images=1)
    res: dict = {"config": cfg, "tag": tag, "cells": []}
    with open(log, "w") as lf:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, env=base_env(cfg, probe), stdout=lf, stderr=subprocess.STDOUT, cwd=HERE)
        sampler = Sampler(proc.pid, before, ("vllm_mm_", "VLLM_OBJECT_STORAGE"))
        sampler.start()
        try:
            if not server_ready(proc, port):
                res["error"] = f"the server exited with {proc.returncode} before it was ready (see {log.name})"
                return res
            res["init_s"] = time.monotonic() - t0
            # Warm-up, not measured: the first requests' one-off costs, and
            # the repeated cells' images shown once.
            for i in [900, 901, *range(500, 500 + REPEATED)]:
                stream_chat(port, i)
            cpu0 = sampler.cpu_by_role()
            for cell in plan:
                res["cells"].append(run_cell(port, cell))
            sampler.sample()
            cpu1 = sampler.cpu_by_role()
            res["cpu_s"] = {k: round(cpu1.get(k, 0.0) - cpu0.get(k, 0.0), 2) for k in cpu1}
        finally:
            res["rc"], _ = stop_server(proc)
            sampler.stop.set()
            sampler.join()
            time.sleep(1)
            res["shm_left"] = sorted(k for k in shm_usage() if k not in before and k in sampler.ours)
    return res


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]


def cell_figures(cell: dict) -> dict:
    ttft = [r["ttft_s"] for r in cell["requests"]]
    e2e = [r["e2e_s"] for r in cell["requests"]]
    return {
        "rps": len(e2e) / cell["wall_s"],
        "ttft_p50": statistics.median(ttft),
        "ttft_p99": p99(ttft),
        "e2e_p50": statistics.median(e2e),
        "e2e_p99": p99(e2e),
    }


def summarize(runs: list[dict], configs: list[str]) -> dict:
    """Medians over repeats of each figure, and of its ratio to stock's in
    the same repeat; whether every request's tokens are stock's."""
    stock_tokens: dict[tuple[str, int], list[int]] = {}
    for r in runs:
        if r["config"] == "stock":
            for c in r["cells"]:
                for i, q in enumerate(c["requests"]):
                    stock_tokens.setdefault((c["cell"], i), q["tokens"])
    by: dict[tuple[str, str], list[dict]] = {}
    paired: dict[tuple[str, str], list[dict]] = {}
    stock_of = {(r["repeat"], c["cell"]): cell_figures(c) for r in runs if r["config"] == "stock" for c in r["cells"]}
    same = {cfg: True for cfg in configs}
    for r in runs:
        for c in r["cells"]:
            f = cell_figures(c)
            by.setdefault((r["config"], c["cell"]), []).append(f)
            base = stock_of.get((r["repeat"], c["cell"]))
            if base:
                paired.setdefault((r["config"], c["cell"]), []).append({k: f[k] / base[k] for k in f})
            for i, q in enumerate(c["requests"]):
                if stock_tokens.get((c["cell"], i), q["tokens"]) != q["tokens"]:
                    same[r["config"]] = False
    rows = []
    for (cfg, cell), fs in by.items():
        rows.append(
            {
                "config": cfg,
                "cell": cell,
                "repeats": len(fs),
                **{k: statistics.median(f[k] for f in fs) for k in fs[0]},
                "ratio_to_stock": {k: statistics.median(p[k] for p in paired.get((cfg, cell), [])) for k in fs[0]}
                if paired.get((cfg, cell))
                else None,
            }
        )
    cpu: dict[str, dict[str, float]] = {}
    for cfg in configs:
        per = [r.get("cpu_s", {}) for r in runs if r["config"] == cfg and r.get("cpu_s")]
        roles = sorted({k for p in per for k in p})
        cpu[cfg] = {k: statistics.median(p.get(k, 0.0) for p in per) for k in roles}
    return {"rows": rows, "tokens_as_stock": same, "cpu_s": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=os.environ.get("VLLM_PYTHON"), help="a Python with vLLM and pinshm")
    ap.add_argument("--model", type=Path, default=None, help="the 224-px tiny model (built if missing)")
    ap.add_argument("--out", type=Path, default=Path("serve-out"))
    ap.add_argument("--configs", default="stock,auto,queue")
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--port", type=int, default=18133)
    args = ap.parse_args()
    if not args.python:
        sys.exit("give --python (or VLLM_PYTHON): an interpreter with vLLM and pinshm installed")
    os.environ["E2E_IMAGE_SIZE"] = "224"
    args.out.mkdir(parents=True, exist_ok=True)
    model = tiny_model(args.python, args.model, args.out, 224)
    plan = cells(tuple(int(c) for c in args.concurrency.split(",")))
    ids = sorted({i for c in plan for i in c["images"]} | {900, 901} | set(range(500, 500 + REPEATED)))
    URLS.update(data_urls(args.python, ids))
    configs = args.configs.split(",")
    versions = subprocess.run(
        [args.python, "-c", "import vllm, torch, pinshm; print(vllm.__version__, torch.__version__, pinshm.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    runs: list[dict] = []
    lock = threading.Lock()
    for rep in range(args.repeat):
        order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
        for cfg in order:
            tag = f"serve-{cfg}-{rep}"
            print(f"== {tag}", flush=True)
            r = serve(args.python, model, cfg, args.out, tag, args.port, plan)
            r["repeat"] = rep
            with lock:
                runs.append(r)
            brief = {c["cell"]: round(cell_figures(c)["rps"], 2) for c in r["cells"]}
            print(
                json.dumps({"rc": r.get("rc"), "error": r.get("error"), "rps": brief, "cpu_s": r.get("cpu_s")}),
                flush=True,
            )
            (args.out / "results.json").write_text(json.dumps(runs))
    ok = [r for r in runs if not r.get("error")]
    summary = summarize(ok, configs)
    summary.update(
        versions=versions,
        configs=configs,
        repeats=args.repeat,
        requests=REQUESTS,
        max_tokens=MAX_TOKENS,
        failed_runs=[r["tag"] for r in runs if r.get("error")],
        machine=f"{os.cpu_count()} cores",
    )
    (args.out / "serving.json").write_text(json.dumps(summary, indent=1))
    for row in summary["rows"]:
        print(json.dumps(row))
    print(json.dumps({"tokens_as_stock": summary["tokens_as_stock"], "cpu_s": summary["cpu_s"]}))


if __name__ == "__main__":
    main()
