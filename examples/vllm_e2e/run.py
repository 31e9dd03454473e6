"""The end-to-end harness: a real vLLM engine (TP=2, mp executor,
``--mm-processor-cache-type shm``) on the tiny LLaVA model, offline and
through the HTTP server, for three configurations:

- ``stock``: vLLM alone (``VLLM_PLUGINS=""``: no plugin loads);
- ``auto``: pinshm's plugin as installed: the multimodal cache on pinshm,
  each queue vLLM's or pinshm's by vLLM's /dev/shm check (the default,
  ``PINSHM_VLLM_MESSAGE_QUEUE=auto``);
- ``cache``: the cache alone (``PINSHM_VLLM_MESSAGE_QUEUE=0``);
- ``queue``: pinshm's cache and MessageQueue (``PINSHM_VLLM_MESSAGE_QUEUE=1``);
- ``zerocopy`` (ask for it with ``--configs``): the cache, with the workers'
  decoded tensors viewing the slot (``PINSHM_VLLM_ZERO_COPY=1``).

    python run.py --python /path/to/venv/bin/python [--quick] [--out DIR]
    python run.py ... --shm-size 64m --reference DIR/runs.json   # a container's /dev/shm

``--python`` (or ``$VLLM_PYTHON``) is any interpreter with vLLM and pinshm
installed; this script itself needs only the standard library. Per run it
records: token ids (compared with stock's), cache hits, init / pass /
single-request times, CPU seconds per process (API server or LLM process,
engine core, workers), /dev/shm resident during the run (peak, all
segments and the queues' alone) and left after it, the classes each
process really built (from probe/sitecustomize.py, in-process), the
plugin's status lines, vLLM's forced kills at shutdown, and tracebacks.
``summary.json`` and ``summary.md`` go to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from run_summary import read_log, read_probe, summarize  # noqa: E402 - after the harness's own imports

HERE = Path(__file__).resolve().parent
CONFIGS = {
    "stock": {"VLLM_PLUGINS": ""},
    # The plugin as installed: the cache, and each queue vLLM's or pinshm's
    # by vLLM's own /dev/shm check (PINSHM_VLLM_MESSAGE_QUEUE=auto).
    "auto": {},
    "cache": {"PINSHM_VLLM_MESSAGE_QUEUE": "0"},
    "queue": {"PINSHM_VLLM_MESSAGE_QUEUE": "1"},
    # The cache with decoded tensors viewing the slot (read-only mapping).
    "zerocopy": {"PINSHM_VLLM_ZERO_COPY": "1"},
}
CLK = os.sysconf("SC_CLK_TCK")


# ---- sampling: /dev/shm and the process tree ----


def shm_usage() -> dict[str, int]:
    """Resident bytes of each /dev/shm file (blocks, not the nominal size)."""
    out = {}
    for e in os.scandir("/dev/shm"):
        try:
            out[e.name] = e.stat().st_blocks * 512
        except FileNotFoundError:
            pass
    return out


def children_of(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for e in os.scandir("/proc"):
        if not e.name.isdigit():
            continue
        try:
            with open(f"/proc/{e.name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(e.name))
    tree, todo = [], [root]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(kids.get(p, []))
    return tree


def mapped_shm(pid: int) -> dict[str, int]:
    """/dev/shm files `pid` has mapped, with the resident bytes of its
    mappings of each (Rss from smaps): this also sees segments whose name
    was already unlinked (pinshm's queue removes it once readers attach)."""
    out: dict[str, int] = {}
    name = None
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                i = line.find("/dev/shm/")
                if i >= 0:
                    name = line[i + 9 :].split()[0]
                    out.setdefault(name, 0)
                elif line[:1].isdigit() or line[:1] in "abcdef":
                    name = None  # another mapping
                elif name is not None and line.startswith("Rss:"):
                    out[name] += int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def cpu_and_role(pid: int) -> tuple[float, str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLK, cmd


def role_of(cmd: str, pid: int, root: int) -> str:
    if "EngineCore" in cmd:
        return "engine_core"
    if "Worker_TP" in cmd or "VllmWorker" in cmd:
        return "worker"
    if pid == root:
        return "main"
    return "other"


class Sampler(threading.Thread):
    """Every `period` s: /dev/shm resident and the CPU time of every process
    under `root` (the last value seen: a SIGKILLed child's time stays)."""

    def __init__(self, root: int, before: set[str], cache_prefixes: tuple, period: float = 0.25):
        super().__init__(daemon=True)
        self.root, self.before, self.period = root, before, period
        self.cache_prefixes = cache_prefixes
        self.stop = threading.Event()
        self.peak_total = 0
        self.peak_queues = 0
        self.peak_by_name: dict[str, int] = {}
        self.cpu: dict[int, tuple[float, str]] = {}
        self.ours: set[str] = set()

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.period)
        self.sample()

    def sample(self) -> None:
        tree = children_of(self.root)
        rss: dict[str, int] = {}
        for pid in tree:
            for k, v in mapped_shm(pid).items():
                rss[k] = max(rss.get(k, 0), v)
        self.ours.update(rss)
        # Only the segments this run's processes mapped (other programs on
        # the machine use /dev/shm too): the file's blocks while it has a
        # name, else the largest resident mapping of it.
        files = shm_usage()
        usage = {k: max(files.get(k, 0), v) for k, v in rss.items() if k not in self.before}
        total = sum(usage.values())
        queues = sum(v for k, v in usage.items() if not k.startswith(self.cache_prefixes) and not k.startswith("sem."))
        self.peak_total = max(self.peak_total, total)
        self.peak_queues = max(self.peak_queues, queues)
        for k, v in usage.items():
            self.peak_by_name[k] = max(self.peak_by_name.get(k, 0), v)
        for pid in tree:
            got = cpu_and_role(pid)
            if got is not None:
                role = role_of(got[1], pid, self.root)
                old = self.cpu.get(pid)
                # A role once seen stays (an exiting process's cmdline is
                # empty; the title is set after start).
                if old is not None and role == "other":
                    role = old[1]
                self.cpu[pid] = (max(got[0], old[0] if old else 0.0), role)

    def cpu_by_role(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for sec, role in self.cpu.values():
            out[role] = round(out.get(role, 0.0) + sec, 2)
        return out


# ---- the probe file and the log ----


def base_env(cfg: str, probe: Path) -> dict:
    env = dict(os.environ)
    for k in ("VLLM_PLUGINS", "PINSHM_VLLM_MESSAGE_QUEUE", "PINSHM_VLLM_ZERO_COPY"):
        env.pop(k, None)
    env.update(CONFIGS[cfg])
    env["PINSHM_E2E_PROBE"] = str(probe)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / "probe"), str(HERE), env.get("PYTHONPATH", "")])
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    return env


def finish(res: dict, sampler: Sampler, before: set, probe: Path, root: int, log: Path) -> dict:
    sampler.stop.set()
    sampler.join()
    left = {k: v for k, v in shm_usage().items() if k not in before and k in sampler.ours}
    res.update(
        cpu_s=sampler.cpu_by_role(),
        shm_peak_mib=round(sampler.peak_total / 2**20, 2),
        shm_peak_queues_mib=round(sampler.peak_queues / 2**20, 2),
        shm_left=sorted(left),
        shm_left_mib=round(sum(left.values()) / 2**20, 2),
        **read_probe(probe, root),
        **read_log(log.read_text(errors="replace")),
    )
    return res


def run_offline(py: str, model: Path, cfg: str, out: Path, tag: str, passes: int, singles: int) -> dict:
    probe, log, result = out / f"{tag}.probe.jsonl", out / f"{tag}.log", out / f"{tag}.json"
    for p in (probe, result):
        p.unlink(missing_ok=True)
    before = set(shm_usage())
    cmd = [py, str(HERE / "offline.py"), str(model), str(result), "--passes", str(passes), "--singles", str(singles)]
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, env=base_env(cfg, probe), stdout=lf, stderr=subprocess.STDOUT, cwd=HERE)
        sampler = Sampler(proc.pid, before, ("vllm_mm_", "VLLM_OBJECT_STORAGE"))
        sampler.start()
        rc = proc.wait(timeout=1800)
        t_exit = time.time()
    res = {"mode": "offline", "config": cfg, "rc": rc}
    if result.exists():
        r = json.loads(result.read_text())
        res.update({k: r[k] for k in ("init_s", "pass_s", "single_s", "tokens", "single_tokens")})
        res["exit_s"] = round(t_exit - r["events"]["done"], 2)
    return finish(res, sampler, before, probe, proc.pid, log)


def http(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def data_urls(py: str, ids: list[int]) -> dict[int, str]:
    """The images as data URLs, made by the vLLM venv's Python (numpy and
    PIL are there; this script needs only the standard library)."""
    code = "import json, sys, workload; print(json.dumps({i: workload.data_url(i) for i in json.loads(sys.argv[1])}))"
    out = subprocess.run([py, "-c", code, json.dumps(ids)], capture_output=True, text=True, check=True, cwd=HERE)
    return {int(k): v for k, v in json.loads(out.stdout).items()}


URLS: dict[int, str] = {}


def chat(port: int, images: list[int], text: str) -> list[int]:
    content = [{"type": "image_url", "image_url": {"url": URLS[i]}} for i in images]
    content.append({"type": "text", "text": text})
    r = http(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        {
            "model": "tiny-llava",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 8,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    return list(r["choices"][0].get("token_ids") or [])


def server_cmd(py: str, model: Path, port: int, max_model_len: int, max_num_seqs: int, images: int) -> list[str]:
    """vLLM's OpenAI API server on the tiny model: TP=2 on the mp executor,
    the shm multimodal cache, eager, float32, seeded."""
    return [
        py, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny-llava",
        "--host", "127.0.0.1", "--port", str(port),
        "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
        "--mm-processor-cache-type", "shm", "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs),
        "--enforce-eager", "--dtype", "float32", "--seed", "0",
        "--gpu-memory-utilization", os.environ.get("E2E_MEM_UTIL", "0.1"),
        "--limit-mm-per-prompt", json.dumps({"image": images}),
    ]  # fmt: skip


def server_ready(proc: subprocess.Popen, port: int) -> bool:
    """Waits until the API server on `port` answers /health (True), or
    exits first (False)."""
    while proc.poll() is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return True
        except OSError:
            time.sleep(0.5)  # polling a server's readiness, not a test
    return False


def stop_server(proc: subprocess.Popen) -> tuple[int, float]:
    """Stops the server as a user does (Ctrl-C; its API server then
    SIGKILLs the engine core and the workers): (exit status, seconds)."""
    t = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    return rc, round(time.monotonic() - t, 2)


def run_server(py: str, model: Path, cfg: str, out: Path, tag: str, passes: int, singles: int, port: int) -> dict:
    sys.path.insert(0, str(HERE))
    import workload
    from concurrent.futures import ThreadPoolExecutor

    probe, log = out / f"{tag}.probe.jsonl", out / f"{tag}.log"
    probe.unlink(missing_ok=True)
    if not URLS:
        URLS.update(data_urls(py, list(range(workload.N_IMAGES)) + [100 + i for i in range(singles)]))
    before = set(shm_usage())
    cmd = server_cmd(py, model, port, max_model_len=256, max_num_seqs=8, images=2)
    res: dict = {"mode": "server", "config": cfg}
    with open(log, "w") as lf:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, env=base_env(cfg, probe), stdout=lf, stderr=subprocess.STDOUT, cwd=HERE)
        sampler = Sampler(proc.pid, before, ("vllm_mm_", "VLLM_OBJECT_STORAGE"))
        sampler.start()
        try:
            # A server that refused to start (stock vLLM in a small
            # /dev/shm) is recorded with its log, not raised.
            if server_ready(proc, port):
                res["init_s"] = time.monotonic() - t0
                tokens, pass_s = [], []
                pairs = workload.pass_pairs()
                for _ in range(passes):
                    t = time.monotonic()
                    with ThreadPoolExecutor(4) as ex:  # 4 concurrent clients
                        got = list(ex.map(lambda ab: chat(port, list(ab), "what is in the picture"), pairs))
                    pass_s.append(time.monotonic() - t)
                    tokens.append(got)
                single_s, single_tokens = [], []
                for i in range(singles):
                    t = time.monotonic()
                    single_tokens.append(chat(port, [100 + i], "describe the image"))
                    single_s.append(time.monotonic() - t)
                res.update(pass_s=pass_s, single_s=single_s, tokens=tokens, single_tokens=single_tokens)
        finally:
            res["rc"], res["exit_s"] = stop_server(proc)
            # Children the API server left (it SIGKILLs them: none expected).
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(
                role_of(c[1], p, proc.pid) in ("engine_core", "worker")
                for p in list(sampler.cpu)
                if (c := cpu_and_role(p)) is not None
            ):
                time.sleep(0.2)
    return finish(res, sampler, before, probe, proc.pid, log)


# ---- the summary ----


def in_container(size: str) -> None:
    """Re-runs this command in a private mount namespace whose /dev/shm is
    a fresh tmpfs of `size` (what a container gets), so the harness's own
    /dev/shm sampling sees the same one; exits with its status."""
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        sys.exit(f"--shm-size needs a private mount namespace (root and unshare): {probe.stderr.decode().strip()}")
    env = dict(os.environ, PINSHM_E2E_IN_CONTAINER=size)
    script = f'mount -t tmpfs -o size={size} pinshm-e2e /dev/shm && exec "$0" "$@"'
    cmd = ["unshare", "-m", "sh", "-c", script, sys.executable, *sys.argv]
    sys.exit(subprocess.run(cmd, env=env).returncode)


def tiny_model(python: str, model: Path | None, out: Path, image_size: int) -> Path:
    """The tiny LLaVA for `image_size`-px images: `model`, or one in `out`
    (built with build_model.py if missing); exits if it was built for
    another size."""
    default = "tiny-llava" if image_size == 64 else f"tiny-llava-{image_size}"
    model = model or out / default
    if not (model / "BUILT").exists():
        subprocess.run([python, str(HERE / "build_model.py"), str(model), str(image_size)], check=True)
    built = json.loads((model / "BUILT").read_text()).get("image_size", 64)
    if built != image_size:
        sys.exit(f"{model} was built for {built}x{built} images, not --image-size {image_size}")
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=os.environ.get("VLLM_PYTHON"), help="a Python with vLLM and pinshm")
    ap.add_argument("--model", type=Path, default=None, help="model folder (built if missing)")
    ap.add_argument("--out", type=Path, default=Path("e2e-out"))
    ap.add_argument("--quick", action="store_true", help="one pass and one run per configuration")
    ap.add_argument("--modes", default="offline,server")
    ap.add_argument("--configs", default="stock,cache,queue")
    ap.add_argument("--repeat", type=int, default=None, help="runs per configuration (default 3; 1 with --quick)")
    ap.add_argument("--port", type=int, default=18123)
    ap.add_argument(
        "--shm-size",
        default=None,
        help="run everything (this harness, the engines) with a private /dev/shm of this size, "
        "as a container's (64m is Docker's default): unshare -m and a tmpfs, which needs root",
    )
    ap.add_argument("--images", type=int, default=None, help="distinct images per pass (default 12)")
    ap.add_argument(
        "--image-size",
        type=int,
        default=64,
        help="the model's image size, a multiple of 16 (default 64: 48 KiB per cached item; 128: 192 KiB, "
        "so 400 images overflow a 64 MiB /dev/shm); the model is built per size",
    )
    ap.add_argument(
        "--reference",
        type=Path,
        default=None,
        help="runs.json of an earlier run (stock on a roomy /dev/shm) to compare tokens with",
    )
    args = ap.parse_args()
    if args.images is not None:
        os.environ["E2E_IMAGES"] = str(args.images)
    os.environ["E2E_IMAGE_SIZE"] = str(args.image_size)
    if args.shm_size and os.environ.get("PINSHM_E2E_IN_CONTAINER") != args.shm_size:
        in_container(args.shm_size)
    if not args.python:
        sys.exit("give --python (or VLLM_PYTHON): an interpreter with vLLM and pinshm installed")
    args.out.mkdir(parents=True, exist_ok=True)
    model = tiny_model(args.python, args.model, args.out, args.image_size)
    passes, singles = (1, 1) if args.quick else (3, 3)
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    import workload  # after E2E_IMAGES is set
    versions = subprocess.run(
        [args.python, "-c", "import vllm, torch, pinshm; print(vllm.__version__, torch.__version__, pinshm.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    runs = []
    for rep in range(repeat):
        for mode in args.modes.split(","):
            for cfg in args.configs.split(","):
                tag = f"{mode}-{cfg}-{rep}"
                print(f"== {tag}", flush=True)
                if mode == "offline":
                    r = run_offline(args.python, model, cfg, args.out, tag, passes, singles)
                else:
                    r = run_server(args.python, model, cfg, args.out, tag, passes, singles, args.port)
                runs.append(r)
                brief = {k: r.get(k) for k in ("rc", "hits", "items", "detours", "init_s", "pass_s", "exit_s", "shm_peak_queues_mib", "shm_left", "tracebacks", "forced_kills")}
                print(json.dumps(brief), flush=True)
                (args.out / "runs.json").write_text(json.dumps(runs, indent=1, default=str))
    reference = json.loads(args.reference.read_text()) if args.reference else []
    summary, md = summarize(runs, reference)
    shm = f"/dev/shm {args.shm_size} (private tmpfs)" if args.shm_size else "the host's /dev/shm"
    head = (
        f"vLLM {versions[0]}, torch {versions[1]}, pinshm {versions[2]}; {shm}; "
        f"{workload.N_IMAGES} distinct {workload.SIZE}x{workload.SIZE} images per pass; "
        f"{'quick, ' if args.quick else ''}{repeat} run(s) per row, medians\n\n"
    )
    (args.out / "summary.json").write_text(json.dumps({"versions": versions, "rows": summary}, indent=1))
    (args.out / "summary.md").write_text(head + md)
    print(head + md)


if __name__ == "__main__":
    main()
