"""Saves and loads of encoder outputs: pinshm's against vLLM's
ECExampleConnector's (safetensors files), one save and one load per output,
in one run, on the CPU.

    python examples/bench_ec.py                       # a markdown table
    python examples/bench_ec.py --json docs/results/bench_ec.json
    python examples/bench_ec.py --table docs/results/bench_ec.json   # the table of a results file

Needs torch and safetensors, not vLLM: the file connector's save and load
are mirrored from vLLM 0.32's
`vllm/distributed/ec_transfer/ec_connector/example_connector.py`, layout
included: `<storage>/<mm_hash>/encoder_cache.safetensors`, the folder made
(`os.makedirs(..., exist_ok=True)`) on every filename lookup, a save of
`{"ec_cache": t.detach().cpu()}` with `safetensors.torch.save_file`, a
load with `safetensors.torch.load_file(filename, device="cpu")["ec_cache"]`.
The storage folder is a fresh temporary folder (the connector's default
is the system's temporary folder).

For each output size (98 KiB, 1 MiB, 8 MiB) and dtype (float32, bfloat16)
a tensor of rows of 2 KiB (an encoder output: tokens x hidden) is saved
and loaded, per repeat, by:

  memcpy       t.clone(): one copy into a new tensor (the floor of both).
  file         the example connector's save_caches / start_load_caches.
  sparse       pinshm.device.put_tensor into a fresh sparse store
               (reserve=False, the encoder-cache connector's default: the
               pages of its first lap are backed by a background thread a
               step ahead of the puts), and pinshm.device.get_tensor of it
               (a copy on the CPU), from a reader attached to it.
  sparse_inline  the same with back_ahead=0: each put backs its own pages
               (what every sparse put did before the backer).
  backed       the same into a reserved, pre-faulted store.

Every store is large enough that no put wraps: every sparse put lands in
pages never written before. A repeat is a step: 20 ms of sleep (the
engine waiting for its device; a background backer can work then), a
short spin to wake the core, the saves in one order, then the loads; the
order of the ops changes every repeat (every order in turn), so that no op
always follows the same one. A load is timed alone, and with a read of one
element of every page of what it returned (safetensors maps the file on
the CPU, so its load reads nothing yet: its first user pays the page
faults). Medians over the repeats; ratios are to the file connector's
median. torch runs one thread (the copies are single-threaded on both
sides).
"""

import argparse
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import safetensors.torch
import torch

import pinshm
from pinshm.device import get_tensor, put_tensor

KIB = 1024
MIB = 1024 * KIB
SIZES = [98 * KIB, MIB, 8 * MIB]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ROW = 2 * KIB
STORES = ["sparse", "sparse_inline", "backed"]
OPS = ["memcpy", "file"] + STORES


class FileConnector:
    """ECExampleConnector's save and load, without vLLM."""

    def __init__(self, storage_path):
        self._storage_path = storage_path

    def _generate_foldername_debug(self, mm_hash, create_folder=True):
        foldername = os.path.join(self._storage_path, mm_hash)
        if create_folder:
            os.makedirs(foldername, exist_ok=True)
        return foldername

    def _generate_filename_debug(self, mm_hash):
        foldername = self._generate_foldername_debug(mm_hash)
        return os.path.join(foldername, "encoder_cache.safetensors")

    def save_caches(self, encoder_cache, mm_hash):
        filename = self._generate_filename_debug(mm_hash)
        ec_cache = encoder_cache[mm_hash]
        tensors = {"ec_cache": ec_cache.detach().cpu()}
        safetensors.torch.save_file(tensors, filename)

    def load(self, encoder_cache, mm_hash, device="cpu"):
        filename = self._generate_filename_debug(mm_hash)
        encoder_cache[mm_hash] = safetensors.torch.load_file(filename, device=device)["ec_cache"]


def step(gap_s):
    time.sleep(gap_s)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.0002:
        pass


def make_store(kind, nbytes, repeats):
    slot = pinshm.ObjectStore.slot_len(1, nbytes + 4 * KIB)
    cap = (repeats + 2) * slot
    cap -= cap % pinshm.ObjectStore.SLOT_ALIGN
    kw = dict(reserve=kind == "backed", pin="off", cache=True, key_index=4 * (repeats + 2))
    if kind == "sparse_inline":
        kw["back_ahead"] = 0
    store = pinshm.ObjectStore(cap, nbytes + 4 * KIB, 1, **kw)
    return store, pinshm.StoreReader.attach(store.handle(), 0)


def run_cell(nbytes, dtype_name, repeats, gap_s, tmp):
    dtype = DTYPES[dtype_name]
    cols = ROW // torch.tensor([], dtype=dtype).element_size()
    rows = nbytes // ROW
    t = torch.randn(rows, cols).to(dtype)
    assert t.numel() * t.element_size() == nbytes
    files = FileConnector(tmp)
    # The sparse stores last: no head start but the first step's wait.
    stores = {k: make_store(k, nbytes, repeats) for k in reversed(STORES)}
    save = {op: [] for op in OPS}
    load = {op: [] for op in OPS}
    touch = {op: [] for op in OPS}
    orders = list(itertools.permutations(OPS))
    keep = []
    handles = {}
    for i in range(repeats):
        step(gap_s)
        mm_hash = f"{i:04x}" + os.urandom(30).hex()
        order = orders[(i * 7) % len(orders)]
        for op in order:
            t0 = time.perf_counter_ns()
            if op == "memcpy":
                keep.append(t.clone())
            elif op == "file":
                files.save_caches({mm_hash: t}, mm_hash)
            else:
                handles[op] = put_tensor(stores[op][0], mm_hash, t)
            save[op].append(time.perf_counter_ns() - t0)
        for op in reversed(order):
            t0 = time.perf_counter_ns()
            if op == "memcpy":
                out = keep[-1].clone()
            elif op == "file":
                cache = {}
                files.load(cache, mm_hash)
                out = cache[mm_hash]
            else:
                out = get_tensor(stores[op][1], handles[op])
            t1 = time.perf_counter_ns()
            # One element of every page read: what the load's first user
            # pays on top (safetensors maps the file; its pages fault in
            # when first read).
            out.view(-1)[:: 4096 // out.element_size()].float().sum()
            load[op].append(t1 - t0)
            touch[op].append(time.perf_counter_ns() - t0)
            assert out.dtype == dtype and out.shape == t.shape
            del out
        keep.clear()
    stats = {k: s[0].stats() for k, s in stores.items()}
    for store, reader in stores.values():
        reader.close()
        store.close()
    med = statistics.median
    return {
        "size": nbytes,
        "dtype": dtype_name,
        "shape": [rows, cols],
        "save_ns": {op: med(v) for op, v in save.items()},
        "load_ns": {op: med(v) for op, v in load.items()},
        "load_read_ns": {op: med(v) for op, v in touch.items()},
        # Every repeat's figure, µs, in the order run.
        "save_us": {op: [round(x / 1e3) for x in v] for op, v in save.items()},
        "load_us": {op: [round(x / 1e3) for x in v] for op, v in load.items()},
        "backed_in_put": {k: st.get("backed_in_put") for k, st in stats.items()},
    }


def table(res):
    """The markdown table of a results object: tools/figures.py's
    `ec-save-load` renderer, the one the docs' figure uses."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
    import figures

    return figures.RENDERERS["ec-save-load"](res)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=48)
    ap.add_argument("--gap-ms", type=float, default=20.0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--table", help="print the table of this results file and exit")
    args = ap.parse_args()
    if args.table:
        print(table(json.load(open(args.table))))
        return
    if args.repeats < 30:
        sys.exit("at least 30 repeats")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="pinshm-bench-ec-")
    try:
        probe = pinshm.ObjectStore(1 << 20, 1 << 16, 1)
        layout = probe.handle().layout_version
        probe.close()
        try:
            here = os.path.dirname(os.path.abspath(__file__))
            commit = subprocess.run(
                ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = ""
        rows = []
        for nbytes in SIZES:
            for dt in DTYPES:
                rows.append(run_cell(nbytes, dt, args.repeats, args.gap_ms / 1e3, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = {
        "bench": "ec_save_load",
        "stamp": {
            "pinshm": pinshm.__version__,
            "layout_version": layout,
            "commit": commit,
            "torch": torch.__version__,
            "safetensors": safetensors.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "repeats": args.repeats,
            "gap_ms": args.gap_ms,
            "torch_threads": 1,
        },
        "rows": rows,
    }
    print(table(res))
    if args.json:
        with open(args.json, "w") as f:
            # One line per row: a diff of two runs reads row by row.
            head = {k: v for k, v in res.items() if k != "rows"}
            f.write(json.dumps(head)[:-1] + ', "rows": [\n')
            f.write(",\n".join(json.dumps(r) for r in res["rows"]))
            f.write("\n]}\n")
        print(f"\nwritten: {args.json}")


if __name__ == "__main__":
    main()
