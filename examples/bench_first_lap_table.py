#!/usr/bin/env python3
"""The markdown table of `examples/bench_first_lap.rs`'s results file
(standard library only).

    python3 examples/bench_first_lap_table.py docs/bench_first_lap.json

Each (label, size, mode) cell is the median, over the runs in the file, of
the run's medians; ratios are taken per run, then their median."""

import json
import statistics
import sys
from collections import defaultdict


def size_name(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main(path):
    runs = defaultdict(list)
    stamps = defaultdict(set)
    for line in open(path):
        if line.strip():
            r = json.loads(line)
            runs[(r["label"], r["size"], r["mode"])].append(r)
            stamps[r["label"]].add((r["layout"], r["commit"], r["repeats"], r["gap_ms"] or None))
    labels = sorted({k[0] for k in runs}, key=lambda lab: (lab != "before", lab))
    for lab in labels:
        layouts = sorted({s[0] for s in stamps[lab]})
        commits = sorted({s[1] for s in stamps[lab]})
        reps = sorted({s[2] for s in stamps[lab]})
        gaps = sorted({s[3] for s in stamps[lab] if s[3]})
        n = max(len(v) for k, v in runs.items() if k[0] == lab)
        print(f"- {lab}: layout {layouts}, commit {commits}, {n} runs of {reps} interleaved repeats, gap {gaps} ms")
    print()
    med = statistics.median
    head = (
        "| size | mode | code | memcpy µs | put, fresh sparse µs | put, backed µs "
        "| sparse / backed | sparse / memcpy | backed / memcpy |"
    )
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    keys = sorted({(k[1], k[2]) for k in runs}, key=lambda k: (k[1] != "gap", k[0]))
    for size, mode in keys:
        for lab in labels:
            rs = runs.get((lab, size, mode))
            if not rs:
                continue

            def m(f, rs=rs):
                return med(f(r) for r in rs)

            print(
                f"| {size_name(size)} | {mode} | {lab} | {m(lambda r: r['memcpy_ns']) / 1e3:.1f} "
                f"| {m(lambda r: r['sparse_put_ns']) / 1e3:.1f} | {m(lambda r: r['backed_put_ns']) / 1e3:.1f} "
                f"| {m(lambda r: r['sparse_put_ns'] / r['backed_put_ns']):.2f} "
                f"| {m(lambda r: r['sparse_put_ns'] / r['memcpy_ns']):.2f} "
                f"| {m(lambda r: r['backed_put_ns'] / r['memcpy_ns']):.2f} |"
            )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/bench_first_lap.json")
