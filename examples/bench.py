"""pinshm from Python: put, zero-copy get and get_copy at 4 KiB to 64 MiB,
beside a memcpy of the same size and, when vLLM is installed, vLLM's own
SingleWriterShmObjectStorage (the reference), all in one run.

    python examples/bench.py            # a table
    python examples/bench.py --json     # one JSON object
    python examples/bench.py --quick    # fewer iterations

Each figure is the median over many batches of the time per operation
(time.perf_counter_ns around a batch of operations, divided by the batch
size: small operations are batched so that the timer's own cost, about
50 ns, stays out), after a warm-up that wraps every ring at least once. The rings hold 64 MiB
of objects (at least 4, at most 256 objects), as in the Rust bench
(examples/bench.rs); pinshm and vLLM get the same capacity.
The Python loop's own cost (a few tens of ns per operation) is in every
figure, baselines included: it is what a Python caller pays.

What is timed:
  put           store.put(key, bytes) with a new key each time; a reader
                acknowledges each object outside the timing, so the ring
                wraps and every put reclaims the oldest object as it goes.
  get           reader.get(h).release(): the zero-copy view of the slot,
                held and let go (nothing copied).
  get_copy      reader.get_copy(h): a new `bytes` with the object's bytes.
  memcpy        memoryview(bytearray)[:] = bytes: one copy into a buffer
                allocated once, walking an arena as large as the ring
                (the same working set as put; the floor for put).
  bytes_copy    bytes(memoryview(bytearray)): a copy into a new `bytes`
                (the floor for get_copy).
  vllm_put      vLLM's writer put(key, bytes) with a raw-bytes serde (no
                pickling): allocate, then copy into the ring.
  vllm_get      vLLM's reader get(address, id, signature, key): verify the
                handle's HMAC, check the id, deserialize (here: `bytes` of
                the data, a copy; vLLM's own serde copies too), count the
                read under the reader lock.
  dropin_put,   the same two calls, with the same serde, on pinshm.vllm's
  dropin_get    drop-in classes (what the vLLM plugin runs): the HMAC in
                Rust, the parts written straight into the slot, the read
                counted by one atomic add.
"""

import argparse
import json
import math
import multiprocessing
import os
import platform
import statistics
import sys
import time

import pinshm

KIB = 1024
MIB = 1024 * KIB
SIZES = [4 * KIB, 256 * KIB, 4 * MIB, 64 * MIB]
# Operations per size (full run); --quick divides by 5.
OPS = {4 * KIB: 20_000, 256 * KIB: 3_000, 4 * MIB: 400, 64 * MIB: 30}


def ring_objects(size):
    """Objects of `size` the ring holds: as in the Rust bench
    (examples/bench.rs), 64 MiB of them, at least 4, at most 256."""
    return min(256, max(4, 64 * MIB // size))


def ring_capacity(size):
    """Ring bytes for objects of `size` (the same for pinshm and vLLM):
    `ring_objects` objects, each with room for a slot header."""
    return ring_objects(size) * (size + 4 * KIB)


def batch_size(size):
    """Operations per timed batch: enough that a batch of small ones takes
    tens of microseconds."""
    return max(1, min(64, (256 * KIB) // size))


def median_ns(samples):
    return statistics.median(samples)


class Keys:
    """Unique keys, made outside the timing."""

    def __init__(self, prefix):
        self.prefix = prefix
        self.n = 0

    def take(self, n):
        out = [f"{self.prefix}-{self.n + i}" for i in range(n)]
        self.n += n
        return out


def run_batches(n_ops, batch, warm_ops, prepare, timed, finish):
    """Times `timed(state)` over batches of `batch` operations; `prepare`
    and `finish` run outside the timing. Returns ns per operation, median."""
    samples = []
    done = -warm_ops
    while done < n_ops:
        state = prepare(batch)
        t0 = time.perf_counter_ns()
        timed(state)
        t1 = time.perf_counter_ns()
        finish(state)
        if done >= 0:
            samples.append((t1 - t0) / batch)
        done += batch
    return median_ns(samples)


def bench_pinshm(size, n_ops, data):
    cap = ring_capacity(size)
    batch = batch_size(size)
    fit = max(1, ring_objects(size) // 2)  # objects a batch may hold at once
    warm = max(3 * batch, (ring_objects(size) + 1) // batch * batch + batch)
    out = {}
    with pinshm.ObjectStore(cap, size, 1) as store, pinshm.StoreReader.attach(
        store.handle(), 0
    ) as reader:
        keys = Keys(f"s{size}")
        put, add_reference = store.put, store.add_reference
        get, get_copy, ack = reader.get, reader.get_copy, reader.acknowledge

        def timed_put(ks):
            ks.append([put(k, data) for k in ks[0]])

        def ack_all(ks):
            for h in ks[1]:
                ack(h)

        out["put"] = run_batches(
            n_ops, batch, warm, lambda b: [keys.take(b)], timed_put, ack_all
        )

        def put_handles(b):
            # `b` reads of at most `fit` objects: each referenced as often
            # as it is read in the batch, so the batch leaves nothing owed.
            distinct = min(b, fit)
            ks = keys.take(distinct)
            hs = [put(k, data) for k in ks]
            for i in range(distinct, b):
                add_reference(ks[i % distinct])
            return [hs[i % distinct] for i in range(b)]

        def timed_get(hs):
            for h in hs:
                get(h).release()

        def timed_get_copy(hs):
            for h in hs:
                get_copy(h)

        get_batch = 64  # zero-copy: the same cost at every size
        out["get"] = run_batches(
            n_ops if size <= 4 * MIB else 3 * n_ops,
            get_batch,
            3 * get_batch,
            put_handles,
            timed_get,
            lambda hs: None,
        )
        out["get_copy"] = run_batches(
            n_ops, batch, warm, put_handles, timed_get_copy, lambda hs: None
        )
    return out


def bench_memcpy(size, n_ops, data):
    batch = batch_size(size)
    # The destination walks an arena as large as the ring, as a put does
    # (the same working set), and as the Rust bench's memcpy does.
    arena = memoryview(bytearray(ring_objects(size) * size))
    dsts = [arena[i * size : (i + 1) * size] for i in range(ring_objects(size))]
    src = memoryview(bytearray(data))
    at = [0]

    def timed_memcpy(_):
        i = at[0]
        for _ in range(batch):
            dsts[i][:] = data
            i = i + 1 if i + 1 < len(dsts) else 0
        at[0] = i

    def timed_bytes(_):
        for _ in range(batch):
            bytes(src)

    # One lap of the arena first: its pages are faulted in then, not timed.
    warm = max(3 * batch, (len(dsts) + batch) // batch * batch)
    none = lambda b: None  # noqa: E731
    return {
        "memcpy": run_batches(n_ops, batch, warm, none, timed_memcpy, none),
        "bytes_copy": run_batches(n_ops, batch, warm, none, timed_bytes, none),
    }


def vllm_storage():
    """vLLM's module, or None when vLLM is not importable."""
    try:
        from vllm.distributed.device_communicators import shm_object_storage
    except Exception:  # noqa: BLE001 (any import failure: no vLLM here)
        return None
    return shm_object_storage


def raw_serde_class(mod):
    class RawBytesSerde(mod.ObjectSerde):
        """Raw bytes in, bytes out: no pickling, so vLLM's store itself is
        measured. `serialize` returns (data, len, metadata, metadata len);
        put copies `data` into the last `len` bytes of the object and the
        (empty) metadata after the 4-byte read flag. `deserialize` gets the
        object after that flag: here exactly the data, copied into `bytes`
        (the view dies when get returns, as with vLLM's own serde, which
        copies too)."""

        def serialize(self, value):
            return value, len(value), b"", 0

        def deserialize(self, data):
            return bytes(data)

    return RawBytesSerde


def bench_vllm(mod, size, n_ops, data, prefix="vllm"):
    """vLLM's SingleWriterShmObjectStorage API from `mod`: vLLM's own
    module, or pinshm.vllm.cache (the drop-in), with the same serde."""
    cap = ring_capacity(size)
    batch = batch_size(size)
    fit = max(1, ring_objects(size) // 2)
    warm = max(3 * batch, (ring_objects(size) + 1) // batch * batch + batch)
    ring = mod.SingleWriterShmRingBuffer(cap, create=True)
    # The reader ring maps the same segment; the reader needs a lock.
    writer = mod.SingleWriterShmObjectStorage(
        max_object_size=size + 64,
        n_readers=1,
        ring_buffer=ring,
        serde_class=raw_serde_class(mod),
    )
    handle = writer.handle()
    handle.reader_lock = multiprocessing.Lock()
    reader = mod.SingleWriterShmObjectStorage.create_from_handle(handle)
    out = {}
    try:
        keys = Keys(f"{prefix}{size}")
        put, get_cached, sign = writer.put, writer.get_cached, writer.get_signature
        get = reader.get

        def timed_put(ks):
            ks.append([put(k, data) for k in ks[0]])

        def read_all(ks):
            for k, (addr, mid) in zip(ks[0], ks[1]):
                get(addr, mid, sign(k), k)

        out[f"{prefix}_put"] = run_batches(
            n_ops, batch, warm, lambda b: [keys.take(b)], timed_put, read_all
        )

        def put_handles(b):
            distinct = min(b, fit)
            ks = keys.take(distinct)
            hs = [(*put(k, data), sign(k), k) for k in ks]
            for i in range(distinct, b):
                get_cached(ks[i % distinct])
            return [hs[i % distinct] for i in range(b)]

        def timed_get(hs):
            for addr, mid, sig, k in hs:
                get(addr, mid, sig, k)

        out[f"{prefix}_get"] = run_batches(
            n_ops, batch, warm, put_handles, timed_get, lambda hs: None
        )
    finally:
        reader.close()
        writer.close()
    return out


def fmt_ns(ns):
    if ns is None:
        return "-"
    if ns < 10_000:
        return f"{ns:,.0f} ns"
    if ns < 10_000_000:
        return f"{ns / 1000:,.1f} µs"
    return f"{ns / 1e6:,.2f} ms"


def fmt_ratio(r):
    return "-" if r is None else f"{r:.2f}"


def size_name(size):
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="a fifth of the iterations")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM even if installed")
    ap.add_argument(
        "--sizes", default=None, help="comma-separated sizes in KiB (default 4,256,4096,65536)"
    )
    args = ap.parse_args()
    sizes = [int(s) * KIB for s in args.sizes.split(",")] if args.sizes else SIZES
    mod = None if args.no_vllm else vllm_storage()
    from pinshm.vllm.cache import storage as dropin

    results = {}
    for size in sizes:
        n_ops = OPS.get(size, max(20, 20_000 * 4 * KIB // size))
        if args.quick:
            n_ops = max(10, n_ops // 5)
        data = os.urandom(size)
        r = {}
        r.update(bench_memcpy(size, n_ops, data))
        r.update(bench_pinshm(size, n_ops, data))
        r.update(bench_vllm(dropin, size, n_ops, data, prefix="dropin"))
        if mod is not None:
            r.update(bench_vllm(mod, size, n_ops, data))
        r["put_vs_memcpy"] = ratio(r["put"], r["memcpy"])
        r["get_copy_vs_bytes_copy"] = ratio(r["get_copy"], r["bytes_copy"])
        r["vllm_put_over_put"] = ratio(r.get("vllm_put"), r["put"])
        r["vllm_get_over_get"] = ratio(r.get("vllm_get"), r["get"])
        r["vllm_get_over_get_copy"] = ratio(r.get("vllm_get"), r["get_copy"])
        r["vllm_put_over_dropin_put"] = ratio(r.get("vllm_put"), r["dropin_put"])
        r["vllm_get_over_dropin_get"] = ratio(r.get("vllm_get"), r["dropin_get"])
        r["ops"] = n_ops
        results[size] = r

    meta = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "pinshm": pinshm.__version__,
        "vllm": None,
    }
    if mod is not None:
        import vllm

        meta["vllm"] = vllm.__version__
    if args.json:
        print(json.dumps({"meta": meta, "ns_per_op": {str(k): v for k, v in results.items()}}))
        return

    names = [size_name(s) for s in sizes]
    rows = [
        ("put", "put"),
        ("get (zero-copy, + release)", "get"),
        ("get_copy", "get_copy"),
        ("memcpy (preallocated)", "memcpy"),
        ("bytes copy (new bytes)", "bytes_copy"),
        ("pinshm.vllm drop-in put (raw serde)", "dropin_put"),
        ("pinshm.vllm drop-in get (copies)", "dropin_get"),
    ]
    if mod is not None:
        rows += [("vLLM put (raw serde)", "vllm_put"), ("vLLM get (copies)", "vllm_get")]
    print(f"pinshm {meta['pinshm']}, Python {meta['python']}, {meta['cpus']} CPUs"
          + (f", vLLM {meta['vllm']}" if meta["vllm"] else ", vLLM not installed"))
    print("median time per op")
    print("| op | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for label, key in rows:
        print(f"| {label} | " + " | ".join(fmt_ns(results[s].get(key)) for s in sizes) + " |")
    ratio_rows = [
        ("put / memcpy", "put_vs_memcpy"),
        ("get_copy / bytes copy", "get_copy_vs_bytes_copy"),
    ]
    if mod is not None:
        ratio_rows += [
            ("vLLM put / pinshm put", "vllm_put_over_put"),
            ("vLLM get / pinshm get", "vllm_get_over_get"),
            ("vLLM get / pinshm get_copy", "vllm_get_over_get_copy"),
            ("vLLM put / drop-in put", "vllm_put_over_dropin_put"),
            ("vLLM get / drop-in get", "vllm_get_over_dropin_get"),
        ]
    for label, key in ratio_rows:
        print(f"| {label} | " + " | ".join(fmt_ratio(results[s].get(key)) for s in sizes) + " |")
    counts = ", ".join(f"{size_name(s)} {results[s]['ops']}" for s in sizes)
    print(f"operations timed per size: {counts}")


if __name__ == "__main__":
    sys.exit(main())
