"""Hit rate of the store used as vLLM's multimodal processor cache
(`--mm-processor-cache-type shm`), on a Zipf-popular trace of
multimodal-sized objects, beside vLLM's own SingleWriterShmObjectStorage
driven with the same trace in the same run.

    python examples/bench_hitrate.py            # a table
    python examples/bench_hitrate.py --json     # one JSON row per line
    python examples/bench_hitrate.py --quick    # a shorter trace

The workload (all fixed by seeds, so hit rates are deterministic):
  catalog    --keys objects (default 1000), each of a size drawn
             log-uniformly in 0.25-5 MiB once and fixed for its key
             (about 1.6 GiB in all).
  trace      --warmup + --requests requests (default 5000 + 20000), keys
             drawn Zipf(alpha) over the catalog; popularity rank is
             independent of size. One trace per alpha, the same for every
             store and capacity. Hits are counted after the warm-up only.
  capacity   5 %, 10 % and 20 % of the catalog's total bytes, the same
             figure for every store (pinshm's ring, vLLM's data buffer).

The access protocol is the sender cache's (vLLM's ShmObjectStoreSenderCache,
get_and_update_item): for each request, if is_cached(key) then
get_cached(key) (a hit), else put(key, bytes) (a miss; a full store,
pinshm's FullError or vLLM's MemoryError, also counts as a miss and the item
is served uncached). After each request one reader reads what it was sent
once (pinshm: get + release; vLLM: its reader-side get under a
multiprocessing.Lock), so no object stays owed or held: the writer is free
to evict any object, and the figures are the eviction policy plus placement.

With --in-use F (and --in-use-for N), a fraction F of requests' items stay
in use for 1..=N later requests, as a worker keeps a request's inputs for its
lifetime: pinshm's reader holds its zero-copy guard that long; vLLM's reader
reads the item only then (its get copies out, so "in use" there is "not read
yet"). vLLM's writer frees from the oldest end only, so it stalls behind such
an item; pinshm allocates around it. The column [n] counts the puts refused
as full (served uncached) among the counted requests.

Columns:
  ideal_fifo    offline: FIFO over a byte budget with no placement (an
                object fits whenever the bytes of the objects kept plus its
                own are within capacity). Pure Python.
  ideal_clock   offline: the same with CLOCK (FIFO with re-insertion: an
                object hit since it last reached the old end is moved to the
                young end once, its bit cleared, instead of evicted).
  fifo          pinshm ObjectStore(eviction="fifo"): next-fit in a ring.
  second_chance pinshm ObjectStore(eviction="second_chance"): CLOCK in
                place; an object the sweep keeps splits the free run.
  vllm          vLLM's SingleWriterShmObjectStorage with max_object_size
                just above the largest object (its best case: on a full
                ring it frees 2 x max_object_size bytes from the oldest end).
  vllm_mos128   the same with vLLM's default --mm-shm-cache-max-object-size-mb
                128: each full ring frees 256 MiB from the oldest end, which
                at these capacities (80-320 MiB) is most or all of the ring.

vLLM's columns use a raw-bytes serde (no pickling; deserialize returns the
length): the hit rate depends only on which keys stay, not on the serde.
Without vLLM (not importable) its columns are skipped, with a note.
"""

import argparse
import bisect
import itertools
import json
import math
import multiprocessing
import random
import sys
import time
from collections import OrderedDict

# examples/ is the script's directory, so its sibling imports by name.
from bench import vllm_storage

KIB = 1024
MIB = 1024 * KIB
MIN_SIZE = 256 * KIB
MAX_SIZE = 5 * MIB
CATALOG_SEED = 18
TRACE_SEED = 1800
ALPHAS = (0.6, 0.9, 1.2)
CAPACITY_FRACTIONS = (0.05, 0.10, 0.20)


def catalog(n_keys, seed=CATALOG_SEED):
    """Sizes in bytes, log-uniform in [MIN_SIZE, MAX_SIZE], one per key."""
    rng = random.Random(seed)
    lo, hi = math.log(MIN_SIZE), math.log(MAX_SIZE)
    return [int(math.exp(rng.uniform(lo, hi))) for _ in range(n_keys)]


def zipf_trace(n_keys, alpha, length, seed):
    """`length` key indices, Zipf(alpha) by rank; ranks mapped to keys by a
    random permutation, so popularity is independent of size."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** alpha for rank in range(n_keys)]
    cum = list(itertools.accumulate(weights))
    keys = list(range(n_keys))
    rng.shuffle(keys)
    total = cum[-1]
    return [keys[bisect.bisect_left(cum, rng.random() * total)] for _ in range(length)]


# --- offline references: byte budget, no placement ---------------------------


class IdealFifo:
    """`request` returns (hit, token): with `keep`, the object stays in use
    until `finish(token)`, and eviction passes over it (it keeps its age)."""

    name = "ideal_fifo"
    clock = False

    def __init__(self, capacity):
        self.capacity = capacity
        self.used = 0
        self.q = OrderedDict()  # key -> size, oldest first
        self.bit = {}
        self.in_use = {}  # key -> reads outstanding
        self.full = 0

    def request(self, key, size, keep=False):
        if key in self.q:
            self.bit[key] = True
            hit = True
        else:
            hit = False
            if not self._make_room(size):
                self.full += 1
                return False, None
            self.q[key] = size
            self.used += size
        if keep:
            self.in_use[key] = self.in_use.get(key, 0) + 1
            return hit, key
        return hit, None

    def _make_room(self, size):
        while self.used + size > self.capacity:
            progress = False
            for k in list(self.q):
                if self.used + size <= self.capacity:
                    break
                if self.in_use.get(k):
                    continue
                if self.clock and self.bit.pop(k, False):
                    self.q.move_to_end(k)  # one more lap, bit cleared
                else:
                    self.used -= self.q.pop(k)
                    self.bit.pop(k, None)
                progress = True
            if not progress:
                return False
        return True

    def finish(self, key):
        self.in_use[key] -= 1
        if not self.in_use[key]:
            del self.in_use[key]

    def close(self):
        pass


class IdealClock(IdealFifo):
    name = "ideal_clock"
    clock = True


# --- the stores, driven as vLLM's sender cache and one worker drive them -----

PAYLOAD = memoryview(bytes(MAX_SIZE))


def key_name(key):
    return f"mm-{key:06d}"


class Pinshm:
    """With `keep`, the worker holds the zero-copy read (a guard) until
    `finish`, as a worker keeps a request's inputs for its lifetime."""

    def __init__(self, capacity, policy):
        import pinshm

        self.name = policy
        self.FullError = pinshm.FullError
        self.store = pinshm.ObjectStore(capacity, MAX_SIZE, 1, eviction=policy)
        self.reader = pinshm.StoreReader.attach(self.store.handle(), 0)
        self.full = 0

    def request(self, key, size, keep=False):
        k = key_name(key)
        if self.store.is_cached(k):
            h = self.store.get_cached(k)
            hit = True
        else:
            hit = False
            try:
                h = self.store.put(k, PAYLOAD[:size])
            except self.FullError:
                self.full += 1
                return False, None
        g = self.reader.get(h)  # the worker reads what it was sent
        if keep:
            return hit, g
        g.release()
        return hit, None

    def finish(self, guard):
        guard.release()

    def close(self):
        self.reader.close()
        self.store.close()


def raw_serde_class(mod):
    class RawBytesSerde(mod.ObjectSerde):
        """Bytes in as one part (copied into the object by put), the length
        out: which keys stay does not depend on the serde."""

        def serialize(self, value):
            return [value], len(value), b"", 0

        def deserialize(self, data):
            return len(data)

    return RawBytesSerde


class Vllm:
    """With `keep`, the worker's read comes at `finish` (vLLM's reader
    copies out at get, so an item a worker is not done with is one it has
    not read yet: the writer may not free it, nor anything younger)."""

    def __init__(self, capacity, mod, max_object_size, name):
        self.name = name
        ring = mod.SingleWriterShmRingBuffer(capacity, create=True)
        self.writer = mod.SingleWriterShmObjectStorage(
            max_object_size=max_object_size,
            n_readers=1,
            ring_buffer=ring,
            serde_class=raw_serde_class(mod),
        )
        handle = self.writer.handle()
        handle.reader_lock = multiprocessing.Lock()
        self.reader = mod.SingleWriterShmObjectStorage.create_from_handle(handle)
        self.full = 0

    def request(self, key, size, keep=False):
        w = self.writer
        k = key_name(key)
        if w.is_cached(k):
            addr, mid = w.get_cached(k)
            hit = True
        else:
            hit = False
            try:
                addr, mid = w.put(k, PAYLOAD[:size])
            except MemoryError:
                self.full += 1
                return False, None
        sent = (addr, mid, w.get_signature(k), k)
        if keep:
            return hit, sent
        self.reader.get(*sent)
        return hit, None

    def finish(self, sent):
        self.reader.get(*sent)

    def close(self):
        self.reader.close()
        self.writer.close()


def run(cache, trace, sizes, warmup, keeps):
    """Drives `cache` with `trace`; `keeps[i]` > 0: request i's item stays
    in use for that many later requests."""
    hits = hit_bytes = req_bytes = full_before = 0
    pending = []  # (due, token)
    t0 = time.perf_counter()
    try:
        for i, key in enumerate(trace):
            if pending:
                due = [t for d, t in pending if d <= i]
                if due:
                    pending = [(d, t) for d, t in pending if d > i]
                    for t in due:
                        cache.finish(t)
            if i == warmup:
                full_before = cache.full
            hit, token = cache.request(key, sizes[key], keeps[i] > 0)
            if token is not None:
                pending.append((i + keeps[i], token))
            if i >= warmup:
                req_bytes += sizes[key]
                if hit:
                    hits += 1
                    hit_bytes += sizes[key]
        for _, t in pending:
            cache.finish(t)
    finally:
        cache.close()
    n = len(trace) - warmup
    return {
        "hits": hits,
        "requests": n,
        "hit_rate": hits / n,
        "byte_hit_rate": hit_bytes / req_bytes,
        "full": cache.full - full_before,  # counted requests only
        "seconds": round(time.perf_counter() - t0, 2),
    }


def keep_schedule(length, frac, longest, seed):
    """For each request, 0 or how many later requests its item stays in use
    (uniform in 1..=longest for a fraction `frac` of requests)."""
    rng = random.Random(seed)
    return [rng.randint(1, longest) if rng.random() < frac else 0 for _ in range(length)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON row per line")
    ap.add_argument("--quick", action="store_true", help="a 2000 + 4000 trace")
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=5000)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--trace-seed", type=int, default=TRACE_SEED,
                    help="base seed of the traces (one per alpha: seed + round(100 * alpha))")
    ap.add_argument("--alphas", type=float, nargs="+", default=list(ALPHAS))
    ap.add_argument("--capacities", type=float, nargs="+", default=list(CAPACITY_FRACTIONS),
                    help="fractions of the catalog's bytes")
    ap.add_argument("--in-use", type=float, default=0.0,
                    help="fraction of requests whose item the worker keeps in use for a while")
    ap.add_argument("--in-use-for", type=int, default=200,
                    help="an item kept stays in use for 1..=N later requests")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's store")
    ap.add_argument("--ideal-only", action="store_true", help="only the offline references")
    args = ap.parse_args()
    if args.quick:
        args.warmup, args.requests = 2000, 4000

    sizes = catalog(args.keys)
    total = sum(sizes)
    mod = None if (args.no_vllm or args.ideal_only) else vllm_storage()
    notes = []
    if mod is None and not (args.no_vllm or args.ideal_only):
        notes.append("vLLM is not importable here: its columns are skipped")
    vllm_tight = MAX_SIZE + 64  # 4-byte flag + data must fit

    makers = [
        ("ideal_fifo", lambda c: IdealFifo(c)),
        ("ideal_clock", lambda c: IdealClock(c)),
    ]
    if not args.ideal_only:
        makers += [
            ("fifo", lambda c: Pinshm(c, "fifo")),
            ("second_chance", lambda c: Pinshm(c, "second_chance")),
        ]
    if mod is not None:
        makers += [
            ("vllm", lambda c: Vllm(c, mod, vllm_tight, "vllm")),
            ("vllm_mos128", lambda c: Vllm(c, mod, 128 * MIB, "vllm_mos128")),
        ]

    meta = {
        "keys": args.keys,
        "catalog_bytes": total,
        "mean_size": total / args.keys,
        "warmup": args.warmup,
        "requests": args.requests,
        "sizes": f"log-uniform {MIN_SIZE // KIB} KiB - {MAX_SIZE // MIB} MiB",
        "in_use": args.in_use,
        "in_use_for": args.in_use_for if args.in_use else 0,
        "seeds": {"catalog": CATALOG_SEED, "trace": f"{args.trace_seed} + round(100 * alpha)"},
    }
    if mod is not None:
        import vllm

        meta["vllm"] = vllm.__version__
    if not args.ideal_only:
        import pinshm

        meta["pinshm"] = pinshm.__version__
    if args.json:
        print(json.dumps({"meta": meta, "notes": notes}), flush=True)

    rows = []
    for alpha in args.alphas:
        trace = zipf_trace(args.keys, alpha, args.warmup + args.requests,
                           args.trace_seed + round(100 * alpha))
        keeps = keep_schedule(len(trace), args.in_use, args.in_use_for,
                              args.trace_seed + round(100 * alpha) + 1)
        for frac in args.capacities:
            cap = int(total * frac) // 64 * 64  # pinshm wants a multiple of 64
            for name, make in makers:
                r = run(make(cap), trace, sizes, args.warmup, keeps)
                row = {"alpha": alpha, "capacity_frac": frac, "capacity_bytes": cap,
                       "store": name, "in_use": args.in_use,
                       "in_use_for": args.in_use_for if args.in_use else 0, **r}
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    print(f"  alpha {alpha} cap {frac:.0%} {name}: "
                          f"{r['hit_rate']:.2%} ({r['seconds']} s)", file=sys.stderr, flush=True)
    if args.json:
        return

    names = [n for n, _ in makers]
    print(f"catalog {args.keys} objects, {total / MIB:,.0f} MiB "
          f"(mean {total / args.keys / MIB:.2f} MiB, {meta['sizes']}); "
          f"trace {args.warmup} warm-up + {args.requests} counted requests")
    if args.in_use:
        print(f"{args.in_use:.0%} of items kept in use for 1..={args.in_use_for} later requests")
    for n in notes:
        print(f"note: {n}")
    print("hit rate (%), counted requests; [n] = puts refused as full")
    print(f"{'alpha':>5} {'cap':>4} " + " ".join(f"{n:>13}" for n in names))
    for alpha in args.alphas:
        for frac in args.capacities:
            cells = []
            for n in names:
                r = next(x for x in rows if x["alpha"] == alpha
                         and x["capacity_frac"] == frac and x["store"] == n)
                full = f" [{r['full']}]" if r["full"] else ""
                cells.append(f"{100 * r['hit_rate']:.1f}{full}".rjust(13))
            print(f"{alpha:>5} {frac:>4.0%} " + " ".join(cells))


if __name__ == "__main__":
    sys.exit(main())
