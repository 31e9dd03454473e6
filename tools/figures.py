#!/usr/bin/env python3
"""Figures in the docs, generated from results files, stamped.

A figure in a Markdown file is a block the docs never edit by hand:

    <!-- figure KIND RESULTS sources=PATH,PATH -->
    ...what `render(KIND, RESULTS)` writes...
    <!-- /figure -->

KIND names a renderer below; RESULTS is a results file (a path from the
repository's root): JSON, or JSON lines (a bench's `--json` output), whose
first object is (or whose top level holds) a `stamp`:
`{"layout_version": N, "commit": "abc1234", "command": "..."}`, what
measured it. Each figure ends with that stamp. `sources=` names the code
its numbers depend on: the check fails when a commit after the stamp's
touched any of it (tools/figures_stale.py says how, and the one way a
stale figure may stay: `stale="why"`, rendered into it).

An end-to-end results page (examples/**/RESULTS-*.md), written by hand
around its tables, carries the same stamp as a block the check fills:

    <!-- results-stamp commit=abc1234 sources=PATH,PATH -->
    <!-- /results-stamp -->

    tools/figures.py                  rewrites every figure from its results
    tools/figures.py --check          exit 1 on a figure that is not what its
                                      results render, a results file whose
                                      stamp names another layout version than
                                      src/layout.rs's (a bench's own stamp
                                      rows and a row's `layout` count too),
                                      or a results file (any RESULTS-*.json
                                      under examples/, any *.json or *.jsonl
                                      under docs/) no figure uses
    tools/figures.py --stamp FILE --command "..."
                                      stamps FILE with the command, and the
                                      layout version and commit its rows
                                      name (a bench's `{"op": "stamp"}`),
                                      else this checkout's
    tools/figures_selftest.py         the check fails on planted errors

Standard library only (tools/check_docs.py runs the check).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import figures_bench  # noqa: E402 - beside this file
import figures_hitrate  # noqa: E402
import figures_sglang  # noqa: E402
import figures_stale  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- figure (\S+) (\S+)((?: [a-z-]+=(?:\"[^\"]*\"|\S+))*) -->\n)(.*?)(<!-- /figure -->)", re.DOTALL)
PAGE_STAMP = re.compile(r"(<!-- results-stamp((?: [a-z-]+=(?:\"[^\"]*\"|\S+))*) -->\n)(.*?)(<!-- /results-stamp -->)", re.DOTALL)


def layout_version(root: Path) -> int:
    m = re.search(r"pub const LAYOUT_VERSION: u32 = (\d+);", (root / "src/layout.rs").read_text())
    if not m:
        raise SystemExit("src/layout.rs: no LAYOUT_VERSION")
    return int(m.group(1))


def load(path: Path) -> tuple[dict, Any]:
    """(stamp, data) of a results file: JSON with a top-level `stamp`, or
    JSON lines whose first line is `{"stamp": ...}`. In JSON lines, a row
    `{"op": "stamp", "commit": ..., "layout_version": ...}` (the bench's)
    opens a run: the rows after it carry `_run`, and every run's layout
    must be the stamp's (a file of runs at two layouts reads as stale)."""
    text = path.read_text()
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        stamp = dict(rows[0]["stamp"]) if rows and "stamp" in rows[0] else {}
        data, run, layouts, machines = [], -1, set(), set()
        for r in rows:
            if "stamp" in r:
                continue
            if r.get("op") == "stamp":
                run += 1
                layouts.add(r.get("layout_version"))
                stamp.setdefault("commit", r.get("commit"))
                if r.get("cpu"):
                    # The machine, where the bench names it (ratios depend on the CPU).
                    machines.add(f"{r['cpu']}, {r.get('cpus', '?')} CPUs")
                continue
            if isinstance(r.get("layout", r.get("layout_version")), int):
                layouts.add(r.get("layout", r.get("layout_version")))  # a row that names its own layout
            data.append({**r, "_run": max(run, 0)} if run >= 0 else r)
        if machines:
            # Runs of one file on several machines say so, as layouts do.
            stamp["machine"] = ("mixed " if len(machines) > 1 else "") + " / ".join(sorted(machines))
        if layouts:
            if len(layouts) > 1 or stamp.get("layout_version", next(iter(layouts))) not in layouts:
                mixed = sorted({str(v) for v in layouts} | {str(stamp.get("layout_version"))} - {"None"})
                stamp["layout_version"] = "mixed " + "/".join(mixed)
            else:
                stamp["layout_version"] = next(iter(layouts))
        return stamp, data
    if isinstance(whole, dict):
        return whole.get("stamp", {}), whole
    return {}, whole


def stamp_line(stamp: dict, source: str) -> str:
    cmd = stamp.get("command", "?")
    machine = f" on {stamp['machine']}" if stamp.get("machine") else ""
    return (
        f"<sub>Generated by tools/figures.py from [{os.path.basename(source)}]({{rel}}{source}); "
        f"measured at commit {stamp.get('commit', '?')}, layout {stamp.get('layout_version', '?')}{machine}: "
        f"`{cmd}`.</sub>\n"
    )


# ---- renderers: (data) -> Markdown ------------------------------------


def r_upstream(data: Any) -> str:
    out = []
    files = {
        "storage": "tests/distributed/test_shm_storage.py",
        "buffer": "tests/distributed/test_shm_buffer.py",
        "queue": "tests/distributed/test_shm_broadcast.py",
        "cache": "tests/multimodal/test_cache.py, -k shm",
        "cache-stock": "tests/multimodal/test_cache.py, -k shm, vLLM's own classes: the baseline",
    }
    # Keys are "<suite> <vLLM version of the tests>" (a bare suite name in
    # older files): by version, then in the order above.
    keys = [k for k in data if k.split(" ", 1)[0] in files]
    keys.sort(key=lambda k: (k.split(" ", 1)[1] if " " in k else "", list(files).index(k.split(" ", 1)[0])))
    for key in keys:
        s, suite = data[key], key.split(" ", 1)[0]
        what = files[suite]
        by_fn: dict[str, list[str]] = {}
        for t, why in sorted(s["differ"].items()):
            by_fn.setdefault(t.split("[", 1)[0], []).append(why)
        differ = "; ".join(
            f"`{fn}`{f' (x{len(whys)})' if len(whys) > 1 else ''}: {whys[0]}" for fn, whys in by_fn.items()
        )
        failed = f", {len(s['failed'])} fail unexpectedly ({', '.join(s['failed'])})" if s["failed"] else ""
        out.append(
            f"- vLLM's {suite} tests ({what} of {s['tests_from']}, run with vLLM {s['vllm_installed']} "
            f"installed): **{s['passed']} of {s['total']} pass**, {len(s['differ'])} differ by design{failed}"
            + (f": {differ}" if differ else "")
            + "."
        )
    return "\n".join(out) + "\n"


def r_engine_loop(data: Any) -> str:
    """Rows of examples/vllm_e2e/engine_loop.py (one per run), the medians
    of each (mode, /dev/shm) over its runs, and the ratio of vLLM's own
    queue's (mode 0, full /dev/shm, in the same file) to each: above 1,
    pinshm's is faster (or uses less CPU)."""
    groups: dict[tuple, list[dict]] = {}
    for r in data["runs"]:
        groups.setdefault((r["mode"], r.get("shm_mib")), []).append(r)

    def med(rows: list[dict], k: str) -> float:
        v = sorted(r[k] for r in rows)
        return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2

    base = groups.get(("0", None))
    out = [
        "| queue (`PINSHM_VLLM_MESSAGE_QUEUE`) | /dev/shm | queues built | runs | steps right | inputs handled "
        "during steps | step, median | slow step, median | engine CPU per wall second |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (mode, shm), rows in sorted(groups.items(), key=lambda kv: (kv[0][1] or 0, kv[0][0])):
        kinds = sorted({q.rsplit(".", 1)[0].split(".")[0] for r in rows for q in r["queues"].values()})
        steps = f"{sum(r['steps'] for r in rows if r['ok'])} of {sum(r['steps'] for r in rows)}"
        inputs = f"{sum(r['inputs_handled'] for r in rows)} of {sum(r['inputs'] for r in rows)}"
        cells = []
        for k in ("step_ms_median", "slow_step_ms_median", "engine_cpu_per_wall"):
            m = med(rows, k)
            ratio = f" ({med(base, k) / m:.2f}x)" if base and rows is not base else ""
            cells.append(f"{m:.2f}{' ms' if k != 'engine_cpu_per_wall' else ''}{ratio}")
        where = f"{shm} MiB" if shm else "the host's"
        out.append(
            f"| {mode} | {where} | {', '.join(kinds)} | {len(rows)} "
            f"| {steps} | {inputs} | " + " | ".join(cells) + " |"
        )
    return "\n".join(out) + "\n"


def r_ec_faults(data: Any) -> str:
    rows = [
        "| fault | B's exit | completed requests' tokens = stock | errors | encoder items per pass "
        "| hits / lookups | loaded | tracebacks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for fault, b in data["faults"]:
        hits = ", ".join(f"{h}/{n}" for h, n in zip(b.get("ec_hits") or [], b.get("lookups") or []))
        rows.append(
            f"| {fault} | {b['rc']} | {b['completed_tokens_equal_stock']} | {b['errors']} | {b['encoded']} | "
            f"{hits} | {b['loaded']} | {b['tracebacks']} |"
        )
    return f"Stock's encoder items per pass: {data.get('stock_encoded')}.\n\n" + "\n".join(rows) + "\n"


def r_bench_keys(data: Any) -> str:
    names = {
        "get_guard": "`get_guard` (by handle)",
        "lookup": "`lookup` (key to handle, the slot checked)",
        "get_key": "`get_key` (look up, hold, drop)",
        "lease_key": "`lease_key` (look up, lease, release)",
    }
    rows = ["| op | median | ratio to get_guard |", "|---|---|---|"]
    for r in data:
        rows.append(f"| {names.get(r['op'], '`' + r['op'] + '`')} | {r['median_ns']:.1f} ns | {r['ratio']:.2f} |")
    return "\n".join(rows) + "\n"


def r_ec_timing(data: Any) -> str:
    """ec.py's pass times over interleaved repeats: per configuration, the
    median of each pass (min-max), and stock's median ÷ its own (above 1:
    faster than stock)."""
    import statistics

    by: dict[str, list[dict]] = {}
    for r in data["runs"]:
        if r.get("pass_s"):
            by.setdefault(r["config"], []).append(r)
    n = min(len(r["pass_s"]) for rs in by.values() for r in rs)
    stock = by.get("ec-stock")

    def med(rs: list[dict], key: str, i: int) -> float:
        return statistics.median(r[key][i] for r in rs)

    head = " | ".join(f"pass {i + 1} s (min-max)" for i in range(n))
    rows = [
        f"| config | runs | tokens = stock | encoder items per pass | {head} | stock's time ÷ this one's |",
        "|" + "---|" * (5 + n),
    ]
    for cfg, rs in by.items():
        cells = []
        for i in range(n):
            xs = [r["pass_s"][i] for r in rs]
            cells.append(f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})")
        ratios = ", ".join(f"{med(stock, 'pass_s', i) / med(rs, 'pass_s', i):.2f}" for i in range(n)) if stock else "-"
        same = all(r.get("tokens_equal_stock", True) for r in rs)
        items = [med(rs, "encoded", i) for i in range(n)]
        rows.append(f"| {cfg} | {len(rs)} | {'yes' if same else 'NO'} | {items} | " + " | ".join(cells) + f" | {ratios} |")
    return "\n".join(rows) + "\n"


def r_serving(data: Any) -> str:
    """serve_bench.py's cells: stock's medians over repeats, and each other
    configuration's against stock's in the same repeat, one way for all:
    above 1 is better (requests/s: the median of its ratio to stock's;
    latencies: 1 / the median of its ratio to stock's, that is stock's
    latency ÷ its own)."""
    keys = ("rps", "ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99")
    rows = [
        "| cell | config | requests/s | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    by_cell: dict[str, list[dict]] = {}
    for r in data["rows"]:
        by_cell.setdefault(r["cell"], []).append(r)
    order = {c: i for i, c in enumerate(data.get("configs", []))}
    for cell, rs in by_cell.items():
        for r in sorted(rs, key=lambda r: (r["config"] != "stock", order.get(r["config"], 99), r["config"])):
            if r["config"] == "stock":
                vals = [f"{r['rps']:.1f}"] + [f"{r[k] * 1000:.0f} ms" for k in keys[1:]]
            else:
                vals = [f"{r['ratio_to_stock'][k] if k == 'rps' else 1 / r['ratio_to_stock'][k]:.2f}x" for k in keys]
            rows.append(f"| {cell} | {r['config']} | " + " | ".join(vals) + " |")
    same = ", ".join(f"{c}: {'yes' if v else 'NO'}" for c, v in data["tokens_as_stock"].items())
    return "\n".join(rows) + f"\n\n{data['repeats']} interleaved repeats, {data.get('machine', '?')}; tokens as stock's: {same}.\n"



def r_remote(data: Any) -> str:
    """bench_remote.py: a remote hit against the raw NIXL READ of the same
    bytes (the transport's floor) and against a local hit, medians and
    their ratios in one run, each a baseline's time ÷ the hit's (below 1:
    slower than the floor, as a hit must be); a request of 8 items against
    one raw READ of the 8."""
    rows = [
        "| size | NIXL READ | TCP socket | remote hit | READ / remote | local hit | local / remote | memcpy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        rows.append(
            f"| {r['bytes'] >> 10} KiB | {r['nixl_read_s'] * 1e6:.0f} µs | {r['tcp_socket_s'] * 1e6:.0f} µs | "
            f"{r['remote_hit_s'] * 1e6:.0f} µs | {r['nixl_read_s'] / r['remote_hit_s']:.2f}x | "
            f"{r['local_hit_s'] * 1e6:.1f} µs | {1 / r['remote_over_local']:.3f}x | {r['memcpy_s'] * 1e6:.0f} µs |"
        )
    if "lookup_miss_s" in data:
        rows += [
            "",
            f"A lookup's round trip alone (a key the producer lacks): {data['lookup_miss_s'] * 1e6:.0f} µs.",
        ]
    requests = data.get("requests") or []
    if requests:
        rows += ["", "| request | one NIXL READ of its items | its fetch | READ / fetch |", "|---|---|---|---|"]
        for r in requests:
            rows.append(
                f"| {r['items']} x {r['bytes'] >> 10} KiB | {r['nixl_read_s'] * 1e6:.0f} µs | "
                f"{r['request_s'] * 1e6:.0f} µs | {1 / r['request_over_read']:.2f}x |"
            )
    return "\n".join(rows) + "\n"


def r_gpu_kit(data: Any) -> str:
    """The GPU kit's run (tools/gpu_kit_results.py): pinned slot against
    pageable memory each way, ratios in the same run; registration, pack;
    the Python steps' lines as printed."""
    d = data["device"]
    out = [
        f"{d['name']} (compute {d['compute_capability']}), driver {d['driver']} (CUDA {d['cuda_driver_api']}), "
        f"kernels: {d['kernels']}. {data['summary']}.",
        "",
        "| MiB | D2H into a slot | D2H into pageable | ratio | H2D from a slot | H2D from pageable | ratio | put (wall) | get (wall) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["bandwidth_gbps"]:
        out.append(
            f"| {r['mib']} | {r['d2h_slot']:.1f} GB/s | {r['d2h_pageable']:.1f} GB/s | {r['d2h_slot'] / r['d2h_pageable']:.1f}x "
            f"| {r['slot_h2d']:.1f} GB/s | {r['pageable_h2d']:.1f} GB/s | {r['slot_h2d'] / r['pageable_h2d']:.1f}x "
            f"| {r['put_wall']:.1f} GB/s | {r['get_wall']:.1f} GB/s |"
        )
    out.append("")
    if "register_s_per_gib" in data:
        out.append(
            f"- Registration (`cuMemHostRegister` as a reader attaches): {data['register_s_per_gib']:.3f} s per GiB; "
            f"unregistration {data['unregister_s_per_gib']:.3f} s per GiB."
        )
    if "pack_ms" in data:
        p = data["pack_ms"]
        out.append(
            f"- 1,000 device tensors (8 MiB): pack {p['pack']:.2f} ms against 1,000 D2H copies {p['d2h_copies']:.2f} ms "
            f"({p['d2h_copies'] / p['pack']:.0f}x); unpack {p['unpack']:.2f} ms against 1,000 H2D copies "
            f"{p['h2d_copies']:.2f} ms ({p['h2d_copies'] / p['unpack']:.0f}x)."
        )
    if data.get("python_lines"):
        out += ["", "```text", *data["python_lines"], "```"]
    return "\n".join(out) + "\n"


RENDERERS: dict[str, Callable[[Any], str]] = {
    **figures_bench.RENDERERS,
    **figures_hitrate.RENDERERS,
    **figures_sglang.RENDERERS,
    "remote": r_remote,
    "ec-timing": r_ec_timing,
    "upstream": r_upstream,
    "engine-loop": r_engine_loop,
    "ec-faults": r_ec_faults,
    "bench-keys": r_bench_keys,
    "serving": r_serving,
    "gpu-kit": r_gpu_kit,
}


def render(root: Path, doc: Path, kind: str, source: str) -> str:
    if kind not in RENDERERS:
        raise ValueError(f"no renderer {kind!r} (one of {', '.join(sorted(RENDERERS))})")
    stamp, data = load(root / source)
    rel = os.path.relpath(root, doc.parent).replace(os.sep, "/") + "/"
    return RENDERERS[kind](data) + "\n" + stamp_line(stamp, source).replace("{rel}", "" if rel == "./" else rel)


def docs(root: Path) -> list[Path]:
    """README.md, docs/*.md and the results pages (examples/**/RESULTS-*.md)."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "examples").rglob("RESULTS-*.md"))]


def results_files(root: Path) -> list[str]:
    """Every results file a figure should use: examples/**/RESULTS-*.json,
    and every .json and .jsonl under docs/ (docs/results/ is where they go)."""
    found = sorted(str(p.relative_to(root)) for p in (root / "examples").rglob("RESULTS-*.json"))
    d = root / "docs"
    if d.is_dir():
        found += sorted(str(p.relative_to(root)) for p in d.rglob("*") if p.suffix in (".json", ".jsonl"))
    return found


def run(root: Path, write: bool) -> list[str]:
    problems, used = [], set()
    want = layout_version(root)
    for doc in docs(root):
        text = doc.read_text()

        def fill(m: re.Match) -> str:
            kind, source, spec = m.group(2), m.group(3), figures_stale.attrs(m.group(4))
            used.add(source)
            where = f"{doc.relative_to(root)}: figure {kind} {source}"
            if not (root / source).exists():
                problems.append(f"{where}: no such results file")
                return m.group(0)
            stamp, _ = load(root / source)
            if stamp.get("layout_version") != want:
                problems.append(
                    f"{where}: measured at layout {stamp.get('layout_version')}, the code is layout {want}: "
                    "measure it again (and stamp it), or delete the figure"
                )
            note, stale = figures_stale.verdict(root, where, str(stamp.get("commit", "?")), spec)
            problems.extend(stale)
            try:
                body = render(root, doc, kind, source) + note
            except Exception as e:  # noqa: BLE001 - reported with the place
                problems.append(f"{where}: cannot render: {type(e).__name__}: {e}")
                return m.group(0)
            if not write and m.group(5) != body:
                problems.append(f"{where}: not what its results render (run tools/figures.py)")
            return m.group(1) + body + m.group(6)

        def page(m: re.Match) -> str:
            spec = figures_stale.attrs(m.group(2))
            where = f"{doc.relative_to(root)}: results-stamp"
            commit = spec.get("commit", "")
            note, stale = figures_stale.verdict(root, where, commit, spec)
            problems.extend(stale)
            body = (
                f"<sub>Measured at commit {commit}; the code it measured: "
                + ", ".join(f"`{p}`" for p in spec.get("sources", "").split(",") if p)
                + ".</sub>\n"
                + note
            )
            if not write and m.group(3) != body:
                problems.append(f"{where}: not what its stamp renders (run tools/figures.py)")
            return m.group(1) + body + m.group(4)

        new = PAGE_STAMP.sub(page, BLOCK.sub(fill, text))
        if doc.name.startswith("RESULTS-") and doc.suffix == ".md" and not PAGE_STAMP.search(text):
            problems.append(f"{doc.relative_to(root)}: a results page with no results-stamp block")
        if write and new != text:
            doc.write_text(new)
    for source in results_files(root):
        if source not in used:
            problems.append(f"{source}: a results file no figure uses (add a figure, or delete it)")
    return problems


def stamp(path: Path, command: str, root: Path = ROOT) -> None:
    """Adds `command` to FILE's stamp. The commit and layout version are
    what the results already say (a bench stamps its own runs), else this
    checkout's."""
    commit = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    here = {"layout_version": layout_version(root), "commit": commit or "?"}
    text = path.read_text()
    try:
        whole = json.loads(text)
        if not isinstance(whole, dict):
            raise SystemExit(f"{path}: a JSON list cannot hold a stamp; write an object, or JSON lines")
        whole["stamp"] = {**here, **whole.get("stamp", {}), "command": command}
        path.write_text(json.dumps(whole, indent=1, sort_keys=True) + "\n")
    except json.JSONDecodeError:
        lines = [line for line in text.splitlines() if line.strip() and not line.startswith('{"stamp"')]
        path.write_text("\n".join(lines) + "\n")
        measured, _ = load(path)
        s = {**here, **{k: v for k, v in measured.items() if v is not None}, "command": command}
        path.write_text("\n".join([json.dumps({"stamp": s})] + lines) + "\n")


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--stamp"] and len(args) == 4 and args[2] == "--command":
        stamp(Path(args[1]), args[3])
        return 0
    if args not in ([], ["--check"]):
        print(__doc__)
        return 2
    problems = run(ROOT, write=not args)
    for p in problems:
        print(p)
    if problems:
        return 1
    print("figures: every figure is what its stamped results render")
    return 0


if __name__ == "__main__":
    sys.exit(main())
