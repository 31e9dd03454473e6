"""Helpers of the remote tier's security tests (test_ec_security.py,
test_ec_isolation.py): a store served by a real `Server`, clients with
the deployment's keys, others' or none, and what a process uses."""

import os
import socket

import numpy as np
import pytest
from _ec_remote import free_port, make_secret, nixl_or_skip

import pinshm
from pinshm.vllm.ec.remote import nixl, producer, protocol
from pinshm.vllm.ec._config import ECSettings
from pinshm.vllm.ec.remote.keys import derive, read_secret, secure_client

ROWS = 64


class Served:
    """A store with outputs, served by a real Server, and the secret."""

    def __init__(self, name, secret, port, sparse=False, **extra):
        self.port = port
        self.keys = derive(read_secret(secret))
        # Reserved, as a serving engine's own store; `sparse`: as another
        # engine's writer made without 'reserve'.
        self.store = pinshm.ObjectStore(32 << 20, 8 << 20, 4, name=name, cache=True, key_index=64, reserve=not sparse)
        self.arrays = {}
        for i in range(4):
            a = np.random.default_rng(i).random((ROWS, 64), dtype=np.float32)
            self.store.put_tensor(f"k{i}", a)
            self.arrays[f"k{i}"] = a
        settings = dict({"store": name, "serve": f"127.0.0.1:{port}", "retry_s": 0, "secret_file": secret}, **extra)
        self.server = producer.Server(ECSettings.from_extra(settings), nofile=extra.get("_nofile"))
        self.socks = []
        self.ctx = None

    def client(self, keys=None, plain=False, routing_id=None):
        """A REQ socket to the endpoint: with the deployment's keys, others'
        (`keys`), or none at all (`plain`)."""
        import zmq

        if self.ctx is None:
            self.ctx = zmq.Context()
        s = self.ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.REQ_RELAXED, 1)
        s.setsockopt(zmq.REQ_CORRELATE, 1)
        if routing_id is not None:
            s.setsockopt(zmq.ROUTING_ID, routing_id)
        if not plain:
            secure_client(s, keys or self.keys)
        s.connect(f"tcp://127.0.0.1:{self.port}")
        self.socks.append(s)
        return s

    def close(self):
        for s in self.socks:
            s.close(0)
        if self.ctx is not None:
            self.ctx.term()
        self.server.close()
        self.store.close()


def ask(sock, msg, timeout_ms=5000):
    """The answer to `msg`, or None if none comes in `timeout_ms`."""
    sock.send(protocol.pack(msg))
    if not sock.poll(timeout_ms):
        return None
    return protocol.unpack(sock.recv())


def lookup(sock, key):
    """The place a lookup of `key` answers (None: not found, or no answer)."""
    answer = ask(sock, {"op": "lookup", "keys": [key]})
    return None if answer is None else answer["found"][0]


def done(sock, lease):
    """Whether the producer said the READ under `lease` was stable."""
    return ask(sock, {"op": "done", "leases": [lease]})["stable"][0]


def found_one(answer):
    """Whether a lookup's answer of one key found it."""
    return answer.get("found", [None])[0] is not None


@pytest.fixture
def served(unique_name, tmp_path):
    nixl_or_skip()
    made = []

    def make(**extra):
        s = Served(unique_name("ec-sec"), make_secret(tmp_path), free_port(), **extra)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
    assert not nixl._LIVE, "every agent of this process released"


def cpu_s(pid):
    """User and system CPU seconds of process `pid` so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    return 0


def listening(pid):
    """(address, port) of every TCP socket process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table, size in (("tcp", 4), ("tcp6", 16)):
        for line in open(f"/proc/{pid}/net/{table}").readlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                addr, port = f[1].split(":")
                raw = bytes.fromhex(addr)
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, size, 4))
                out.append((socket.inet_ntop(socket.AF_INET if size == 4 else socket.AF_INET6, raw), int(port, 16)))
    return out
