"""Renderers of tools/figures.py for the hit-rate and fragmentation runs
(docs/hit_rate.md).

`examples/bench_hitrate.py --json` writes a `{"meta": ...}` row (its seeds)
and one row per (alpha, capacity, store); a results file may hold the runs
of several trace seeds one after another, each opened by its `meta` row.
`cargo run --release --example fragmentation -- --json` writes one row per
(mode, target, seed). Standard library only.
"""

from __future__ import annotations

import statistics
from typing import Any

STORES = ["ideal_fifo", "ideal_clock", "fifo", "second_chance", "vllm", "vllm_mos128"]


def _seeds(data: list[dict], in_use: bool = False) -> list[dict[tuple[float, float, str], dict]]:
    """One {(alpha, capacity, store): row} per seed run, in file order: the
    runs with nothing in use, or (`in_use`) those with `--in-use`."""
    out: list[tuple[bool, dict]] = []
    for r in data:
        if "meta" in r:
            out.append((bool(r["meta"].get("in_use")), {}))
        elif "store" in r:
            if not out:
                out.append((False, {}))
            out[-1][1][(r["alpha"], r["capacity_frac"], r["store"])] = r
            if r.get("in_use"):
                out[-1] = (True, out[-1][1])
    return [run for u, run in out if u == in_use and run]


def _cells(runs: list[dict]) -> list[tuple[float, float]]:
    return sorted({(a, c) for run in runs for a, c, _ in run})


def _stores(runs: list[dict]) -> list[str]:
    seen = {s for run in runs for _, _, s in run}
    return [s for s in STORES if s in seen] + sorted(seen - set(STORES))


def _pct(xs: list[float], sign: bool = False) -> str:
    f = "{:+.1f}" if sign else "{:.1f}"
    m = f.format(statistics.median(xs))
    if len(xs) == 1:
        return m
    sep = "…" if sign else "–"
    return f"{m} ({f.format(min(xs))}{sep}{f.format(max(xs))})"


def r_hitrate(data: list[dict], in_use: bool = False) -> str:
    """Hit rate in % per store: the median over the seeds (range); `[n]`:
    puts refused as full (median), where any were."""
    runs = _seeds(data, in_use)
    stores = _stores(runs)
    out = ["| α | cache | " + " | ".join(stores) + " |", "|---|---|" + "---|" * len(stores)]
    for a, c in _cells(runs):
        row = []
        for s in stores:
            rs = [run[(a, c, s)] for run in runs if (a, c, s) in run]
            cell = _pct([100 * r["hit_rate"] for r in rs]) if rs else ""
            full = statistics.median(r.get("full", 0) for r in rs) if rs else 0
            row.append(cell + (f" [{full:.0f}]" if full else ""))
        out.append(f"| {a} | {c * 100:.0f}% | " + " | ".join(row) + " |")
    full = sum(r.get("full", 0) for run in runs for r in run.values() if not r["store"].startswith("ideal"))
    out.append("")
    out.append(f"{len(runs)} trace seed(s); puts refused as full, over every store but the ideal ones: {full}.")
    return "\n".join(out) + "\n"


DIFFS = [
    ("second_chance − fifo", "second_chance", "fifo"),
    ("ideal_clock − ideal_fifo (policy)", "ideal_clock", "ideal_fifo"),
    ("ideal_clock − second_chance (placement)", "ideal_clock", "second_chance"),
    ("fifo − vllm", "fifo", "vllm"),
    ("fifo − vllm_mos128", "fifo", "vllm_mos128"),
]


def r_hitrate_diffs(data: list[dict]) -> str:
    """Paired differences on the same trace, in points: the median of the
    per-seed differences (range); and the misses second chance saves,
    (second_chance − fifo) / (1 − fifo)."""
    runs = _seeds(data)
    have = {s for run in runs for _, _, s in run}
    diffs = [d for d in DIFFS if d[1] in have and d[2] in have]
    out = [
        "| α | cache | " + " | ".join(d[0] for d in diffs) + " | misses saved by second_chance |",
        "|---|---|" + "---|" * (len(diffs) + 1),
    ]
    for a, c in _cells(runs):
        row = [
            _pct([100 * (run[(a, c, x)]["hit_rate"] - run[(a, c, y)]["hit_rate"]) for run in runs], True)
            for _, x, y in diffs
        ]
        saved = [
            (run[(a, c, "second_chance")]["hit_rate"] - run[(a, c, "fifo")]["hit_rate"])
            / (1 - run[(a, c, "fifo")]["hit_rate"])
            for run in runs
        ]
        out.append(f"| {a} | {c * 100:.0f}% | " + " | ".join(row) + f" | {100 * statistics.median(saved):.1f} % |")
    return "\n".join(out) + "\n"


def r_hitrate_headline(data: list[dict]) -> str:
    """The README's rows: second chance over FIFO, and FIFO over vLLM's
    store (at its best max_object_size), medians of the paired differences;
    with items in use, the share of vLLM's misses it refuses as full, and
    pinshm's refused puts."""
    runs = _seeds(data)

    def med(x: str, y: str) -> list[float]:
        return [
            statistics.median(100 * (run[(a, c, x)]["hit_rate"] - run[(a, c, y)]["hit_rate"]) for run in runs)
            for a, c in _cells(runs)
        ]

    sc, fv = med("second_chance", "fifo"), med("fifo", "vllm")
    caps = sorted({c for _, c in _cells(runs)})
    out = [
        "| as vLLM's processor cache (Zipf) | figure |",
        "|---|---|",
        f"| hit rate, cache {caps[0] * 100:.0f}–{caps[-1] * 100:.0f} % of the catalog "
        f"| second-chance eviction {min(sc):+.1f} to {max(sc):+.1f} points over FIFO; FIFO itself "
        f"{min(fv):+.1f} to {max(fv):+.1f} over vLLM's store (medians of {len(runs)} trace seeds) |",
    ]
    share, ours, counted = [], 0, 0
    for run in _seeds(data, in_use=True):
        for (a, c, s), r in run.items():
            misses = r["requests"] - r["hits"]
            if s == "vllm" and misses:
                share.append(100 * r.get("full", 0) / misses)
            if s in ("fifo", "second_chance"):
                ours += r.get("full", 0)
                counted += r["requests"]
    if share:
        out.append(
            f"| with 10 % of items in use | vLLM's store refuses {min(share):.0f}–{max(share):.0f} % of its misses "
            f"as full; pinshm {ours} of {counted:,} requests (FIFO and second chance) |"
        )
    return "\n".join(out) + "\n"


def r_fragmentation(data: list[dict]) -> str:
    """The fragmentation example's table (medians over its seeds), and the
    failed puts per seed where any failed."""
    cells: dict[tuple[str, float], list[dict]] = {}
    for r in data:
        cells.setdefault((r["mode"], r["target_in_use"]), []).append(r)
    first = data[0]
    seeds = len({r["seed"] for r in data})

    def med(rs: list[dict], k: str) -> float:
        return statistics.median(r[k] for r in rs)

    out = [
        f"{first['puts']} puts of 64 KiB–4 MiB (log-uniform), {first['p_hold'] * 100:.0f} % in use for "
        f"1..={first['hold_max']} later puts, the rest read at once; medians of {seeds} seeds.",
        "",
        "| in use | target | capacity | in use mean | in use max | failed pinshm | failed ideal | failed per seed, pinshm / ideal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (mode, t), rs in cells.items():
        per = ", ".join(str(r["failed"]) for r in rs) + " / " + ", ".join(str(r["ideal_failed"]) for r in rs)
        out.append(
            f"| {mode} | {t * 100:.0f}% | {med(rs, 'capacity') / (1 << 20):.1f} MiB | {100 * med(rs, 'in_use_mean'):.1f}% "
            f"| {100 * med(rs, 'in_use_max'):.1f}% | {100 * med(rs, 'failed_frac'):.2f}% "
            f"| {100 * med(rs, 'ideal_failed_frac'):.2f}% | {per} |"
        )
    return "\n".join(out) + "\n"


RENDERERS: dict[str, Any] = {
    "hitrate": r_hitrate,
    "hitrate-diffs": r_hitrate_diffs,
    "hitrate-headline": r_hitrate_headline,
    "hitrate-inuse": lambda data: r_hitrate(data, in_use=True),
    "fragmentation": r_fragmentation,
}
