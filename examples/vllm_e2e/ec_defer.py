"""Whether a slow peer slows a consumer engine (by hand, not in CI): real
vLLM engines (the tiny LLaVA, TP=2), each node in a mount namespace with
its own /dev/shm, NIXL over UCX TCP on 127.0.0.1.

Node A (``ec_both``, ``serve``) runs one pass of the workload (its 12
images saved) and is held. Node B (``defer_node.py``) decodes a text
request of 96 tokens, and after 4 steps is sent 6 image requests of
images A saw, in these configurations, one node B each:

- ``stock``: no connector (the image requests run their encoder);
- ``no peer``: the connector, no peers;
- ``peer``: A as its peer, directly;
- ``peer +200 ms``: A through a proxy that delays every byte towards A
  by 200 ms (the CURVE handshake, hellos and lookups all pay it);
- ``peer +300 ms``: 300 ms;
- ``peer +950 ms``: 950 ms (a lookup answered just before the
  1 s budget, as a hostile peer would).

Per run: the text request's longest gap between two tokens from the
images' arrival on, every step's wall time (p50, p99, max) while an image
request was unfinished, and (p50, p99) of the decode steps after,
the image requests' encoder items and hits (the probe), and their tokens
against stock's.

    python ec_defer.py --python VENV/bin/python --model MODEL_DIR --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import run as harness
from ec import encoder_counts
from ec_remote import MODULE, free_port, make_secret, start, wait_result

HERE = Path(__file__).resolve().parent
NS = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=512m pinshm-node /dev/shm && exec "$@"', "sh"]


class DelayProxy:
    """127.0.0.1:`port` → 127.0.0.1:`target`, every chunk towards the
    target held `delay_s` (in order); answers pass at once."""

    def __init__(self, target: int, delay_s: float) -> None:
        self.target, self.delay_s = target, delay_s
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(16)
        self.port = self.lsock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            s = socket.create_connection(("127.0.0.1", self.target))
            for sock in (c, s):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pipe, args=(c, s, self.delay_s), daemon=True).start()
            threading.Thread(target=self._pipe, args=(s, c, 0.0), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if delay_s:
                    threading.Timer(delay_s, DelayProxy._send, args=(dst, data)).start()
                else:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            time.sleep(delay_s)
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    _order = threading.Lock()

    @staticmethod
    def _send(dst: socket.socket, data: bytes) -> None:
        # Timers of equal delay fire in the order they were started.
        with DelayProxy._order:
            try:
                dst.sendall(data)
            except OSError:
                pass


def node_b(py, model, out, tag, ec):
    probe, result, log = out / f"{tag}.probe.jsonl", out / f"{tag}.json", out / f"{tag}.log"
    for p in (probe, result):
        p.unlink(missing_ok=True)
    cmd = [*NS, py, str(HERE / "defer_node.py"), str(model), str(result)]
    if ec is not None:
        cmd += ["--ec", json.dumps(ec)]
    env = harness.base_env("stock", probe)
    with open(log, "w") as lf:
        proc = subprocess.run(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT, cwd=HERE, timeout=1200)
    r = json.loads(result.read_text()) if result.exists() else {}
    pending = [s for s, p in r.get("steps", []) if p]
    def pct(xs, q):
        return round(statistics.quantiles(xs, n=100)[q - 1] * 1e3, 1) if len(xs) >= 2 else None

    after = [s for i, (s, p) in enumerate(r.get("steps", [])) if not p and i > 4]  # decode, past warm-up

    counts = encoder_counts(probe, r.get("pass_t", []))
    return {
        "run": tag,
        "rc": proc.returncode,
        "longest_gap_ms": None if r.get("longest_gap_s") is None else round(r["longest_gap_s"] * 1e3, 1),
        "steps_with_images": len(pending),
        "step_p50_ms_images": pct(pending, 50),
        "step_p99_ms_images": pct(pending, 99),
        "step_max_ms_images": round(max(pending) * 1e3, 1) if pending else None,
        "step_p50_ms_after": pct(after, 50),
        "step_p99_ms_after": pct(after, 99),
        "encoded": counts.get("encoded"),
        "ec_hits": counts.get("ec_hits"),
        "fetched": counts.get("fetched"),
        "_tokens": r.get("images_tokens"),
        "tracebacks": log.read_text(errors="replace").count("Traceback"),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", required=True)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("e2e-defer"))
    ap.add_argument("--delays", default="0.2,0.3,0.95")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    model = harness.tiny_model(args.python, args.model, out, 64)
    port = free_port()
    secret = make_secret(out)
    store = f"pinshm_ec_defer_{os.getpid()}"
    extra = {"store": store, "size": "64m", "secret_file": str(secret)}
    ec = {"ec_connector": "PinshmECConnector", "ec_connector_module_path": MODULE}
    ec_a = {**ec, "ec_role": "ec_both", "ec_connector_extra_config": {**extra, "serve": f"127.0.0.1:{port}"}}

    def consumer(peer_port):
        peers = [] if peer_port is None else [f"127.0.0.1:{peer_port}"]
        return {**ec, "ec_role": "ec_consumer", "ec_connector_extra_config": {**extra, "peers": peers}}

    runs = [node_b(args.python, model, out, "stock", None)]
    hold_a = out / "hold-A"
    hold_a.write_text("")
    a = start(args.python, model, out, "A", ec_a, 1, hold_a, NS)
    try:
        assert wait_result(a), "node A did not finish its pass"
        runs.append(node_b(args.python, model, out, "no peer", consumer(None)))
        runs.append(node_b(args.python, model, out, "peer", consumer(port)))
        for d in (float(x) for x in args.delays.split(",")):
            proxy = DelayProxy(port, d)
            runs.append(node_b(args.python, model, out, f"peer +{d * 1e3:.0f} ms", consumer(proxy.port)))
            proxy.lsock.close()
    finally:
        hold_a.unlink(missing_ok=True)
        time.sleep(2)
        if a["proc"].poll() is None:
            os.killpg(a["proc"].pid, signal.SIGKILL)
    stock = runs[0].pop("_tokens")
    for r in runs[1:]:
        r["tokens_equal_stock"] = r.pop("_tokens") == stock
    (out / "defer-summary.json").write_text(json.dumps(runs, indent=1))
    print(table(runs))


def table(runs):
    rows = [
        "| node B | exit | text: longest gap | steps with images pending | step p50 / p99 / max then | step p50 / p99 after "
        "| image encoder items | hits (fetched) | tokens = stock |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        rows.append(
            f"| {r['run']} | {r['rc']} | {r['longest_gap_ms']} ms | {r['steps_with_images']} | "
            f"{r['step_p50_ms_images']} / {r['step_p99_ms_images']} / {r['step_max_ms_images']} ms | {r['step_p50_ms_after']} / "
            f"{r['step_p99_ms_after']} ms | {r['encoded']} | {r['ec_hits']} ({r['fetched']}) | "
            f"{r.get('tokens_equal_stock', 'baseline')} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
