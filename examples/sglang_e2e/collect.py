#!/usr/bin/env python3
"""Gathers run.py's RESULTS.json files into one results file, each run
labelled (its /dev/shm and deployment), for tools/figures.py:

    python3 examples/sglang_e2e/collect.py OUT.json "host, TP=1 and 2=DIR1/RESULTS.json" "64 MiB=DIR2/RESULTS.json" ...

then `tools/figures.py --stamp OUT.json --command "..."`. Standard library only."""

from __future__ import annotations

import json
import sys


def main() -> int:
    if len(sys.argv) < 3 or not all("=" in a for a in sys.argv[2:]):
        print(__doc__)
        return 2
    runs = []
    for arg in sys.argv[2:]:
        label, _, path = arg.rpartition("=")
        with open(path) as f:
            got = json.load(f)
        runs.append({"label": label, "meta": got["meta"], "rows": got["rows"]})
    with open(sys.argv[1], "w") as f:
        json.dump({"runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
