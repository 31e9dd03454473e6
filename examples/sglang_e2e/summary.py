"""The table of examples/sglang_e2e/run.py's rows (standard library only:
tools/figures_sglang.py renders docs/sglang.md's figure with it).

Per TP and phase, medians over the rounds of each server's p50 and p99;
each ratio is taken within a round first (stock and pinshm alternate),
then its median given. One direction for every ratio: above 1, pinshm
is faster (stock's time ÷ pinshm's; pinshm's requests/s ÷ stock's)."""

from __future__ import annotations

import statistics
from typing import Any, Optional

PHASES = ("cold", "warm_distinct", "warm_repeat", "burst_distinct", "burst_repeat", "large")


def pct(xs: list[float], q: int) -> float:
    """The q-th percentile of `xs` (inclusive; the one value for one)."""
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def requests(phase: Any) -> list[dict[str, Any]]:
    """The requests of a phase that answered (a list: sequential; a dict: a burst)."""
    done = phase if isinstance(phase, list) else phase.get("done", [])
    return [d for d in done if "error" not in d]


def stats(phase: Any) -> dict[str, float]:
    ok = requests(phase)
    out = {}
    for k in ("ttft_s", "latency_s"):
        xs = [d[k] for d in ok]
        if xs:
            out[f"{k}_p50"], out[f"{k}_p99"] = pct(xs, 50), pct(xs, 99)
    if isinstance(phase, dict):
        out["rps"] = phase["requests_per_s"]
    return out


def same_tokens(a: Any, b: Any) -> bool:
    want = {d["tag"]: d["ids"] for d in requests(a)}
    return all(d["ids"] == want[d["tag"]] for d in requests(b) if d["tag"] in want)


def pairs(rows: list[dict[str, Any]], tp: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(stock, pinshm) servers of the same round at `tp`, both whole."""
    by = {(r["round"], r["config"]): r for r in rows if r["tp"] == tp and "error" not in r}
    return [(by[(n, "stock")], by[(n, "pinshm")]) for n, c in sorted(by) if c == "stock" and (n, "pinshm") in by]


def cell(ps: list[tuple[dict[str, Any], dict[str, Any]]], phase: str, key: str) -> Optional[tuple[float, float, float]]:
    """(stock's median, pinshm's median, median of the per-round ratios,
    above 1: pinshm faster), or None where no round has it."""
    s, p, ratio = [], [], []
    for a, b in ps:
        if phase not in a["phases"] or phase not in b["phases"]:
            continue
        x, y = stats(a["phases"][phase]).get(key), stats(b["phases"][phase]).get(key)
        if x is None or y is None:
            continue
        s.append(x)
        p.append(y)
        ratio.append(y / x if key == "rps" else x / y)
    return (_med(s), _med(p), _med(ratio)) if s else None


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| TP | phase | tokens = stock's | TTFT p50 ms (×) | TTFT p99 ms (×) | latency p50 ms (×) "
        "| latency p99 ms (×) | requests/s (×) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tp in sorted({r["tp"] for r in rows}):
        ps = pairs(rows, tp)
        for phase in PHASES:
            if not any(phase in a["phases"] for a, _ in ps):
                continue
            same = all(same_tokens(a["phases"][phase], b["phases"][phase]) for a, b in ps if phase in b["phases"])
            # A burst cut by a SIGKILL: its streams end where the server died.
            killed = phase == "burst_distinct" and any("killed_after_s" in a or "killed_after_s" in b for a, b in ps)
            cells = []
            for key in ("ttft_s_p50", "ttft_s_p99", "latency_s_p50", "latency_s_p99", "rps"):
                c = cell(ps, phase, key)
                if c is None:
                    cells.append("-")
                elif key == "rps":
                    cells.append(f"{c[0]:.1f} → {c[1]:.1f} ({c[2]:.2f}×)")
                else:
                    cells.append(f"{1000 * c[0]:.0f} → {1000 * c[1]:.0f} ({c[2]:.2f}×)")
            verdict = "n/a (killed mid-burst)" if killed else "yes" if same else "NO"
            out.append(f"| {tp} | {phase} | {verdict} | " + " | ".join(cells) + " |")
    out.append("")
    out.append(footer(rows))
    return "\n".join(out) + "\n"


def footer(rows: list[dict[str, Any]]) -> str:
    """Rounds, segments made, what was left, errors."""
    lines = []
    for config in ("stock", "pinshm"):
        rs = [r for r in rows if r["config"] == config]
        if not rs:
            continue
        sgl = sum(r.get("segments", {}).get("sgl_shm_mm_", 0) for r in rs)
        ours = sum(r.get("segments", {}).get("pinshm_sgl_", 0) for r in rs)
        left = sorted({n for r in rs for n in r.get("left_in_dev_shm", [])})
        errors = [f"round {r['round']} TP={r['tp']}: {r['error']}" for r in rs if "error" in r]
        lines.append(
            f"- {config}: {len(rs)} servers; sgl_shm_mm_* segments made: {sgl}; pinshm stores made: {ours}; "
            f"left in /dev/shm: {', '.join(left) or 'nothing'}" + (f"; errors: {'; '.join(errors)}" if errors else "")
        )
    lines.append("- Each cell: stock → pinshm, medians over rounds; (×): above 1, pinshm faster.")
    return "\n".join(lines)
