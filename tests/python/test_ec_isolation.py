"""The remote tier's isolation (docs/security.md): an authenticated peer
that widens the region it was given reads and writes nothing of the
engine, a WRITE into the region changes no byte a rank reads, and the
serving process listens where told, holds none of the engine's
environment and lives exactly as long as its engine. The attacker is a
real NIXL agent over UCX TCP on 127.0.0.1. Skipped where NIXL is not
installed (unless PINSHM_REQUIRE_NIXL=1)."""

import ctypes
import os
import socket
import time

import numpy as np
from _ec_remote import free_port, nixl_or_skip
from _ec_security import ask, listening, lookup, served  # noqa: F401 - a fixture

import pinshm
from pinshm.vllm.ec.remote import nixl

# ---- an authenticated peer reaches the served region alone, read-only --


def widened(meta, base, length):
    """NIXL metadata whose registration of (`base`, `length`) now claims
    nearly the whole address space, as the review's attacker made it: the
    client's own NIXL then posts any address, and UCX over TCP does not
    check it."""
    import struct

    at = struct.pack("<QQ", base, length)
    assert meta.count(at) == 1, "the registration is where NIXL 1.5 serializes it"
    return meta.replace(at, struct.pack("<QQ", 4096, (1 << 47) - 8192))


class Attacker:
    """A NIXL agent of a peer that holds the secret, given the serving
    process's metadata by hello, widened."""

    def __init__(self, s):
        self.agent = nixl.agent(f"attacker-{os.getpid()}", progress=False)
        self.sock = s.client()
        hello = ask(self.sock, {"op": "hello"})
        self.base, self.length = hello["base"], hello["length"]
        self.peer = self.agent.add_remote_agent(widened(hello["meta"], self.base, self.length))
        self.buf = np.zeros(1 << 16, dtype=np.uint8)
        self.reg = self.agent.register_memory([(self.buf.ctypes.data, self.buf.nbytes, 0, "")], "DRAM")

    def xfer(self, op, remote, n, data=None):
        """`op` ("READ" or "WRITE") of `n` bytes at `remote` in the serving
        process: its final state."""
        if data is not None:
            self.buf[:n] = np.frombuffer(data, dtype=np.uint8)
        else:
            self.buf[:n] = 0
        local = self.agent.get_xfer_descs([(self.buf.ctypes.data, n, 0)], "DRAM")
        far = self.agent.get_xfer_descs([(remote, n, 0)], "DRAM")
        try:
            x = self.agent.initialize_xfer(op, local, far, self.peer)
            state = self.agent.transfer(x)
            t = time.monotonic()
            while state == "PROC" and time.monotonic() - t < 5:
                time.sleep(0.001)
                state = self.agent.check_xfer_state(x)
        except Exception as e:  # noqa: BLE001 - NIXL says the remote went away
            return f"error: {type(e).__name__}"
        return state

    def close(self):
        nixl.release(self, "agent", safe=False)


def _heap_of(pid):
    """The bytes of process `pid`'s heap (root, or its own user: /proc/PID/mem)."""
    for line in open(f"/proc/{pid}/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            with open(f"/proc/{pid}/mem", "rb") as mem:
                mem.seek(lo)
                return mem.read(hi - lo)
    return b""


def test_a_peer_that_widens_its_region_reads_and_writes_nothing_of_the_engine(served):
    s = served()
    # A secret of the engine core (this process: the Server's), by address.
    secret = ctypes.create_string_buffer(b"ENGINE-CORE-SECRET-" + os.urandom(8).hex().encode())
    want = bytes(secret.raw)
    at = ctypes.addressof(secret)
    a = Attacker(s)
    try:
        # The rig works: a READ inside the region, at a looked-up place, reads the output.
        place = lookup(a.sock, "k2")
        assert a.xfer("READ", a.base + place["offset"], place["nbytes"]) == "DONE"
        assert a.buf[: place["nbytes"]].tobytes() == s.arrays["k2"].tobytes()
        # Outside it, the widening works: the NIXL process's heap reads,
        # and holds no key of the deployment (those are in the serving
        # process, which has no agent).
        pid = s.server.nixl_pid
        heap = [line.split("-")[0] for line in open(f"/proc/{pid}/maps") if line.rstrip().endswith("[heap]")]
        assert a.xfer("READ", int(heap[0], 16), 1 << 16) == "DONE", "a widened READ reaches the NIXL process"
        assert want not in a.buf.tobytes()
        if os.geteuid() == 0:  # /proc/PID/mem of a process that is not dumpable: root's
            from zmq.utils import z85

            keys = [k for z in (s.keys.server_secret, s.keys.client_secret) for k in (z, z85.decode(z))]
            mem = _heap_of(pid)
            assert mem and not any(k in mem for k in keys), "a key of the deployment in the NIXL process's heap"
        # At the engine core's secret: the NIXL process's own memory there
        # (or none, and it dies), never the engine's.
        state = a.xfer("READ", at, len(want))
        assert want not in a.buf.tobytes(), f"the engine core's secret read ({state})"
        if s.server.nixl_pid == pid:
            state = a.xfer("WRITE", at, len(want), b"X" * len(want))
        assert bytes(secret.raw) == want, "the engine core's memory changed"
        print(f"widened READ and WRITE at the engine's secret: {state}, NIXL process {pid} -> {s.server.nixl_pid}")
    finally:
        a.close()


def test_a_write_into_the_served_region_changes_no_byte_a_rank_reads(served):
    s = served()
    reader = pinshm.StoreReader.attach(s.store.handle())
    a = Attacker(s)
    try:
        place = lookup(a.sock, "k1")
        pid = s.server.nixl_pid
        state = a.xfer("WRITE", a.base + place["offset"], 4096, b"\xee" * 4096)
        assert state != "DONE", "a WRITE into the read-only region completed"
        assert np.array_equal(np.asarray(reader.get_tensor(reader.lookup("k1"))), s.arrays["k1"]), "a rank reads the output unchanged"
        # Its NIXL process died on its read-only page; the next hello
        # starts another (a new agent, a new generation).
        fresh = s.client()
        deadline = time.monotonic() + 30
        while (hello := ask(fresh, {"op": "hello"}, 2000)) is None or "error" in hello:
            assert time.monotonic() < deadline, hello
        assert s.server.nixl_pid not in (None, pid) and s.server.restarts == 1
        assert lookup(fresh, "k1") is not None
    finally:
        a.close()
        reader.close()


# ---- where it listens, and what it leaves alone ------------------------


def _blocks(name):
    return os.stat(f"/dev/shm/{name}").st_blocks * 512


def test_reads_of_the_whole_advertised_region_allocate_nothing(served):
    s = served()
    a = Attacker(s)
    try:
        before, free = _blocks(s.store.name), os.statvfs("/dev/shm").f_bfree
        for at in range(0, a.length, 1 << 16):
            n = min(1 << 16, a.length - at)
            assert a.xfer("READ", a.base + at, n) == "DONE", at
        assert _blocks(s.store.name) == before, "a READ allocated pages of the store"
        # Nothing else of /dev/shm grew by the store's size either.
        assert free - os.statvfs("/dev/shm").f_bfree < (a.length >> 12) // 8
    finally:
        a.close()


def test_a_sparse_store_another_engine_made_is_not_served(served, caplog):
    import logging

    s = served(sparse=True)
    before = _blocks(s.store.name)
    with caplog.at_level(logging.ERROR, logger="vllm.pinshm.ec"):
        hello = ask(s.client(), {"op": "hello"})
    assert hello is not None and "not reserved" in hello.get("error", ""), hello
    assert "meta" not in hello, "no registration handed out"
    assert any("is sparse" in m and "reserve" in m for m in caplog.messages), caplog.messages
    assert s.server.nixl_pid is not None
    maps = open(f"/proc/{s.server.nixl_pid}/maps").read()
    assert "/dev/shm/" not in maps, "the NIXL process maps nothing of it"
    assert _blocks(s.store.name) == before


def test_the_serving_process_listens_on_the_interface_serve_names_alone(served):
    s = served()
    ask(s.client(), {"op": "hello"})  # UCX's listener is up
    where = listening(s.server.pid) + listening(s.server.nixl_pid)
    assert (("127.0.0.1", s.port)) in where
    assert len(where) >= 2, f"the endpoint and UCX's listener: {where}"
    assert all(addr == "127.0.0.1" for addr, _ in where), f"loopback stays loopback: {where}"


def test_the_serving_process_holds_no_writable_mapping_of_the_store(served):
    s = served()
    ask(s.client(), {"op": "hello"})
    assert not [line for line in open(f"/proc/{s.server.pid}/maps") if "/dev/shm/" in line], "the endpoint maps none"
    maps = [line.split() for line in open(f"/proc/{s.server.nixl_pid}/maps") if "/dev/shm/" in line]
    assert maps, "the region is mapped"
    assert all(m[1].startswith("r--") for m in maps), f"only read-only mappings of shared memory: {maps}"


def test_ucx_settings_stay_out_of_the_process_environment(served, monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    a = nixl.agent(f"env-{os.getpid()}", progress=False)
    try:
        assert "UCX_TLS" not in os.environ, "pinshm's UCX settings leaked into the environment"
    finally:
        holder = type("H", (), {"_agent": a})()
        nixl.release(holder)


def test_the_serving_process_keeps_none_of_the_engines_environment_but_what_it_needs(served, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_not_for_the_serving_process")
    monkeypatch.setenv("UCX_LOG_LEVEL", "warn")
    s = served()
    for pid in (s.server.pid, s.server.nixl_pid):
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        assert not any(e.startswith(b"HF_TOKEN=") for e in environ), "the engine's token reached a child"
        assert b"UCX_LOG_LEVEL=warn" in environ, "UCX's settings do"


SERVER_IN_A_PROCESS = r"""
import os, sys, threading, numpy as np, pinshm
from pinshm.vllm.ec.remote import producer
from pinshm.vllm.ec._config import ECSettings
store = pinshm.ObjectStore(1 << 20, 1 << 16, 4, name=sys.argv[1], cache=True, key_index=64)
made = []
# Built in a thread that then ends, as an engine may build it.
t = threading.Thread(target=lambda: made.append(producer.Server(ECSettings.from_extra(
    {"store": sys.argv[1], "serve": "127.0.0.1:" + sys.argv[2], "secret_file": sys.argv[3], "retry_s": 0}))))
t.start(); t.join()
print("SERVING", made[0].pid, flush=True)
sys.stdin.readline()
print("STILL", made[0].pid, made[0].restarts, flush=True)
sys.stdin.readline()
"""


def test_the_serving_process_outlives_the_thread_that_built_it_and_dies_with_the_engine(unique_name, tmp_path):
    import signal
    import subprocess
    import sys

    from _ec_remote import make_secret

    nixl_or_skip()
    name = unique_name("ec-sec")
    engine = subprocess.Popen(
        [sys.executable, "-c", SERVER_IN_A_PROCESS, name, str(free_port()), make_secret(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = next(x for x in engine.stdout if x.startswith("SERVING")).split()
        serving = int(line[1])
        time.sleep(1)
        engine.stdin.write("\n")
        engine.stdin.flush()
        still = next(x for x in engine.stdout if x.startswith("STILL")).split()
        assert still[1:] == [str(serving), "0"], f"the serving process died with the thread that built it: {still}"
        engine.send_signal(signal.SIGKILL)  # vLLM SIGKILLs its engine core
        engine.wait()
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{serving}") and open(f"/proc/{serving}/stat").read().split()[2] != "Z":
            assert time.monotonic() < deadline, "the serving process outlived its engine"
            time.sleep(0.05)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
        if os.path.exists("/dev/shm/" + name):
            os.unlink("/dev/shm/" + name)
