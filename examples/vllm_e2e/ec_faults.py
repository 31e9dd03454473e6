"""The encoder-cache connector's failure paths in real engines (never CI):
an ``ec_both`` engine A writes the store and holds after its passes; an
``ec_consumer`` engine B then runs its passes over the same images, and

- ``readers``: the store has one reader entry fewer than A and B need
  (``n_readers`` = A's scheduler and workers, plus one): B cannot read it
  on every rank, says so, and runs its encoder;
- ``kill``: A is SIGKILLed (its whole process tree) as soon as B has
  loaded its first output: B's leased loads still read the old segment's
  bytes, and its later lookups are misses;
- ``replace``: as ``kill``, and a new ``ec_both`` engine A' makes a new
  store under the same name at once: B moves to it.

Each run ends with B's outcome: its exit code, whether every request that
completed (finish reason not ``error``) has stock's tokens, the requests
that ended in error, its encoder items, hits and loads per pass, and
tracebacks. A stock engine runs first for the tokens.

    python ec_faults.py --python /path/to/venv/bin/python [--out DIR]
        [--faults readers,kill,replace] [--tp 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import ec
import run as harness

FAULTS = ("readers", "kill", "replace")


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (read from /proc)."""
    children: dict[int, list[int]] = {}
    for e in os.scandir("/proc"):
        if e.name.isdigit():
            try:
                stat = Path(e.path, "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(e.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def kill_tree(pid: int) -> None:
    for p in descendants(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def first_load(probe: Path, timeout: float = 1800) -> bool:
    """Until the engine's probe records a load by the connector."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe.exists() and any('"ec_load"' in x for x in probe.read_text().splitlines()):
            return True
        time.sleep(0.05)  # polling another process's progress, not a test
    return False


def outcome(r: dict, stock: dict) -> dict:
    """B's result against stock's: completed requests' tokens, errors."""
    tokens, finish = r.get("tokens") or [], r.get("finish") or []
    same, errors = True, 0
    for p, (toks, reasons) in enumerate(zip(tokens, finish)):
        for i, (t, why) in enumerate(zip(toks, reasons)):
            if why == "error":
                errors += 1
            elif t != stock["tokens"][p][i]:
                same = False
    return {"completed_tokens_equal_stock": same if tokens else None, "errors": errors}


def fault_run(py, model, fault, out, passes, batched, tp, extra, item_bytes) -> dict:
    ec_a, store = ec.ec_config("ec-pinshm", out, f"fault-{fault}", item_bytes)
    assert ec_a is not None and store is not None
    if fault == "readers":
        ec_a["ec_connector_extra_config"]["n_readers"] = 1 + tp + 1
    ec_b = json.loads(json.dumps(ec_a))
    ec_b["ec_role"] = "ec_consumer"
    hold = out / f"fault-{fault}.hold"
    hold.write_text("")
    engines = []
    a = ec.Engine(py, model, ec_a, out, f"fault-{fault}-A", passes, 0, batched, extra, hold=hold, store=store, tp=tp)
    engines.append(a)
    try:
        if not a.wait_result():
            raise RuntimeError(f"{fault}: engine A stopped before its passes were done (see {a.log})")
        b = ec.Engine(py, model, ec_b, out, f"fault-{fault}-B", passes, 0, batched, extra, store=store, tp=tp)
        engines.append(b)
        if fault in ("kill", "replace"):
            if not first_load(b.probe):
                raise RuntimeError(f"{fault}: engine B loaded nothing (see {b.log})")
            kill_tree(a.proc.pid)
            if fault == "replace":
                tag = f"fault-{fault}-A2"
                engines.append(ec.Engine(py, model, ec_a, out, tag, 1, 0, batched, extra, hold=hold, store=store, tp=tp))
        rb = b.finish()
    finally:
        hold.unlink(missing_ok=True)
    for e in engines:
        if e is not b:
            try:
                e.finish(timeout=600)
            except Exception:  # noqa: BLE001 - killed, or stuck: gone either way
                kill_tree(e.proc.pid)
    rb["store_left"] = os.path.exists(f"/dev/shm/{store}")
    said = [x.strip()[-240:] for x in Path(b.log).read_text().splitlines() if "cannot read store" in x]
    rb["said"] = said[:3]
    return rb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=os.environ.get("VLLM_PYTHON"), help="a Python with vLLM and pinshm")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("e2e-out"))
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args()
    if not args.python:
        raise SystemExit("give --python (or VLLM_PYTHON): an interpreter with vLLM and pinshm installed")
    args.out.mkdir(parents=True, exist_ok=True)
    model = harness.tiny_model(args.python, args.model, args.out, 64)
    batched, item_bytes = 64, 16 * 128 * 4
    extra = ["--max-model-len", "256"]
    stock = ec.Engine(args.python, model, None, args.out, "fault-stock", args.passes, 0, batched, extra, tp=args.tp)
    rs = stock.finish()
    rows = []
    for fault in args.faults.split(","):
        if fault not in FAULTS:
            raise SystemExit(f"unknown fault {fault!r}: one of {', '.join(FAULTS)}")
        print(f"== {fault}", flush=True)
        r = fault_run(args.python, model, fault, args.out, args.passes, batched, args.tp, extra, item_bytes)
        r.update(outcome(r, rs))
        brief = {k: r.get(k) for k in ("rc", "completed_tokens_equal_stock", "errors", "encoded", "ec_hits",
                                       "lookups", "loaded", "tracebacks", "store_left", "said")}  # fmt: skip
        print(json.dumps(brief), flush=True)
        rows.append((fault, brief))
    md = ["| fault | B's exit | completed requests' tokens = stock | errors | encoder items per pass | hits / lookups | loaded | tracebacks |", "|" + "---|" * 8]  # fmt: skip
    for fault, b in rows:
        hits = ", ".join(f"{h}/{n}" for h, n in zip(b.get("ec_hits") or [], b.get("lookups") or []))
        md.append(
            f"| {fault} | {b['rc']} | {b['completed_tokens_equal_stock']} | {b['errors']} | {b['encoded']} | "
            f"{hits} | {b['loaded']} | {b['tracebacks']} |"
        )
    text = f"stock encoder items per pass: {rs.get('encoded')}; TP={args.tp}\n\n" + "\n".join(md) + "\n"
    (args.out / "ec-faults.md").write_text(text)
    (args.out / "ec-faults.json").write_text(json.dumps(rows, indent=1, default=str))
    print(text)


if __name__ == "__main__":
    main()
