"""Renderer of tools/figures.py for SGLang end to end (docs/sglang.md).

The results file holds `runs`: each a list of rows that
`examples/sglang_e2e/run.py` wrote to its RESULTS.json, one run per
invocation, labelled `shm` ("host" or "64 MiB") and `kill` (a SIGKILL
mid-burst). Several runs of the same kind are repeats: each median is
over them, and each ratio is taken to stock in the same run first.
Standard library only.
"""

from __future__ import annotations

import statistics
from typing import Any


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _ratio(config: str, xs: list[float]) -> str:
    return "" if config == "stock" else f" ({_med(xs):.2f}×)"


def r_sglang(data: Any) -> str:
    runs = data["runs"]
    keys = sorted({(run["shm"], r["tp"]) for run in runs if not run.get("kill") for r in run["rows"]})
    out = [
        "| /dev/shm | TP | config | tokens = stock's | `sgl_shm_mm_*` segments per request | features put / sent "
        "| TTFT, sequential (× stock) | burst requests/s (× stock) | left in /dev/shm after SIGKILL mid-burst |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for shm, tp in keys:
        same = [run for run in runs if run["shm"] == shm and not run.get("kill")]
        killed = [run for run in runs if run.get("kill")]
        for config in ("stock", "pinshm"):
            rows, ratios_ttft, ratios_rps, tokens, segs, put, sent = [], [], [], [], [], [], []
            for run in same:
                by = {(r["tp"], r["config"]): r for r in run["rows"] if "sequential" in r}
                r, s = by.get((tp, config)), by.get((tp, "stock"))
                if r is None or s is None:
                    continue
                rows.append(r)
                ttft = _med([x["ttft_s"] for x in r["sequential"]])
                ttft_s = _med([x["ttft_s"] for x in s["sequential"]])
                ratios_ttft.append(ttft / ttft_s)
                ratios_rps.append(r["burst"]["requests_per_s"] / s["burst"]["requests_per_s"])
                want = {x["image"]: x["ids"] for x in s["sequential"]}
                tokens.append(all(x["ids"] == want.get(x["image"]) for x in r["sequential"]))
                segs += [x["segments"]["sgl_shm_mm_"] for x in r["sequential"]]
                if "store" in r:
                    put.append(r["store"]["puts"])
                    sent.append(len(r["sequential"]) + r["burst"]["requests"])
            if not rows:
                continue
            left = [
                ", ".join(r["left_in_dev_shm"]) or "nothing"
                for run in killed
                for r in run["rows"]
                if (r["tp"], r["config"]) == (tp, config) and run["shm"] == shm
            ]
            ttft_ms = _med([_med([x["ttft_s"] for x in r["sequential"]]) for r in rows]) * 1000
            rps = _med([r["burst"]["requests_per_s"] for r in rows])
            out.append(
                f"| {shm} | {tp} | {config} | {'yes' if all(tokens) else 'NO'} | {_med(segs):.0f} "
                f"| {f'{sum(put)} / {sum(sent)}' if put else '-'} "
                f"| {ttft_ms:.0f} ms{_ratio(config, ratios_ttft)} | {rps:.1f}{_ratio(config, ratios_rps)} "
                f"| {'; '.join(left) or 'not run'} |"
            )
    n = {shm: sum(1 for run in runs if run["shm"] == shm and not run.get("kill")) for shm, _ in keys}
    note = ", ".join(f"{k} /dev/shm: {v}" for k, v in n.items())
    return (
        "\n".join(out)
        + f"\n\nRuns of each server (medians over them; each ratio to stock in the same run first): {note}.\n"
    )


RENDERERS = {"sglang": r_sglang}
