"""Renderers of tools/figures.py for the benchmarks' results files.

Each takes what `figures.load` returns for its file and writes Markdown.
The bench renderers read `cargo run --release --example bench -- --json`'s
rows as they come (one object per op and size; a file may hold several
runs, each opened by the bench's `{"op": "stamp"}` row, numbered `_run`)
and take medians over the runs, so a new run of the bench renders with no
change here: rows are found by their fields, not by a fixed list.

Standard library only.
"""

from __future__ import annotations

import statistics
from typing import Any

KIB, MIB = 1 << 10, 1 << 20


def size_label(n: int) -> str:
    if n >= MIB and n % MIB == 0:
        return f"{n // MIB} MiB"
    if n >= KIB and n % KIB == 0:
        return f"{n // KIB} KiB"
    return f"{n} B"


def ns_label(ns: float) -> str:
    if ns >= 1e6:
        return f"{ns / 1e6:.1f} ms"
    if ns >= 1e4:
        return f"{ns / 1e3:.1f} µs"
    return f"{ns:.1f} ns" if ns < 100 else f"{ns:.0f} ns"


def spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    """The median, and the range over the runs where there are several."""
    m = fmt.format(statistics.median(xs))
    return m if len(xs) == 1 else f"{m} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def runs(data: list[dict]) -> int:
    return len({r.get("_run", 0) for r in data})


# ---- cargo run --release --example bench -- --json ------------------------


def r_bench_store(data: list[dict]) -> str:
    """The store's table: every op measured beside a memcpy of its size
    (`memcpy_median_ns`), by size; ns, and from 256 KiB the memcpy's time
    ÷ the op's in the same run (above 1: faster than the memcpy; below
    256 KiB a memcpy is a few ns and the ratio says nothing)."""
    cells: dict[tuple[str, int], list[dict]] = {}
    ops: list[str] = []
    sizes: list[int] = []
    for r in data:
        if "memcpy_median_ns" not in r or r["op"] == "xproc":
            continue
        cells.setdefault((r["op"], r["size"]), []).append(r)
        if r["op"] not in ops:
            ops.append(r["op"])
        if r["size"] not in sizes:
            sizes.append(r["size"])
    sizes.sort()
    out = [
        "| op | " + " | ".join(size_label(s) for s in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for op in ops:
        row = []
        for s in sizes:
            rs = cells.get((op, s), [])
            if not rs:
                row.append("")
                continue
            ns = ns_label(statistics.median(r["median_ns"] for r in rs))
            ratios = [r["ratio"] for r in rs]
            # a ratio where the op copies the bytes (a guard's or an item's view does not)
            copies = s >= 256 * KIB and statistics.median(ratios) > 0.1
            row.append(f"{ns} ({spread([1 / x for x in ratios])})" if copies else ns)
        out.append(f"| `{op}` | " + " | ".join(row) + " |")
    m = [r for r in data if "memcpy_median_ns" in r and r["op"] != "xproc"]
    out.append("")
    out.append(
        f"{runs(data)} runs; medians of the runs' medians; in brackets from 256 KiB: the time of a memcpy "
        "of the same size into an arena as large as the op's ring ÷ the op's, in the same run (above 1: "
        f"faster than the memcpy; median and range over the runs), for the ops that copy the bytes. {len(m)} rows."
    )
    return "\n".join(out) + "\n"


BASELINES = {
    "floor_ns": "the read protocol's floor",
    "put_1_reader_ns": "`put`, 1 reader",
    "get_guard_ns": "`get_guard` of the same 1000 objects",
    "sha256_ns": "keyed SHA-256",
}


def baseline_of(r: dict) -> str | None:
    if "baseline" in r:
        return str(r["baseline"]).replace("_", " ")
    for k, name in BASELINES.items():
        if k in r:
            return name
    return None


def op_label(r: dict) -> str:
    extra = []
    if "readers" in r:
        extra.append(f"{r['readers']} reader{'s' if r['readers'] != 1 else ''}")
    if "objects" in r:
        extra.append(f"{r['objects']} objects")
    if "key_len" in r:
        extra.append(f"keys of {r['key_len']} digits")
    if "size" in r and r["size"]:
        extra.insert(0, size_label(r["size"]))
    return f"`{r['op']}`" + (f" ({', '.join(extra)})" if extra else "")


def r_bench_baselines(data: list[dict], prefix: tuple[str, ...], exclude: tuple[str, ...] = ()) -> str:
    """Rows measured beside a baseline other than memcpy: op, median ns,
    the baseline's time ÷ the op's in the same run (above 1: faster than
    the baseline; median and range over runs)."""
    groups: dict[str, list[dict]] = {}
    for r in data:
        if "memcpy_median_ns" in r or not r.get("op", "").startswith(prefix) or r["op"].startswith(exclude):
            continue
        if baseline_of(r) is None:
            continue
        groups.setdefault(op_label(r) + "|" + baseline_of(r), []).append(r)
    out = ["| op | median | the baseline's time ÷ the op's (same run) | baseline |", "|---|---|---|---|"]
    for key, rs in groups.items():
        label, base = key.split("|", 1)
        ns = ns_label(statistics.median(r["median_ns"] for r in rs))
        out.append(f"| {label} | {ns} | {spread([1 / r['ratio'] for r in rs])} | {base} |")
    out.append("")
    out.append(f"{runs(data)} runs; medians of the runs' medians; ratios: median (range) over the runs.")
    return "\n".join(out) + "\n"


def r_bench_hot(data: list[dict]) -> str:
    return r_bench_baselines(data, ("read_floor", "get_guard", "put_readers", "lookup", "get_key", "lease_key", "fp_"))


def r_bench_bcast(data: list[dict]) -> str:
    return r_bench_baselines(data, ("bcast_",))


def r_bench_xproc(data: list[dict]) -> str:
    rs = [r for r in data if r.get("op") == "xproc"]
    gbps = [g for r in rs for g in r["per_reader_gbps"]]
    return (
        f"1 writer, {rs[0]['readers']} reader processes, {size_label(rs[0]['size'])} objects, handles over pipes, "
        f"each reader summing every word of every object ({len(rs)} runs): "
        f"{min(gbps):.1f} to {max(gbps):.1f} GB/s delivered to each reader while streaming; "
        f"end-to-end latency, put start to the last reader done, one object at a time: "
        f"{spread([r['latency_median_ns'] / 1e3 for r in rs], '{:.0f}')} µs, "
        f"a {size_label(rs[0]['size'])} memcpy into the same working set takes "
        f"{spread([1 / r['ratio'] for r in rs])}× that time.\n"
    )


def _med(data: list[dict], op: str, key: str = "ratio", **where: Any) -> float:
    xs = [r[key] for r in data if r.get("op") == op and all(r.get(k) == v for k, v in where.items())]
    if not xs:
        raise ValueError(f"no {op} row with {where}")
    return statistics.median(xs)


def r_bench_headline(data: list[dict]) -> str:
    """The README's rows from the bench: large puts against memcpy, the
    zero-copy get against the read protocol's floor, a get by key against
    a get by handle."""
    big = [r for r in data if r.get("op") == "put" and r["size"] >= 256 * KIB]
    by_size: dict[int, list[float]] = {}
    for r in big:
        by_size.setdefault(r["size"], []).append(r["ratio"])
    put = [1 / statistics.median(v) for v in by_size.values()]
    gets = [r["median_ns"] for r in data if r.get("op") == "get_guard" and "memcpy_median_ns" in r]
    at_floor = [r for r in data if r.get("op") == "get_guard" and "floor_ns" in r]
    floor = 1 / statistics.median(r["ratio"] for r in at_floor)
    guard_ns = [r["median_ns"] for r in at_floor]
    rows = [
        f"| the store (medians over {runs(data)} runs of the bench) | figure |",
        "|---|---|",
        f"| put, {size_label(min(by_size))} to {size_label(max(by_size))}, steady state | "
        f"{min(put):.2f}–{max(put):.2f}× a memcpy's speed: the memcpy's time ÷ the put's, of the same size into "
        "the same working set (median per size) |",
        f"| zero-copy get and release (`get_guard`) | {min(gets):.0f}–{max(gets):.0f} ns over 64 B to 64 MiB; "
        f"{statistics.median(guard_ns):.0f} ns at 4 KiB, {floor:.2f}× the speed of the read protocol's floor |",
        f"| get by key (64-digit keys, as vLLM's mm hashes) | {1 / _med(data, 'get_key'):.2f}× a get by handle's "
        f"speed; the key's fingerprint {1 / _med(data, 'fp_shipped'):.2f}× keyed SHA-256's |",
    ]
    return "\n".join(rows) + "\n"


# ---- examples/bench_mq.py --json ----------------------------------------


def _us(x: float) -> str:
    return f"{x / 1e3:.2f} ms" if x >= 1000 else f"{x:.0f} µs"


def _mq_cells(data: dict) -> list[tuple[str, int, int, dict, dict | None]]:
    """(mode, size, readers, pinshm's phase, vLLM's phase or None)."""
    out = []
    ns = sorted({int(k.split()[-1]) for k in data if k.startswith("pinshm ")})
    phases = data[f"pinshm {ns[0]}"]["phases"]
    modes = list(dict.fromkeys(k.split()[0] for k in phases))
    sizes = sorted({int(k.split()[1]) for k in phases})
    for mode in modes:
        for size in sizes:
            for n in ns:
                p = data[f"pinshm {n}"]["phases"][f"{mode} {size}"]
                v = data.get(f"vllm {n}", {}).get("phases", {}).get(f"{mode} {size}")
                out.append((mode, size, n, p, v))
    return out


def r_mq_quick(data: dict) -> str:
    """bench_mq.py's table: per mode, size and reader count, both queues'
    median and p99 latency (µs), vLLM's / pinshm's (above 1: pinshm is
    faster), and the busiest reader's and the writer's CPU (% of a core);
    then /dev/shm and the idle reader."""
    rows = [
        "| mode | message | readers | pinshm median | p99 | vLLM median | p99 | vLLM/pinshm median | p99 "
        "| reader CPU pinshm | vLLM | writer CPU pinshm | vLLM |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, size, n, p, v in _mq_cells(data):
        if v:
            rows.append(
                f"| {mode} | {size_label(size)} | {n} | {_us(p['median'])} | {_us(p['p99'])} | {_us(v['median'])} "
                f"| {_us(v['p99'])} | {v['median'] / p['median']:.2f}× | {v['p99'] / p['p99']:.2f}× "
                f"| {p['reader_cpu']:.1f} % | {v['reader_cpu']:.1f} % | {p['writer_cpu']:.1f} % | {v['writer_cpu']:.1f} % |"
            )
        else:
            rows.append(
                f"| {mode} | {size_label(size)} | {n} | {_us(p['median'])} | {_us(p['p99'])} | | | | "
                f"| {p['reader_cpu']:.1f} % | | {p['writer_cpu']:.1f} % | |"
            )
    rows.append("")
    for k, r in data.items():
        if not isinstance(r, dict) or "shm_small" not in r:
            continue
        impl, n = k.rsplit(" ", 1)
        rows.append(
            f"- /dev/shm, {impl}, {n} reader(s): {r['shm_small'] / MIB:.1f} MiB after the 1 KiB messages, "
            f"{r['shm_end'] / MIB:.1f} MiB at the end"
        )
    for k, r in data.items():
        if isinstance(r, dict) and "idle" in r:
            cpu, wall = r["idle"]
            rows.append(
                f"- idle reader, {k.rsplit(' ', 1)[0]}: {cpu * 1e3:.1f} ms of CPU in {wall:.2f} s, "
                f"{1e3 * cpu / wall:.2f} ms per s"
            )
    return "\n".join(rows) + "\n"


def r_mq_large(data: dict) -> str:
    """Paired runs of bench_mq.py (`runs`: each a `before` and an `after`
    run's --json output, cadence cells): per size and reader count, vLLM's
    median / pinshm's in each run and their median, and the readers' CPU
    (% of a core) after, pinshm's and vLLM's, as ranges over the runs."""
    rows = [
        f"| message | readers | before ({data['before_commit']}): vLLM/pinshm median, each run | median "
        f"| after ({data['after_commit']}): each run | median | reader CPU after, pinshm | vLLM |",
        "|---|---|---|---|---|---|---|---|",
    ]
    first = data["runs"][0]["after"]
    for mode, size, n, _, _ in _mq_cells(first):
        key, cells = f"{mode} {size}", []
        for side in ("before", "after"):
            ratios = [
                r[side][f"vllm {n}"]["phases"][key]["median"] / r[side][f"pinshm {n}"]["phases"][key]["median"]
                for r in data["runs"]
            ]
            cells.append(" · ".join(f"{x:.2f}×" for x in ratios) + f" | {statistics.median(ratios):.2f}×")
        cpu = [
            [r["after"][f"{impl} {n}"]["phases"][key]["reader_cpu"] for r in data["runs"]] for impl in ("pinshm", "vllm")
        ]
        rows.append(
            f"| {size_label(size)} | {n} | {cells[0]} | {cells[1]} | {min(cpu[0]):.1f}–{max(cpu[0]):.1f} % "
            f"| {min(cpu[1]):.0f}–{max(cpu[1]):.0f} % |"
        )
    return "\n".join(rows) + "\n"


def r_mq_headline(data: dict) -> str:
    """The README's rows from bench_mq.py: the ratio ranges by mode, the
    reader's CPU at the decode cadence, and the idle reader."""
    rows = ["| MessageQueue beside vLLM's, one message in flight | figure |", "|---|---|"]
    cells = [c for c in _mq_cells(data) if c[4]]
    for mode, what in (("b2b", "back to back"), ("cadence", "one message per 5 ms")):
        rs = [v["median"] / p["median"] for m, _, _, p, v in cells if m == mode]
        if rs:
            rows.append(
                f"| {what}, 1 KiB to 64 MiB, 1 and 2 readers | vLLM's median latency / pinshm's: "
                f"{min(rs):.2f}–{max(rs):.2f}× (median {statistics.median(rs):.2f}×; above 1 pinshm is faster) |"
            )
    cad = [(p["reader_cpu"], v["reader_cpu"]) for m, s, _, p, v in cells if m == "cadence" and s <= MIB]
    if cad:
        rows.append(
            f"| reader CPU at one message per 5 ms, up to 1 MiB | pinshm {min(c[0] for c in cad):.1f}–"
            f"{max(c[0] for c in cad):.1f} % of a core, vLLM {min(c[1] for c in cad):.0f}–{max(c[1] for c in cad):.0f} % |"
        )
    idle = {k.rsplit(" ", 1)[0]: r["idle"] for k, r in data.items() if isinstance(r, dict) and "idle" in r}
    if "pinshm" in idle:
        fig = ", ".join(f"{impl} {1e3 * c / w:.2f} ms" for impl, (c, w) in idle.items())
        rows.append(f"| a reader idle between messages, CPU per second | {fig} |")
    return "\n".join(rows) + "\n"


# ---- examples/bench_first_lap.rs --json, examples/bench_ec.py, bench.py --


def r_first_lap(data: list[dict]) -> str:
    """Per size and mode: memcpy, a put into a fresh sparse store, a put
    into a backed one (µs, medians over the runs of each run's median) and
    their ratios (per run, then the median)."""
    cells: dict[tuple[int, str], list[dict]] = {}
    for r in data:
        cells.setdefault((r["size"], r["mode"]), []).append(r)
    out = [
        "| size | mode | memcpy µs | put, fresh sparse µs | put, backed µs | sparse / backed "
        "| sparse / memcpy | backed / memcpy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (size, mode), rs in sorted(cells.items(), key=lambda kv: (kv[0][1] != "gap", kv[0][0])):

        def m(f: Any, rs: list[dict] = rs) -> float:
            return statistics.median(f(r) for r in rs)

        out.append(
            f"| {size_label(size)} | {mode} | {m(lambda r: r['memcpy_ns']) / 1e3:.1f} "
            f"| {m(lambda r: r['sparse_put_ns']) / 1e3:.1f} | {m(lambda r: r['backed_put_ns']) / 1e3:.1f} "
            f"| {spread([r['sparse_put_ns'] / r['backed_put_ns'] for r in rs])} "
            f"| {spread([r['sparse_put_ns'] / r['memcpy_ns'] for r in rs])} "
            f"| {spread([r['backed_put_ns'] / r['memcpy_ns'] for r in rs])} |"
        )
    n = max(len(rs) for rs in cells.values())
    out.append("")
    out.append(
        f"{n} runs of {data[0]['repeats']} interleaved repeats; gap {data[0]['gap_ms'] or 20} ms; ratios: median (range)."
    )
    return "\n".join(out) + "\n"


EC_OPS = ["memcpy", "file", "sparse", "sparse_inline", "backed"]


def r_ec_save_load(res: dict) -> str:
    """bench_ec.py's table: per store and dtype, save, load, and load with
    a read of every page, at each size, µs (the file connector's time ÷
    the op's: above 1, faster than the file connector)."""
    s = res["stamp"]
    out = [
        f"torch {s.get('torch')}, safetensors {s.get('safetensors')}, {s.get('repeats')} interleaved repeats, "
        f"step {s.get('gap_ms')} ms, {s.get('torch_threads')} torch thread; medians; in brackets: the file "
        "connector's time ÷ the op's (above 1: faster)",
        "",
    ]
    sizes = sorted({r["size"] for r in res["rows"]})
    head = " / ".join(size_label(n) for n in sizes)
    out.append(f"| op | dtype | save, {head} | load, {head} | load and read every page, {head} |")
    out.append("|---|---|---|---|---|")
    dtypes = list(dict.fromkeys(r["dtype"] for r in res["rows"]))
    ops = [op for op in EC_OPS if op in res["rows"][0]["save_ns"]]
    for op in ops:
        for dt in dtypes:
            rows = {r["size"]: r for r in res["rows"] if r["dtype"] == dt}
            cells = []
            for what in ("save_ns", "load_ns", "load_read_ns"):
                parts = []
                for n in sizes:
                    v = rows[n][what]
                    us = v[op] / 1e3
                    parts.append(f"{us:.0f} µs" if op == "file" else f"{us:.0f} µs ({v['file'] / v[op]:.2f}×)")
                cells.append(" / ".join(parts))
            out.append(f"| {op} | {dt} | {cells[0]} | {cells[1]} | {cells[2]} |")
    return "\n".join(out) + "\n"


PY_ROWS = [
    ("put", "put"),
    ("get (zero copy, + release)", "get"),
    ("get_copy", "get_copy"),
    ("memcpy (arena as large as the ring)", "memcpy"),
    ("copy into a new `bytes`", "bytes_copy"),
    ("drop-in put (raw serde)", "dropin_put"),
    ("drop-in get (copies)", "dropin_get"),
    ("vLLM put (raw serde)", "vllm_put"),
    ("vLLM get (copies)", "vllm_get"),
]
#: The bench's ratios, each shown as a baseline's time ÷ pinshm's (above
#: 1: pinshm faster); the bench wrote the first two the other way round,
#: and r_py_bench inverts them.
PY_RATIOS = [
    ("memcpy / put", "put_vs_memcpy"),
    ("new `bytes` / get_copy", "get_copy_vs_bytes_copy"),
    ("vLLM put / put", "vllm_put_over_put"),
    ("vLLM get / get", "vllm_get_over_get"),
    ("vLLM get / get_copy", "vllm_get_over_get_copy"),
    ("vLLM put / drop-in put", "vllm_put_over_dropin_put"),
    ("vLLM get / drop-in get", "vllm_get_over_dropin_get"),
]


def r_py_bench(res: dict) -> str:
    """examples/bench.py's runs: per op and size the median over the runs
    of each run's median (ns per op, the Python loop included), then the
    ratios, taken per run."""
    runs = [r["ns_per_op"] for r in res["runs"]]
    sizes = sorted(runs[0], key=int)

    def cell(key: str, size: str) -> list[float]:
        return [r[size][key] for r in runs if r[size].get(key) is not None]

    out = ["| op | " + " | ".join(size_label(int(s)) for s in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for label, key in PY_ROWS:
        if cell(key, sizes[0]):
            out.append(f"| {label} | " + " | ".join(ns_label(statistics.median(cell(key, s))) for s in sizes) + " |")
    for label, key in PY_RATIOS:
        if cell(key, sizes[0]):
            flip = key in ("put_vs_memcpy", "get_copy_vs_bytes_copy")  # written as pinshm's ÷ the baseline's
            row = [spread([1 / x for x in cell(key, s)] if flip else cell(key, s)) for s in sizes]
            out.append(f"| {label} | " + " | ".join(row) + " |")
    m = res["runs"][0]["meta"]
    out.append("")
    out.append(
        f"{len(runs)} runs; pinshm {m.get('pinshm')}, Python {m.get('python')}, vLLM {m.get('vllm') or 'not installed'}; "
        "ratios: median (range) over the runs; each is a baseline's time ÷ pinshm's (above 1: pinshm faster)."
    )
    return "\n".join(out) + "\n"


RENDERERS = {
    "bench-store": r_bench_store,
    "bench-hot": r_bench_hot,
    "bench-bcast": r_bench_bcast,
    "bench-xproc": r_bench_xproc,
    "bench-headline": r_bench_headline,
    "mq-quick": r_mq_quick,
    "first-lap": r_first_lap,
    "ec-save-load": r_ec_save_load,
    "py-bench": r_py_bench,
    "mq-headline": r_mq_headline,
    "mq-large": r_mq_large,
}
