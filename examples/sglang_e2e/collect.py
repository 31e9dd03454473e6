#!/usr/bin/env python3
"""Gathers run.py's RESULTS.json files into one results file, each run
labelled (its /dev/shm and deployment), for tools/figures.py:

    python3 examples/sglang_e2e/collect.py [--commit SHA] OUT.json "host, TP=1 and 2=DIR1/RESULTS.json" ...

then `tools/figures.py --stamp OUT.json --command "..."`, which stamps the
checkout's commit unless `--commit` named the one the runs measured.
Standard library only."""

from __future__ import annotations

import json
import sys


#: What a run's own paths become in the results (a machine's paths stay on it).
PLACEHOLDERS = {"--python": "VENV/bin/python", "--model": "MODEL", "--out": "OUT", "--images": "IMAGES"}


def _placeholders(argv: list[str]) -> list[str]:
    out = []
    for i, a in enumerate(argv):
        flag = argv[i - 1] if i else ""
        out.append(PLACEHOLDERS.get(flag, "PATH") if a.startswith("/") else a)
    return out


def main() -> int:
    args = sys.argv[1:]
    commit = None
    if args[:1] == ["--commit"] and len(args) > 1:
        commit, args = args[1], args[2:]
    if len(args) < 2 or not all("=" in a for a in args[1:]):
        print(__doc__)
        return 2
    runs = []
    for arg in args[1:]:
        label, _, path = arg.rpartition("=")
        with open(path) as f:
            got = json.load(f)
        meta = dict(got["meta"], argv=_placeholders(got["meta"].get("argv", [])))
        runs.append({"label": label, "meta": meta, "rows": got["rows"]})
    whole: dict = {"runs": runs}
    if commit:
        whole["stamp"] = {"commit": commit}
    with open(args[0], "w") as f:
        json.dump(whole, f, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
