"""Two nodes on one machine, by hand (not in CI): the encoder cache across
nodes over NIXL (docs/remote.md) with real vLLM engines on the tiny LLaVA
model, TP=2, offline (offline.py).

- ``stock``: no connector, for the tokens;
- node A (a mount namespace with its own /dev/shm): an ``ec_both`` engine
  that serves its store (``serve``), one pass, then held;
- node B (another namespace): an ``ec_consumer`` engine B1 listing A as
  its peer, two passes, then held; node A is SIGKILLed; then a second
  consumer engine B2 in node B, one pass.
- node C serving and node D fetching from it, C SIGKILLed as D fetches;
- ``E``: a producer that serves without a secret, which must refuse to
  start (docs/security.md).

Every node shares one secret file (``secret_file``), made here, mode 0600.

    PYTHONPATH=/path/with/pinshm-and-nixl python ec_remote.py --python /venv/bin/python --out DIR

Prints a table per engine: encoder items per pass (the most any worker
ran), has_cache_item hits, tokens against stock's, exit code; and writes
``remote-summary.json`` to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import run as harness
from ec import encoder_counts

HERE = Path(__file__).resolve().parent
MODULE = "pinshm.vllm.ec_connector"


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_secret(out: Path) -> Path:
    """The nodes' shared secret file in `out`: 32 random bytes, mode 0600."""
    secret = out / "ec-secret"
    secret.unlink(missing_ok=True)
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    return secret


def start(py, model, out, tag, ec, passes, hold=None, prefix=(), ready=None):
    """An engine, its command after `prefix` (a namespace to run in)."""
    probe, result, log = out / f"{tag}.probe.jsonl", out / f"{tag}.json", out / f"{tag}.log"
    for p in (probe, result):
        p.unlink(missing_ok=True)
    cmd = [*prefix, py, str(HERE / "offline.py"), str(model), str(result), "--passes", str(passes), "--singles", "0"]
    cmd += ["--max-batched-tokens", "64", "--tp", "2", "--max-model-len", "256"]
    if ec is not None:
        cmd += ["--ec", json.dumps(ec)]
    if hold is not None:
        cmd += ["--hold", str(hold)]
    if ready is not None:
        cmd += ["--ready-file", str(ready)]
    env = harness.base_env("stock", probe)  # no pinshm plugin: the connector alone
    lf = open(log, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT, cwd=HERE, start_new_session=True)
    return dict(tag=tag, proc=proc, probe=probe, result=result, log=log)


def wait_result(e, timeout=1200):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not e["result"].exists() and e["proc"].poll() is None:
        time.sleep(0.5)  # polling another process's progress
    return e["result"].exists()


#: What a consumer logs when its first output from a peer is published.
FIRST_FETCH = "first output fetched from peer"


def wait_line(e, text, timeout=600):
    """Waits until engine `e`'s log holds `text` (or it exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and e["proc"].poll() is None:
        if text in e["log"].read_text(errors="replace"):
            return True
        time.sleep(0.01)  # polling another process's progress
    return False


def summary(e, stock_tokens):
    rc = e["proc"].wait(timeout=600)
    res = {"engine": e["tag"], "rc": rc}
    if e["result"].exists():
        r = json.loads(e["result"].read_text())
        res["tokens_equal_stock"] = stock_tokens is None or r.get("tokens") == stock_tokens[: len(r.get("tokens", []))]
        res.update(encoder_counts(e["probe"], r.get("pass_t", [])))
        res["_tokens"] = r.get("tokens")
    res["tracebacks"] = e["log"].read_text(errors="replace").count("Traceback")
    return res


WHAT = {
    "stock": "stock (no connector)",
    "A": "node A: ec_both, serves; SIGKILLed after B1's passes",
    "B1": "node B: ec_consumer, peers [A]",
    "B2": "node B: a second ec_consumer, started after A was killed",
    "C": "node C: ec_both, serves; SIGKILLed during D's first pass, as D logs its first fetch from C",
    "D": "node D: ec_consumer, peers [C], its peer killed mid-pass",
    "E": "node E: ec_both, serves without a secret (must refuse to start)",
}


def table(runs):
    rows = [
        "| engine | exit | tokens = stock | encoder items per pass | hits / lookups per pass | of which fetched from a peer | loaded | tracebacks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        hits = ", ".join(f"{h}/{n}" for h, n in zip(r.get("ec_hits") or [], r.get("lookups") or []))
        rows.append(
            f"| {WHAT.get(r['engine'], r['engine'])} | {r['rc']} | "
            f"{'refused at start' if r.get('refused') else r.get('tokens_equal_stock')} | "
            f"{r.get('encoded')} | {hits} | {r.get('fetched')} | {r.get('loaded')} | {r['tracebacks']} |"
        )
    return "\n".join(rows) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", required=True)
    ap.add_argument("--out", type=Path, default=Path("e2e-remote"))
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument(
        "--kill-after",
        type=float,
        default=None,
        help="seconds after D's engine is built that C dies (default: as D logs its first fetch from C)",
    )
    ap.add_argument("--shm", default="512m", help="each node's /dev/shm (a tmpfs of this size)")
    ap.add_argument(
        "--default-sizes",
        action="store_true",
        help="A and B name no 'size': the reserved store's default must fit --shm (try --shm 1g)",
    )
    ap.add_argument("--only-ab", action="store_true", help="nodes A and B only (no C, D, E)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    model = harness.tiny_model(args.python, args.model, out, 64)
    port = free_port()
    ns = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size={args.shm} pinshm-node /dev/shm && exec "$@"', "sh"]
    runs = []
    stock = start(args.python, model, out, "stock", None, 2)
    runs.append(summary(stock, None))
    stock_tokens = runs[0].pop("_tokens", None)
    store = f"pinshm_ec_remote_{os.getpid()}"
    secret = make_secret(out)
    ec_a = {
        "ec_connector": "PinshmECConnector",
        "ec_connector_module_path": MODULE,
        "ec_role": "ec_both",
        "ec_connector_extra_config": {
            "store": store,
            "size": "64m",
            "serve": f"127.0.0.1:{port}",
            "secret_file": str(secret),
        },
    }
    ec_b = {
        "ec_connector": "PinshmECConnector",
        "ec_connector_module_path": MODULE,
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {
            "store": store,
            "size": "64m",
            "peers": [f"127.0.0.1:{port}"],
            "secret_file": str(secret),
        },
    }
    if args.default_sizes:
        for ec in (ec_a, ec_b):
            del ec["ec_connector_extra_config"]["size"]
    hold_a, hold_b = out / "hold-A", out / "hold-B"
    hold_a.write_text("")
    hold_b.write_text("")
    # Node A and node B: each engine in a mount namespace of its own (B1
    # and B2 share B's: B2 starts inside B1's namespace through nsenter).
    a = start_ns(ns, args.python, model, out, "A", ec_a, 1, hold_a)
    assert wait_result(a), "node A did not finish its pass"
    b1 = start_ns(ns, args.python, model, out, "B1", ec_b, 2, hold_b)
    assert wait_result(b1), "B1 did not finish its passes"
    os.killpg(a["proc"].pid, signal.SIGKILL)  # node A dies; B carries on
    b2 = start_ns(["nsenter", "-m", "-t", str(b1["proc"].pid)], args.python, model, out, "B2", ec_b, 1)
    wait_result(b2)
    hold_b.unlink()
    for e in (a, b2, b1):
        runs.append(summary(e, stock_tokens))
        runs[-1].pop("_tokens", None)
    if args.only_ab:
        report(args, out, runs)
        return
    # Nodes C and D: a producer killed while its consumer's first pass
    # fetches from it (--kill-after s after D's engine is built): misses only.
    port_c = free_port()
    store_c = f"{store}_c"
    extra_c = {"store": store_c, "size": "64m", "secret_file": str(secret)}
    ec_c = {**ec_a, "ec_connector_extra_config": {**extra_c, "serve": f"127.0.0.1:{port_c}"}}
    ec_d = {**ec_b, "ec_connector_extra_config": {**extra_c, "peers": [f"127.0.0.1:{port_c}"]}}
    hold_c, ready_d = out / "hold-C", out / "ready-D"
    hold_c.write_text("")
    ready_d.unlink(missing_ok=True)
    c = start_ns(ns, args.python, model, out, "C", ec_c, 1, hold_c)
    assert wait_result(c), "node C did not finish its pass"
    d = start(args.python, model, out, "D", ec_d, 2, None, ns, ready_d)
    while not ready_d.exists() and d["proc"].poll() is None:
        time.sleep(0.05)  # polling another process's progress
    if args.kill_after is not None:
        time.sleep(args.kill_after)
    else:
        wait_line(d, FIRST_FETCH)
    os.killpg(c["proc"].pid, signal.SIGKILL)  # node C dies during D's first pass
    wait_result(d)
    for e in (c, d):
        runs.append(summary(e, stock_tokens))
        runs[-1].pop("_tokens", None)
    # E: serves without a secret: refused at start, saying what to set.
    ec_e = {**ec_a, "ec_connector_extra_config": {"store": f"{store}_e", "size": "64m", "serve": f"127.0.0.1:{port}"}}
    e = start_ns(ns, args.python, model, out, "E", ec_e, 1)
    e["proc"].wait(600)
    said = e["log"].read_text(errors="replace")
    runs.append(
        dict(engine="E", rc=e["proc"].returncode, tracebacks=said.count("Traceback"), refused="secret_file" in said)
    )
    report(args, out, runs)


def report(args, out, runs):
    (out / "remote-summary.json").write_text(json.dumps(runs, indent=1, default=str))
    code = "import vllm, torch, pinshm; print(vllm.__version__, torch.__version__, pinshm.__version__)"
    versions = subprocess.run([args.python, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    md = (
        f"vLLM {versions[0]}, torch {versions[1]}, pinshm {versions[2]}; tiny LLaVA, TP=2 offline, 64-px images, "
        f"vLLM's encoder cache 4 images; each node its own mount namespace and /dev/shm of {args.shm}; "
        f"{'default store sizes; ' if args.default_sizes else ''}NIXL (UCX TCP, 127.0.0.1). "
        f"`python ec_remote.py --python PY --out DIR{' --shm ' + args.shm if args.shm != '512m' else ''}"
        f"{' --default-sizes' if args.default_sizes else ''}{' --only-ab' if args.only_ab else ''}`\n\n" + table(runs)
    )
    (out / "remote-summary.md").write_text(md)
    print(md)


def start_ns(prefix, py, model, out, tag, ec, passes, hold=None):
    return start(py, model, out, tag, ec, passes, hold, prefix)


if __name__ == "__main__":
    sys.exit(main())
