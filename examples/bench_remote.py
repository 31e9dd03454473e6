"""The encoder cache across nodes (docs/remote.md), timed on one machine.

1. A NIXL READ of a slot of a producer's store (UCX, TCP on 127.0.0.1
   here) against the same bytes over a plain TCP socket (request, then
   ``recv_into`` a buffer made once), in the same run, at 98 KiB, 1 MiB,
   4 MiB and 16 MiB: medians, and NIXL's as a ratio of the socket's.
2. A consumer's lookup that hits: in the node's store of fetched outputs
   (a local hit: lookup and lease) against a fetch from the producer (a
   remote hit, as the scheduler gets it: the key handed to the fetching
   thread, a lookup at the peer, a slot reserved, the READ in the
   consumer's fetch process, the copy into the slot fused with its BLAKE3
   check, publish, then a lease), with the raw NIXL READ of (1) as the
   baseline (an agent of this process's own, the same bytes, the same
   run): the remote hit's ratio to it is what the tier costs over the
   transport.
3. A request of 8 items of each size up to 4 MiB: its fetch (one lookup
   of the 8 keys, one READ of the 8) against one raw NIXL READ of the
   same 8.

The producer is a process of its own: a store, pinshm's server
(`pinshm.vllm.ec.producer.Server`, with its serving process, the channel
authenticated with a secret as deployments run it) and a socket server
over the same bytes.
Needs NIXL (``pip install --no-deps nixl-cu12==1.5.1``) and pyzmq.

    python examples/bench_remote.py --json RESULTS-remote.json
    python examples/bench_remote.py --table RESULTS-remote.json
"""

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import pinshm
from pinshm.vllm.ec._config import ECSettings
from pinshm.vllm.ec.remote.keys import derive, read_secret, secure_client
from pinshm.vllm.ec.remote.nixl import agent, release
from pinshm.vllm.ec.remote.protocol import pack, unpack

SIZES = [98 << 10, 1 << 20, 4 << 20, 16 << 20]


ITEMS = 8


def key(n, i=None):
    return f"bench-{n}" if i is None else f"bench-{n}-{i}"


def producer(conn, store, serve, tcp_port, secret):
    from pinshm.vllm.ec.remote.producer import Server

    s = pinshm.ObjectStore(160 << 20, 32 << 20, 4, name=store, cache=True, key_index=128)
    data = {}
    for n in SIZES:
        arr = np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8)
        s.put_tensor(key(n), arr)
        data[n] = arr.tobytes()
        for i in range(ITEMS if n <= 4 << 20 else 0):
            s.put_tensor(key(n, i), np.random.default_rng(n + i + 1).integers(0, 255, n, dtype=np.uint8))
    server = Server(ECSettings.from_extra({"store": store, "serve": serve, "retry_s": 0, "secret_file": secret}))
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", tcp_port))
    lsock.listen(1)

    def tcp():
        c, _ = lsock.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            head = c.recv(8, socket.MSG_WAITALL)
            if len(head) < 8:
                return
            c.sendall(data[struct.unpack("<Q", head)[0]])

    threading.Thread(target=tcp, daemon=True).start()
    conn.send("ready")
    conn.recv()
    server.close()
    s.close()


def med(xs):
    return statistics.median(xs)


def read_timed(nx, local, remote, peer_name):
    """One NIXL READ, waited for as the fetch process waits; its seconds."""
    t0 = time.perf_counter()
    x = nx.initialize_xfer("READ", local, remote, peer_name)
    state = nx.transfer(x)
    pause = 20e-6  # as a fetch waits: a busy loop starves UCX's progress thread
    while state == "PROC":
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
        state = nx.check_xfer_state(x)
    took = time.perf_counter() - t0
    assert state == "DONE"
    nx.release_xfer_handle(x)
    return took


class Control:
    """A client of the producer's control channel (lookups for the raw
    READ's addresses), authenticated as the tier is."""

    def __init__(self, port, secret):
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_client(self.sock, derive(read_secret(secret)))
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def ask(self, msg):
        self.sock.send_multipart([b"rid", b"", pack(msg)])
        assert self.sock.poll(10_000)
        return unpack(self.sock.recv_multipart()[-1])

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--table", help="print the table of a results file, and stop")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    if args.table:
        print(table(json.load(open(args.table))))
        return
    os.environ.setdefault("UCX_TLS", "tcp")
    from pinshm.vllm.ec.remote.consumer import RemoteTier

    tag = f"pinshm-bench-remote-{os.getpid()}"
    probe = pinshm.ObjectStore(1 << 20, 1 << 16, 1)
    layout = probe.handle().layout_version
    probe.close()
    zport, tport = free_port(), free_port()
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    # The deployment's secret (docs/security.md): the channel authenticated
    # and encrypted, as a deployment runs it.
    secret = os.path.join(tempfile.mkdtemp(), "ec-secret")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    proc = ctx.Process(target=producer, args=(b, tag + "-a", f"127.0.0.1:{zport}", tport, secret))
    proc.start()
    assert a.recv() == "ready"
    rows = []
    settings = ECSettings.from_extra(
        {
            "store": tag + "-b",
            "size": "160m",
            "remote_size": "160m",
            "peers": [f"127.0.0.1:{zport}"],
            "remote_timeout_s": 10,
            "secret_file": secret,
        }
    )
    tier = RemoteTier(settings)
    control = Control(zport, secret)
    multi = []
    try:
        sock = socket.create_connection(("127.0.0.1", tport))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        deadline = time.monotonic() + 60
        while tier.peers_ready < 1:
            assert time.monotonic() < deadline, "the producer never answered the tier's hello"
            time.sleep(0.01)
        peer = tier.peers[0]
        # The baseline READ from an agent of this process's own (the
        # tier's lives in its fetch process).
        nx = agent(f"bench-reader-{os.getpid()}", progress=False)
        peer_name = nx.add_remote_agent(peer.meta)
        peer_name = peer_name.decode() if isinstance(peer_name, bytes) else str(peer_name)
        # The control channel's floor: a lookup of a key the producer lacks
        # (CURVE over TCP to its serving process, which asks its scheduler).
        rtt = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            control.ask({"op": "lookup", "keys": ["no-such-key"]})
            rtt.append(time.perf_counter() - t0)
        dst = np.zeros(max(ITEMS * (4 << 20), max(SIZES)), dtype=np.uint8)
        nx.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
        base = dst.ctypes.data
        for n in SIZES:
            reply = control.ask({"op": "lookup", "keys": [key(n)]})["found"][0]
            local = nx.get_xfer_descs([(base, n, 0)], "DRAM")
            remote = nx.get_xfer_descs([(peer.base + reply["offset"], n, 0)], "DRAM")
            buf = bytearray(n)
            view = memoryview(buf)
            nixl_s, tcp_s, copy_s = [], [], []
            for _ in range(args.repeats):
                nixl_s.append(read_timed(nx, local, remote, peer_name))
                t0 = time.perf_counter()
                sock.sendall(struct.pack("<Q", n))
                got = 0
                while got < n:
                    got += sock.recv_into(view[got:], n - got)
                tcp_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                np.copyto(dst[:n], np.frombuffer(buf, np.uint8))
                copy_s.append(time.perf_counter() - t0)
            control.ask({"op": "done", "leases": [reply["lease"]]})
            # A consumer's hit: remote (fetched now, as the scheduler's
            # ensure_cache_available starts it and its has_cache_item
            # then finds it) and local (fetched before).
            remote_s, local_s = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                lease = tier.fetch(key(n))
                remote_s.append(time.perf_counter() - t0)
                assert lease is not None
                lease.release()
                t0 = time.perf_counter()
                lease = tier.lease_local(key(n))
                local_s.append(time.perf_counter() - t0)
                assert lease is not None
                lease.release()
                tier.store.clear()  # the next fetch is remote again
            rows.append(
                {
                    "bytes": n,
                    "nixl_read_s": med(nixl_s),
                    "tcp_socket_s": med(tcp_s),
                    "memcpy_s": med(copy_s),
                    "nixl_over_tcp": med(nixl_s) / med(tcp_s),
                    "remote_hit_s": med(remote_s),
                    "local_hit_s": med(local_s),
                    "remote_over_local": med(remote_s) / med(local_s),
                    "remote_over_memcpy": med(remote_s) / med(copy_s),
                    "remote_over_read": med(remote_s) / med(nixl_s),
                }
            )
            if n > 4 << 20:
                continue
            keys = [key(n, i) for i in range(ITEMS)]
            replies = control.ask({"op": "lookup", "keys": keys})["found"]
            local = nx.get_xfer_descs([(base + i * n, n, 0) for i in range(ITEMS)], "DRAM")
            remote = nx.get_xfer_descs([(peer.base + r["offset"], n, 0) for r in replies], "DRAM")
            raw_s, req_s = [], []
            for _ in range(args.repeats):
                raw_s.append(read_timed(nx, local, remote, peer_name))
                t0 = time.perf_counter()
                tier.want(keys)
                assert tier.wait(keys, 30)
                req_s.append(time.perf_counter() - t0)
                assert all(tier.has_local(k) for k in keys)
                tier.store.clear()
            control.ask({"op": "done", "leases": [r["lease"] for r in replies]})
            multi.append(
                {
                    "bytes": n,
                    "items": ITEMS,
                    "nixl_read_s": med(raw_s),
                    "request_s": med(req_s),
                    "request_over_read": med(req_s) / med(raw_s),
                }
            )
        sock.close()
    finally:
        if "nx" in locals():
            release(SimpleNamespace(_agent=nx))
        tier.close()
        control.close()
        os.unlink(secret)
        os.rmdir(os.path.dirname(secret))
        a.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    try:
        commit = subprocess.run(
            ["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = ""
    res = {
        "bench": "ec_remote",
        "stamp": {
            "pinshm": pinshm.__version__,
            "commit": commit,
            "layout_version": layout,
            "command": "python examples/bench_remote.py " + " ".join(sys.argv[1:]),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "repeats": args.repeats,
            "ucx_tls": os.environ.get("UCX_TLS"),
            "where": "one machine, two processes, 127.0.0.1",
        },
        "rows": rows,
        "requests": multi,
        "lookup_miss_s": med(rtt),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print(table(res))


def table(res):
    """The figure docs/remote.md shows (tools/figures.py's renderer), under
    a line saying where it was measured."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import figures  # noqa: E402 - the repository's tools/

    s = res["stamp"]
    head = (
        f"pinshm {s['pinshm']} (commit {s['commit']}), {s['where']}, UCX_TLS={s['ucx_tls']}, "
        f"{s['cpus']} CPUs, medians of {s['repeats']}"
    )
    return head + "\n\n" + figures.r_remote(res)


if __name__ == "__main__":
    sys.exit(main())
