"""The encoder-cache harness: vLLM's encoder cache connector on the tiny
LLaVA model (TP=2, mp executor, offline ``vllm.LLM``), in one run, for

- ``ec-stock``: no connector: an image whose output vLLM's own encoder
  cache has evicted is encoded again;
- ``ec-example``: vLLM's ``ECExampleConnector`` (``ec_both``, safetensors
  files in a folder of --out);
- ``ec-pinshm``: pinshm's ``PinshmECConnector`` (``ec_both``, a store in
  /dev/shm);
- ``ec-pinshm-small``: the same with a store smaller than the image set;
- ``ec-pinshm-2`` and ``ec-example-2``: two engines; an ``ec_consumer``
  engine started while an ``ec_both`` engine (its passes done) still runs,
  over the same images.

    python ec.py --python /path/to/venv/bin/python [--quick] [--out DIR]
        [--configs ec-stock,ec-example,ec-pinshm,ec-pinshm-small,ec-pinshm-2,ec-example-2] [--tp 2]
        [--image-size 64] [--repeat 1] [--no-prefix-caching]

Every engine runs with ``--max-batched-tokens`` (default: 4 images' tokens,
64 for the default 64-px images of 16 tokens), which also sizes vLLM's own
encoder cache: it holds 4 images, fewer than a pass shows (12), so vLLM
evicts outputs it will need again, and the connector is asked for them.
``--image-size`` builds the model for larger images ((N/16)^2 tokens each,
a model folder per size), so that the encoder costs more of a pass.
``--repeat N`` runs every configuration N times, interleaved (stock,
example, pinshm, stock, ...), so drift of the machine falls on all alike;
the summary then gives each configuration's median pass times and their
ratios to stock's. ``--no-prefix-caching``: vLLM's prefix cache off; with
it on, a prompt seen before (a pass repeats the last) is served from the
KV cache, its images with it, and asks neither the encoder nor the
connector (at 224 px, stock's second pass runs the encoder 0 times). pinshm's plugin is off in every run
(``VLLM_PLUGINS=""``): the connector needs no plugin, and the runs differ
by the connector alone.

Per run (from probe/sitecustomize.py, in-process): the items each worker's
encoder ran per pass (``embed_multimodal``) and the seconds it took, the
connector's answers (``has_cache_item``: hits), loads and saves; token ids
against ``ec-stock``'s; pass and single-request times; /dev/shm peak (all segments,
and the connector's store) and the example connector's folder size.
``ec-summary.json`` and ``ec-summary.md`` go to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import run as harness

HERE = Path(__file__).resolve().parent
MODULE = "pinshm.vllm.ec_connector"
CONFIGS = ("ec-stock", "ec-example", "ec-pinshm", "ec-pinshm-small", "ec-pinshm-2", "ec-example-2")


def ec_config(cfg: str, out: Path, tag: str, item_bytes: int, role: str = "ec_both") -> tuple[dict | None, str | None]:
    """The ec_transfer_config of `cfg` (None: no connector), and the store
    (a /dev/shm name) or folder it uses."""
    if cfg == "ec-stock":
        return None, None
    if cfg.startswith("ec-example"):
        folder = out / f"{tag}.ec-files"
        return {
            "ec_connector": "ECExampleConnector",
            "ec_role": role,
            "ec_connector_extra_config": {"shared_storage_path": str(folder)},
        }, str(folder)
    store = f"pinshm_ec_e2e_{os.getpid()}_{tag}"
    # An image's output is tokens x 128 float32 (8 KiB at 64 px): "small"
    # (48k at 64 px) holds about 4 of a pass's 12 images.
    size = f"{6 * item_bytes // 1024}k" if cfg == "ec-pinshm-small" else "64m"
    return {
        "ec_connector": "PinshmECConnector",
        "ec_connector_module_path": MODULE,
        "ec_role": role,
        "ec_connector_extra_config": {"store": store, "size": size},
    }, store


class Engine:
    """One offline engine process (offline.py), sampled while it runs."""

    def __init__(self, py, model, ec, out, tag, passes, singles, batched, extra, hold=None, store=None, tp=2):
        """`extra`: more of offline.py's arguments, the same for every
        engine of a run (--max-model-len, --no-prefix-caching)."""
        self.tag, self.out, self.store = tag, out, store
        self.probe, self.log, self.result = out / f"{tag}.probe.jsonl", out / f"{tag}.log", out / f"{tag}.json"
        for p in (self.probe, self.result):
            p.unlink(missing_ok=True)
        # The store counts for every engine that maps it, even one started
        # after it was made (a consumer).
        self.before = set(harness.shm_usage()) - {store}
        cmd = [py, str(HERE / "offline.py"), str(model), str(self.result), "--passes", str(passes)]
        cmd += ["--singles", str(singles), "--max-batched-tokens", str(batched), "--tp", str(tp)]
        cmd += extra
        if ec is not None:
            cmd += ["--ec", json.dumps(ec)]
        if hold is not None:
            cmd += ["--hold", str(hold)]
        self.lf = open(self.log, "w")
        env = harness.base_env("stock", self.probe)  # VLLM_PLUGINS="": no pinshm plugin
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.lf, stderr=subprocess.STDOUT, cwd=HERE)
        prefixes = ("vllm_mm_", "VLLM_OBJECT_STORAGE", "pinshm_ec")
        self.sampler = harness.Sampler(self.proc.pid, self.before, prefixes)
        self.sampler.start()

    def wait_result(self, timeout=1800) -> bool:
        """Until its result file exists (passes done) or it exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.result.exists() and self.proc.poll() is None:
            time.sleep(0.5)  # polling another process's progress, not a test
        return self.result.exists()

    def finish(self, timeout=1800) -> dict:
        rc = self.proc.wait(timeout=timeout)
        self.lf.close()
        res = harness.finish(
            {"config": self.tag, "rc": rc}, self.sampler, self.before, self.probe, self.proc.pid, self.log
        )
        if self.result.exists():
            r = json.loads(self.result.read_text())
            keys = ("init_s", "pass_s", "pass_t", "single_s", "tokens", "single_tokens", "finish")
            res.update({k: r[k] for k in keys if k in r})
        res.update(encoder_counts(self.probe, res.get("pass_t", [])))
        res["store_peak_mib"] = round(self.sampler.peak_by_name.get(self.store or "", 0) / 2**20, 3)
        return res


def encoder_counts(probe: Path, pass_t: list) -> dict:
    """Per pass: encoder items (the most any one worker ran: every TP rank
    runs the encoder), connector lookups and hits, items loaded (most of
    any worker), saves; and encoder items before the first pass."""
    lines = [json.loads(x) for x in probe.read_text().splitlines()] if probe.exists() else []

    def in_pass(x, i):
        t0, t1 = pass_t[i]
        return t0 <= x.get("t", 0) <= t1

    def most_per_pid(what, i, field="items"):
        by: dict[int, float] = {}
        for x in lines:
            if x["what"] == what and in_pass(x, i):
                by[x["pid"]] = by.get(x["pid"], 0) + x.get(field, 0)
        return max(by.values(), default=0)

    n = len(pass_t)
    start = pass_t[0][0] if pass_t else float("inf")
    return {
        "encoded": [most_per_pid("encode", i) for i in range(n)],
        "encoder_s": [round(most_per_pid("encode", i, "s"), 4) for i in range(n)],
        "encoder_calls": [sum(x["what"] == "encode" and in_pass(x, i) for x in lines) for i in range(n)],
        "lookups": [sum(x["what"] == "ec_lookup" and in_pass(x, i) for x in lines) for i in range(n)],
        "ec_hits": [sum(x["what"] == "ec_lookup" and x["hit"] and in_pass(x, i) for x in lines) for i in range(n)],
        "fetched": [sum(x["what"] == "ec_lookup" and x.get("fetched", False) and in_pass(x, i) for x in lines) for i in range(n)],
        "loaded": [most_per_pid("ec_load", i) for i in range(n)],
        "saves": sum(x["what"] == "ec_save" for x in lines),
        "encoded_before_passes": max(
            (sum(y["items"] for y in lines if y["what"] == "encode" and y["pid"] == pid and y["t"] < start)
             for pid in {x["pid"] for x in lines if x["what"] == "encode"}),
            default=0,
        ),
        "connectors": sorted({f"{x['cls']} {x['role']}" for x in lines if x["what"] == "ec_connector"}),
    }  # fmt: skip


def folder_mib(path: str | None) -> float:
    if not path or not os.path.isdir(path):
        return 0.0
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return round(total / 2**20, 3)


def one(py, model, cfg, out, passes, singles, batched, tp, extra, item_bytes, rep=None) -> list[dict]:
    """The engine(s) of `cfg`; with `rep` (a repeat's number) in its file
    and store names, and in its results."""
    tag = cfg if rep is None else f"{cfg}-r{rep}"
    if not cfg.endswith("-2"):
        ec, where = ec_config(cfg, out, tag, item_bytes)
        e = Engine(py, model, ec, out, tag, passes, singles, batched, extra, store=where, tp=tp)
        r = e.finish()
        r.update(config=cfg, rep=rep, files_mib=folder_mib(where))
        return [r]
    # Two engines: the producer holds after its passes; the consumer runs.
    base = cfg[:-2]
    ec, where = ec_config(base, out, tag, item_bytes)
    hold = out / f"{tag}.hold"
    hold.write_text("")
    a = Engine(py, model, ec, out, f"{tag}-both", passes, 0, batched, extra, hold=hold, store=where, tp=tp)
    try:
        if not a.wait_result():
            raise RuntimeError(f"{tag}: the ec_both engine stopped before its passes were done (see {a.log})")
        ec_b, _ = ec_config(base, out, tag, item_bytes, role="ec_consumer")
        if ec is not None and ec_b is not None:
            ec_b["ec_connector_extra_config"] = ec["ec_connector_extra_config"]  # the same store or folder
        b = Engine(py, model, ec_b, out, f"{tag}-consumer", passes, 0, batched, extra, store=where, tp=tp)
        rb = b.finish()
    finally:
        hold.unlink(missing_ok=True)
    ra = a.finish()
    ra.update(config=f"{cfg}-both", rep=rep)
    rb.update(config=f"{cfg}-consumer", rep=rep)
    ra["files_mib"] = rb["files_mib"] = folder_mib(where)
    return [ra, rb]


def summarize(runs: list[dict]) -> str:
    stock = next((r for r in runs if r["config"] == "ec-stock" and "tokens" in r), None)
    head = (
        "| run | rc | tokens = stock | encoder items per pass (per rank) | encoder s per pass | "
        "connector hits / lookups per pass | loaded per pass | saves | pass s | single s | "
        "/dev/shm peak MiB (store) | files MiB | tracebacks |"
    )
    md = [head, "|" + "---|" * 13]
    for r in runs:
        same = None
        if stock is not None and "tokens" in r:
            n = len(r["tokens"])
            same = r["tokens"] == stock["tokens"][:n] and (
                not r.get("single_tokens") or r["single_tokens"] == stock["single_tokens"]
            )
        hits = ", ".join(f"{h}/{n}" for h, n in zip(r.get("ec_hits", []), r.get("lookups", [])))
        name = r["config"] if r.get("rep") is None else f"{r['config']} #{r['rep'] + 1}"
        md.append(
            f"| {name} | {r['rc']} | {same} | {r.get('encoded')} | {r.get('encoder_s')} | {hits or '-'} | "
            f"{r.get('loaded')} | "
            f"{r.get('saves')} | {[round(x, 2) for x in r.get('pass_s', [])]} | "
            f"{[round(x, 2) for x in r.get('single_s', [])]} | {r['shm_peak_mib']} ({r.get('store_peak_mib')}) | "
            f"{r.get('files_mib')} | {r['tracebacks']} |"
        )
    return "\n".join(md) + "\n"


def timing(runs: list[dict]) -> str:
    """Per configuration, over its repeats: the median time of each pass
    (min-max in brackets) and its ratio to stock's median (below 1:
    faster), as the docs' figure of these runs shows it (tools/figures.py's
    `ec-timing` renderer, given the runs with their tokens checked)."""
    sys.path.insert(0, str(HERE.parent.parent / "tools"))
    import figures

    stock = next((r for r in runs if r["config"] == "ec-stock" and "tokens" in r), None)
    rows = [
        dict(r, tokens_equal_stock=stock is None or r.get("tokens") == stock["tokens"][: len(r.get("tokens", []))])
        for r in runs
        if r.get("pass_s")
    ]
    return figures.r_ec_timing({"runs": rows}) if rows else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=os.environ.get("VLLM_PYTHON"), help="a Python with vLLM and pinshm")
    ap.add_argument("--model", type=Path, default=None, help="model folder (built if missing)")
    ap.add_argument("--out", type=Path, default=Path("e2e-out"))
    ap.add_argument("--quick", action="store_true", help="two passes and one single request per engine")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="also vLLM's encoder cache, in tokens (default: 4 images' worth, 64 at 64 px)",
    )
    ap.add_argument("--tp", type=int, default=2, help="tensor parallel size of every engine")
    ap.add_argument(
        "--image-size",
        type=int,
        default=64,
        help="the model's image size, a multiple of 16 ((N/16)^2 tokens per image); the model is built per size",
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs per configuration, interleaved")
    ap.add_argument("--no-prefix-caching", action="store_true", help="vLLM's prefix cache off in every engine")
    args = ap.parse_args()
    if not args.python:
        sys.exit("give --python (or VLLM_PYTHON): an interpreter with vLLM and pinshm installed")
    os.environ["E2E_IMAGE_SIZE"] = str(args.image_size)  # the engines' workload.py draws images this size
    image_tokens = (args.image_size // 16) ** 2
    batched = args.max_batched_tokens or 4 * image_tokens
    # A prompt holds two images and a few words; 512 is the model's limit.
    model_len = max(256, 2 * image_tokens + 64)
    if model_len > 512:
        sys.exit(f"--image-size {args.image_size}: two images of {image_tokens} tokens exceed the model's 512")
    item_bytes = image_tokens * 128 * 4  # the projector's float32 output, hidden size 128
    extra = ["--max-model-len", str(model_len)] + (["--no-prefix-caching"] if args.no_prefix_caching else [])
    args.out.mkdir(parents=True, exist_ok=True)
    model = harness.tiny_model(args.python, args.model, args.out, args.image_size)
    passes, singles = (2, 1) if args.quick else (3, 3)
    configs = args.configs.split(",")
    for c in configs:
        if c not in CONFIGS:
            sys.exit(f"unknown config {c!r}: one of {', '.join(CONFIGS)}")
    if "ec-stock" in configs:  # first: the others' tokens are compared with it
        configs = ["ec-stock"] + [c for c in configs if c != "ec-stock"]
    runs: list[dict] = []
    for rep in range(args.repeat):
        for cfg in configs:
            print(f"== {cfg}" + (f" #{rep + 1}" if args.repeat > 1 else ""), flush=True)
            eng = (passes, singles, batched, args.tp, extra, item_bytes, rep if args.repeat > 1 else None)
            for r in one(args.python, model, cfg, args.out, *eng):
                runs.append(r)
                brief = {k: r.get(k) for k in ("config", "rc", "encoded", "encoder_s", "ec_hits", "loaded", "pass_s")}
                print(json.dumps(brief), flush=True)
            (args.out / "ec-runs.json").write_text(json.dumps(runs, indent=1, default=str))
            for d in args.out.glob("*.ec-files"):
                shutil.rmtree(d, ignore_errors=True)
    code = "import vllm, torch, pinshm; print(vllm.__version__, torch.__version__, pinshm.__version__)"
    versions = subprocess.run([args.python, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    head = (
        f"vLLM {versions[0]}, torch {versions[1]}, pinshm {versions[2]}; TP={args.tp} offline; "
        f"{args.image_size}-px images ({image_tokens} tokens); max_num_batched_tokens {batched} (vLLM's encoder "
        f"cache: {batched // image_tokens} images); {passes} passes of 40 items over 12 images, {singles} single(s)"
        f"; {args.repeat} run(s) of each configuration, interleaved"
        f"{'; prefix caching off' if args.no_prefix_caching else ''}\n\n"
    )
    md = summarize(runs) + "\n" + timing(runs)
    (args.out / "ec-summary.json").write_text(json.dumps({"versions": versions, "runs": runs}, indent=1, default=str))
    (args.out / "ec-summary.md").write_text(head + md)
    print(head + md)


if __name__ == "__main__":
    main()
