#!/usr/bin/env python3
"""The GPU kit's log (`bash target/gpu-kit/run.sh | tee LOG`) as a results
file for tools/figures.py (the `gpu-kit` figure of docs/gpu.md):

    tools/gpu_kit_results.py LOG --command "..." > docs/results/gpu_kit.json

It keeps what the kit measured beside its baseline in the same run:
the bandwidth table (pinned slot against pageable memory, each way), host
registration, pack/unpack against 1,000 copies, and the Python steps'
figure lines (vLLM's path against the slot's, a save's step against the
step alone). A log without the kit's summary line is refused. The layout
version is the bench's (`commit ..., layout version N`), the commit the
kit's. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

NUM = r"([0-9.]+)"


def parse(text: str) -> dict:
    summary = re.search(r"^pinshm GPU kit: (PASS|FAIL)[^\n]*", text, re.M)
    if not summary:
        raise SystemExit("no 'pinshm GPU kit:' summary line: not a whole kit log")
    out: dict = {"summary": summary.group(0)}
    m = re.search(r"commit (\S+), layout version (\d+)", text)
    commit = re.search(r"^kit: .*\(commit (\S+)\)", text, re.M)
    out["stamp"] = {
        "commit": commit.group(1) if commit else (m.group(1) if m else "?"),
        "layout_version": int(m.group(2)) if m else None,
    }
    smi = re.search(r"^0, ([^,]+), ([0-9.]+), ([0-9.]+), (\d+) MiB", text, re.M)
    api = re.search(r"CUDA driver API version: (\S+)", text)
    src = re.search(r"kernels loaded from: (.+)", text)
    out["device"] = {
        "name": smi.group(1) if smi else "?",
        "driver": smi.group(2) if smi else "?",
        "compute_capability": smi.group(3) if smi else "?",
        "cuda_driver_api": api.group(1) if api else "?",
        "kernels": src.group(1).strip() if src else "?",
    }
    rows = []
    for r in re.finditer(
        rf"^\s*(\d+) \|\s+{NUM} GB/s\s+{NUM} GB/s \|\s+{NUM} GB/s\s+{NUM} GB/s \|\s+{NUM} GB/s\s+{NUM} GB/s$",
        text,
        re.M,
    ):
        mib, *v = r.groups()
        keys = ["d2h_slot", "d2h_pageable", "slot_h2d", "pageable_h2d", "put_wall", "get_wall"]
        rows.append({"mib": int(mib), **{k: float(x) for k, x in zip(keys, v)}})
    if not rows:
        raise SystemExit("no bandwidth table in the log")
    out["bandwidth_gbps"] = rows
    reg = re.search(rf"registration .*?: {NUM} s per GiB; unregister {NUM} s per GiB", text)
    if reg:
        out["register_s_per_gib"], out["unregister_s_per_gib"] = float(reg.group(1)), float(reg.group(2))
    pack = re.search(rf"pack {NUM} ms vs 1,000 D2H copies {NUM} ms; unpack {NUM} ms vs 1,000 H2D copies {NUM} ms", text)
    if pack:
        out["pack_ms"] = dict(zip(["pack", "d2h_copies", "unpack", "h2d_copies"], map(float, pack.groups())))
    # The Python steps' figure lines, as printed.
    wanted = re.compile(
        r"^(vLLM path|pinned slot|ratio vLLM path|save |D2H into torch|load |step |the same into|\[info\] (h2d|d2h) )"
    )
    out["python_lines"] = [line.strip() for line in text.splitlines() if wanted.match(line.strip())]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--command", required=True, help="what made the log, for the stamp")
    ap.add_argument("--commit", help="the commit whose tree the kit was built from, where the log's is +dirty")
    a = ap.parse_args()
    with open(a.log, encoding="utf-8", errors="replace") as f:
        out = parse(f.read())
    out["stamp"]["command"] = a.command
    if a.commit:
        out["stamp"]["commit"] = a.commit
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
