"""The summary of run.py's runs: per mode and configuration, medians over
the runs, tokens against stock's, and the Markdown table of results;
and what a run's probe file and log say (read_probe, read_log)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

def med(xs):
    return round(statistics.median(xs), 3) if xs else None


def summarize(runs: list[dict], reference: list[dict] = ()) -> tuple[dict, str]:
    rows = {}
    for r in runs:
        rows.setdefault((r["mode"], r["config"]), []).append(r)
    summary = {}
    for (mode, cfg), rs in rows.items():
        # Stock's tokens from this run where stock ran to the end (in a
        # small /dev/shm it does not start), else from --reference's.
        stock = [r for r in rows.get((mode, "stock"), []) if "tokens" in r]
        stock = stock or [r for r in reference if r.get("mode") == mode and r.get("config") == "stock" and "tokens" in r]
        ref = stock[0] if stock else None
        same = None
        if ref is not None and "tokens" in ref:
            same = all(r.get("tokens") == ref["tokens"] and r.get("single_tokens") == ref["single_tokens"] for r in rs)
        s = {
            "runs": len(rs),
            "rc": [r.get("rc") for r in rs],
            "tokens_same_as_stock": same,
            "hits": [f"{r['hits']}/{r['items']}" for r in rs],
            "init_s": med([r["init_s"] for r in rs if "init_s" in r]),
            "first_pass_s": med([r["pass_s"][0] for r in rs if r.get("pass_s")]),
            "later_pass_s": med([x for r in rs for x in r.get("pass_s", [])[1:]]),
            "single_s": med([x for r in rs for x in r.get("single_s", [])]),
            "exit_s": med([r["exit_s"] for r in rs if "exit_s" in r]),
            "forced_kills": [r["forced_kills"] for r in rs],
            "cpu_s": {k: med([r["cpu_s"].get(k, 0) for r in rs]) for k in ("main", "engine_core", "worker")},
            "shm_peak_mib": med([r["shm_peak_mib"] for r in rs]),
            "shm_peak_queues_mib": med([r["shm_peak_queues_mib"] for r in rs]),
            "shm_left": sorted({x for r in rs for x in r["shm_left"]}),
            "shm_left_mib": max(r["shm_left_mib"] for r in rs),
            "classes": rs[0]["classes"],
            "pinshm_in_use": sum(bool(r["pinshm_in_use"]) for r in rs),
            "pinshm_not_used": sorted({x for r in rs for x in r["pinshm_not_used"]}),
            "tracebacks": [r["tracebacks"] for r in rs],
            "detours": [r.get("detours", 0) for r in rs],
        }
        summary[f"{mode}/{cfg}"] = s
    md = ["| run | tokens = stock | hits | init s | 1st pass s | later pass s | single s | exit s | forced kills | CPU s main / core / workers | /dev/shm peak (queues) MiB | left | tracebacks | in pieces |", "|" + "---|" * 14]
    for key, s in summary.items():
        c = s["cpu_s"]
        md.append(
            f"| {key} | {s['tokens_same_as_stock']} | {', '.join(s['hits'])} | {s['init_s']} | {s['first_pass_s']} | "
            f"{s['later_pass_s']} | {s['single_s']} | {s['exit_s']} | {s['forced_kills']} | "
            f"{c['main']} / {c['engine_core']} / {c['worker']} | {s['shm_peak_mib']} ({s['shm_peak_queues_mib']}) | "
            f"{s['shm_left_mib']} MiB {s['shm_left'] or ''} | {s['tracebacks']} | {s['detours']} |"
        )
    md.append("")
    md.append("Classes built, per process (from the in-process probe):")
    for key, s in summary.items():
        md.append(f"- {key}: " + "; ".join(f"{role}: {', '.join(v)}" for role, v in sorted(s["classes"].items())))
    return summary, "\n".join(md) + "\n"


def read_probe(path: Path, root: int) -> dict:
    """Which classes each process built, by role; the sender's cache hits."""
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    parent = {x["pid"]: x["ppid"] for x in lines}

    def role(pid):
        if pid == root:
            return "main"
        if parent.get(pid) == root:
            return "engine_core"
        return "worker"

    classes: dict[str, set] = {}
    hits = total = 0
    detours: dict[tuple, int] = {}  # (pid, queue): messages sent in pieces
    for x in lines:
        if x["what"] in ("storage", "queue"):
            side = "writer" if x["writer"] else "reader"
            owner = "pinshm" if x["cls"].startswith("pinshm.") else "vllm"
            classes.setdefault(role(x["pid"]), set()).add(f"{x['what']}:{side}:{owner}")
        elif x["what"] == "cache_stat":
            hits, total = max(hits, x["hits"]), max(total, x["total"])
        elif x["what"] == "detour":
            detours[(x["pid"], x["queue"])] = x["messages"]
        elif x["what"] == "probe_error":
            classes.setdefault("probe_error", set()).add(x["error"])
    return {
        "classes": {k: sorted(v) for k, v in classes.items()},
        "hits": hits,
        "items": total,
        "detours": sum(detours.values()),
    }


def read_log(text: str) -> dict:
    lines = text.splitlines()
    return {
        "tracebacks": sum("Traceback (most recent call last)" in x for x in lines),
        "pinshm_in_use": [x.strip()[-160:] for x in lines if "pinshm" in x and " in use: " in x],
        "pinshm_not_used": [x.strip()[-200:] for x in lines if "stays vLLM's" in x or "not in use" in x],
        "forced_kills": sum("force killing" in x or "sending SIGKILL" in x for x in lines),
        "workers_sigterm": sum("still running after grace period" in x for x in lines),
    }


# ---- one run ----
