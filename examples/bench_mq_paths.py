"""What the channel binding offers pinshm.vllm.queue.MessageQueue's inline path,
measured on its own (no queue object, no store): one writer process, one
reader process, a reply channel back (one message in flight), back to back.

    python examples/bench_mq_paths.py [--quick]

Each message is `("msg", t0_ns, numpy uint8 array of SIZE)` pickled by the
queue's own `dumps` (`pinshm.vllm.queue._encoding`) (buffers of 1 MiB and more out of band). Paths:
- `join + recv_bytes`: the queue's inline encoding before `send_parts`: the
  parts joined into one bytes first, `recv_bytes()` (a bytes copy), `loads_inline` (a
  bytearray copy of each buffer): 4 copies of a large buffer.
- `send_parts + recv`: the same bytes gathered straight into the slot
  (`send_parts`), read in place (`recv`), each buffer copied once into
  an owned bytearray: 2 copies, one each side.
- `send_parts + recv, zero copy`: as above, the buffers views of the
  slot (what `dequeue(zero_copy=True)` could return): 1 copy.
"""

import argparse
import multiprocessing as mp
import pickle
import statistics
import struct
import time

import numpy as np

import pinshm
from pinshm.vllm.queue._encoding import dumps, inline_parts, loads_inline

KIB, MIB = 1 << 10, 1 << 20
PATHS = ["join + recv_bytes", "send_parts + recv", "send_parts + recv, zero copy"]


def loads_view(v, zero_copy):
    """Decodes a message in place. The views made here die with this call
    (or, zero copy, with the arrays over them), and with them the exports
    of `v`, so `v.release()` succeeds once the caller drops the object."""
    mv = memoryview(v)
    (n,) = struct.unpack_from("<H", mv, 1)
    lens = struct.unpack_from(f"<{n}I", mv, 3)
    off = 3 + 4 * n
    main = mv[off : off + lens[0]]
    off += lens[0]
    oob = []
    for length in lens[1:]:
        part = mv[off : off + length]
        oob.append(part if zero_copy else bytearray(part))
        off += length
    return pickle.loads(main, buffers=oob)


def child(h_rpc, q, path):
    rx = pinshm.BroadcastReader.attach(h_rpc, 0)
    tx = pinshm.Broadcast(1, 4, 64)
    q.put(tx.handle())
    while True:
        if path == PATHS[0]:
            obj = loads_inline(rx.recv_bytes())
        else:
            v = rx.recv()
            obj = loads_view(v, zero_copy=path == PATHS[2])
        t1 = time.monotonic_ns()
        cmd, t0, payload = obj
        del obj, payload
        if path != PATHS[0]:
            v.release()  # every view of the slot is gone: frees it
        if cmd == "stop":
            tx.send(b"")
            break
        tx.send((t1 - t0).to_bytes(8, "little"))
    time.sleep(0.3)
    rx.close()
    tx.close()


def run(path, size, n):
    ctx = mp.get_context("spawn")
    tx = pinshm.Broadcast(1, 4, size + 4096)
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(tx.handle(), q, path))
    p.start()
    back = pinshm.BroadcastReader.attach(q.get(timeout=60), 0)
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    lat = []
    for _ in range(n):
        bufs = dumps(("msg", time.monotonic_ns(), payload))
        if path == PATHS[0]:
            tx.send(b"".join(inline_parts(bufs)))
        else:
            tx.send_parts(inline_parts(bufs))
        lat.append(int.from_bytes(back.recv_bytes(), "little") / 1e3)
    tx.send_parts(inline_parts(dumps(("stop", 0, None))))
    back.recv_bytes()
    p.join(30)
    back.close()
    tx.close()
    lat = lat[n // 10 :]
    return statistics.median(lat), statistics.quantiles(lat, n=100, method="inclusive")[98]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    iters = {KIB: 500, MIB: 100, 8 * MIB: 30} if args.quick else {KIB: 3000, MIB: 400, 8 * MIB: 100}
    print("| message | path | median | p99 |")
    print("|---|---|---|---|")
    for size, n in iters.items():
        for path in PATHS:
            med, p99 = run(path, size, n)
            label = f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"
            print(f"| {label} | {path} | {med:.0f} µs | {p99:.0f} µs |", flush=True)


if __name__ == "__main__":
    main()
