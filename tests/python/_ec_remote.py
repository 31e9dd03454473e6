"""Helpers of the remote tier's tests (test_ec_remote.py): a producer node
in a process of its own (a stand-in engine whose scheduler serves its
store), peers that misbehave, and NIXL's presence."""

import importlib.util
import multiprocessing as mp
import os
import socket
import threading

import pytest

#: Every output of the stand-in encoder is 64 x 64 float32: 16 KiB.


def nixl_or_skip():
    """Skips where NIXL is not importable, unless PINSHM_REQUIRE_NIXL=1
    (set by .ci/run, which installs it): then that is a failure."""
    for name in ("nixl_cu12", "nixl_cu13", "nixl"):
        if importlib.util.find_spec(name) is not None:
            return
    if os.environ.get("PINSHM_REQUIRE_NIXL") == "1":
        pytest.fail("PINSHM_REQUIRE_NIXL=1 but NIXL is not installed (pip install --no-deps nixl-cu12)")
    pytest.skip("NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1 numpy)")


def make_secret(directory, mode=0o600, size=32):
    """A secret file for the remote tier (docs/security.md)."""
    path = os.path.join(str(directory), "ec-secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, os.urandom(size))
    os.close(fd)
    os.chmod(path, mode)
    return path


def peer_keys():
    """The derived keys of the secret the test's environment names."""
    from pinshm.vllm.ec.remote.keys import derive, read_secret

    return derive(read_secret(os.environ["PINSHM_EC_SECRET_FILE"]))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def producer_main(conn, extra, images, rows=None):
    """A producer node: an ec_both engine whose scheduler serves its store;
    saves `images`, then obeys the test ("save" more, "stats", "stop")."""
    import multiprocessing

    from _ec_vllm import Engine

    os.setpgid(0, 0)  # a node: killed with its workers (ProducerNode.kill)
    e = Engine(multiprocessing.get_context("fork"), "ec_both", extra)
    try:
        e.step(images) if rows is None else e.step(images, rows)
        conn.send(("ready",))
        while True:
            msg = conn.recv()
            if msg[0] == "save":
                e.save(msg[1])
                conn.send(("saved",))
            elif msg[0] == "stats":
                s = e.ec_connector._server
                stats = dict(lookups=s.lookups, found=s.found, stable=s.stable, unstable=s.unstable)
                conn.send(("stats", dict(stats, lookup_requests=s.lookup_requests)))
            elif msg[0] == "stop":
                break
    finally:
        e.close()
    conn.send(("bye",))


class ProducerNode:
    """A producer node in a spawned process (its own NIXL agent, as a node
    of its own would have)."""

    def __init__(self, extra, images, rows=None):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=producer_main, args=(child, extra, list(images), rows))
        self.proc.start()
        self._expect("ready")

    def _expect(self, what, timeout=120):
        if not self.conn.poll(timeout):
            raise AssertionError(f"the producer node did not say {what}")
        msg = self.conn.recv()
        assert msg[0] == what, msg
        return msg

    def save(self, images):
        self.conn.send(("save", list(images)))
        self._expect("saved")

    def stats(self):
        self.conn.send(("stats",))
        return self._expect("stats")[1]

    def kill(self):
        """The whole node at once: the engine and its workers (SIGKILL)."""
        if self.proc.pid is not None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
        self.proc.join()

    def close(self):
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
                self._expect("bye", 60)
            except (AssertionError, OSError, EOFError):
                pass
            self.proc.join(30)
        self.kill()


class BadPeer:
    """A ZMQ endpoint that reads requests and answers with `answer(request)`
    (None: never answers, a peer that hangs). It holds the deployment's
    secret (a peer that lies, not a stranger) unless `keys` is False."""

    def __init__(self, port, answer, keys=True):
        import zmq

        from pinshm.vllm.ec.remote.keys import secure_server

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys:
            keys = peer_keys()
            secure_server(self.sock, keys.server_public, keys.server_secret)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.answer = answer
        self.requests = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        import zmq

        while not self.stop.is_set():
            if self.sock.poll(20, zmq.POLLIN):
                frames = self.sock.recv_multipart()
                self.requests += 1
                reply = self.answer(frames[-1])
                if reply is not None:
                    self.sock.send_multipart([*frames[:-1], reply])

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


class FakeRegion:
    """A NIXL agent of this process with 1 MiB registered, as a peer that
    answers hellos itself would have: its metadata and region are real (a
    consumer's first READ of it works), what it answers to lookups is up
    to the test. `release()` when done."""

    def __init__(self, name):
        import numpy as np

        from pinshm.vllm.ec.remote.nixl import agent

        self._agent = agent(name, progress=True)
        self.buf = np.zeros(1 << 20, np.uint8)
        self._agent.register_memory([(self.buf.ctypes.data, self.buf.nbytes, 0, "")], "DRAM")
        self.name, self.meta = name, self._agent.get_agent_metadata()
        self.base, self.length = int(self.buf.ctypes.data), self.buf.nbytes

    def hello(self):
        import msgpack

        return msgpack.packb(
            {"v": 4, "agent": self.name, "meta": self.meta, "base": self.base, "length": self.length, "gen": 1}
        )

    def release(self):
        from pinshm.vllm.ec.remote.nixl import release

        release(self, safe=False)
