#!/usr/bin/env python3
"""The markdown table of the hot-path rows of `examples/bench.rs`
(`--hot-only --json`), from a results file of JSON lines, each a bench row
with the `label` ("before" / "after"), `run`, `commit` and `layout_version`
of the run it came from (standard library only).

    python3 examples/bench_hot_table.py docs/bench_hot.json

Each cell is the median over the file's runs of that label: of the runs'
medians (ns), and of the ratios each run took to its own baseline."""
import json
import statistics
import sys
from collections import defaultdict

# (row name, how a bench row is recognised, what its ratio is to)
ROWS = [
    ("read protocol floor (hazard, fence, id, hold, clear, unhold)", lambda r: r["op"] == "read_floor", "floor"),
    ("`get_guard` (get, drop), 1 object", lambda r: r["op"] == "get_guard" and "floor_ns" in r, "floor"),
    ("`get_guard`, 1000 objects (keys bench)", lambda r: r["op"] == "get_guard" and "objects" in r, "get_guard"),
    ("`lookup` (key to handle)", lambda r: r["op"] == "lookup", "get_guard"),
    ("`get_key` (look up, hold, drop)", lambda r: r["op"] == "get_key", "get_guard"),
    ("`lease_key`", lambda r: r["op"] == "lease_key", "get_guard"),
    ("`put` 4 KiB, 1 reader", lambda r: r["op"] == "put_readers" and r["readers"] == 1, "1 reader"),
    ("`put` 4 KiB, 8 readers", lambda r: r["op"] == "put_readers" and r["readers"] == 8, "1 reader"),
    ("`put` 4 KiB, 32 readers", lambda r: r["op"] == "put_readers" and r["readers"] == 32, "1 reader"),
    ("fingerprint: keyed SHA-256 (layout 8)", lambda r: r["op"] == "fp_sha256", "SHA-256"),
    ("fingerprint: SipHash-1-3, 128-bit", lambda r: r["op"] == "fp_siphash13_128", "SHA-256"),
    ("fingerprint: SipHash-2-4, 128-bit", lambda r: r["op"] == "fp_siphash24_128", "SHA-256"),
    ("fingerprint: keyed BLAKE3", lambda r: r["op"] == "fp_blake3_keyed", "SHA-256"),
    ("fingerprint: shipped (`FingerprintKey`, SipHash-1-3)", lambda r: r["op"] == "fp_shipped", "SHA-256"),
]


def main(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    labels = ["before", "after"]
    for lab in labels:
        runs = {r["run"] for r in rows if r["label"] == lab}
        stamps = sorted({(r["commit"], r["layout_version"]) for r in rows if r["label"] == lab})
        print(f"- {lab}: {len(runs)} runs; commit, layout: {', '.join(f'{c}, {v}' for c, v in stamps)}")
    print()
    med = statistics.median
    print("| op | before: ns | before: ratio | after: ns | after: ratio | ratio to |")
    print("|---|---|---|---|---|---|")
    for name, match, base in ROWS:
        cells = []
        for lab in labels:
            hit = [r for r in rows if r["label"] == lab and match(r)]
            ratios = [r["ratio"] for r in hit if r["ratio"] is not None]
            if hit:
                cells.append(f"{med(r['median_ns'] for r in hit):.1f}")
                cells.append(f"{med(ratios):.2f}" if ratios else "—")
            else:
                cells += ["—", "—"]
        print(f"| {name} | {' | '.join(cells)} | {base} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/bench_hot.json")
