"""The remote tier's defences (docs/security.md), each against the attack
it stops: peers without the deployment's secret get nothing; an
authenticated peer that widens the region it was given reads and writes
nothing of the engine, and a WRITE into the region changes no byte a
rank reads; one peer cannot lock out another, nor end its lease; the
endpoints listen where told. The producer is a real `Server` (its
serving process a real process), the attacker a real NIXL agent and
real ZeroMQ sockets, over UCX TCP on 127.0.0.1. Skipped where NIXL is
not installed (unless PINSHM_REQUIRE_NIXL=1)."""

import ctypes
import os
import socket
import time

import numpy as np
import pytest
from _ec_remote import free_port, make_secret, nixl_or_skip

import pinshm
from pinshm.vllm.ec import _serve, _served, _wire
from pinshm.vllm.ec._config import ECSettings
from pinshm.vllm.ec._secret import derive, read_secret, secure_client

ROWS = 64


class Served:
    """A store with outputs, served by a real Server, and the secret."""

    def __init__(self, name, secret, port, **extra):
        self.port = port
        self.keys = derive(read_secret(secret))
        self.store = pinshm.ObjectStore(32 << 20, 8 << 20, 4, name=name, cache=True, key_index=64)
        self.arrays = {}
        for i in range(4):
            a = np.random.default_rng(i).random((ROWS, 64), dtype=np.float32)
            self.store.put_tensor(f"k{i}", a)
            self.arrays[f"k{i}"] = a
        settings = dict({"store": name, "serve": f"127.0.0.1:{port}", "retry_s": 0, "secret_file": secret}, **extra)
        self.server = _serve.Server(ECSettings.from_extra(settings), nofile=extra.get("_nofile"))
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
    sock.send(_wire.pack(msg))
    if not sock.poll(timeout_ms):
        return None
    return _wire.unpack(sock.recv())


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
    assert not _wire._LIVE, "every agent of this process released"


def _cpu_s(pid):
    """User and system CPU seconds of process `pid` so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    return 0


# ---- no secret, no answer ---------------------------------------------


def test_serve_and_peers_refuse_to_start_without_a_secret_and_say_how_to_make_one(monkeypatch, caplog):
    monkeypatch.delenv("PINSHM_EC_SECRET_FILE", raising=False)
    for extra in ({"serve": "127.0.0.1:7100"}, {"peers": ["127.0.0.1:7100"]}):
        with pytest.raises(ValueError) as e:
            ECSettings.from_extra(extra)
        said = str(e.value)
        assert "secret_file" in said and "chmod 600" in said and next(iter(extra)) in said
    # Insecure only when asked for, by name.
    assert ECSettings.from_extra({"serve": "127.0.0.1:7100", "insecure": True}).insecure
    assert ECSettings.from_extra({}).secret_file is None, "no remote tier, no secret needed"


@pytest.mark.parametrize(
    "mode, size, said",
    [(0o644, 32, "mode 0644"), (0o640, 32, "mode 0640"), (0o600, 16, "holds 16 bytes"), (0o400, 32, None)],
)
def test_a_secret_file_others_may_read_or_too_short_is_refused(tmp_path, mode, size, said):
    from pinshm.vllm.ec._secret import SecretError

    path = make_secret(tmp_path, mode=mode, size=size)
    if said is None:
        assert len(read_secret(path)) == size
        return
    with pytest.raises(SecretError) as e:
        read_secret(path)
    assert said in str(e.value) and "head -c 32 /dev/urandom" in str(e.value)


def test_a_secret_file_of_another_user_is_refused(tmp_path):
    from pinshm.vllm.ec._secret import SecretError

    path = make_secret(tmp_path)
    if os.geteuid() != 0:
        pytest.skip("needs root to give the file to another user")
    os.chown(path, 65534, 65534)
    with pytest.raises(SecretError, match="belongs to uid 65534"):
        read_secret(path)


def test_the_derived_keys_differ_per_secret_and_never_print():
    a, b = derive(b"a" * 32, "one"), derive(b"b" * 32, "two")
    assert a.server_public != b.server_public and a.client_secret != b.client_secret
    assert a == derive(b"a" * 32, "one"), "both ends derive the same keys"
    assert a.server_secret.decode() not in repr(a) and repr(a) == "Keys(from 'one')"


def test_a_client_without_the_secret_gets_nothing_and_costs_the_server_nothing_lasting(served):
    import zmq

    s = served()
    pid = s.server.pid
    assert ask(s.client(), {"op": "hello"})["agent"], "the deployment's own client is answered"
    lookups = s.server.lookups
    time.sleep(0.5)
    rss0, cpu0 = _rss(pid), _cpu_s(pid)
    strangers = derive(os.urandom(32))
    # 10,000 messages: 9,600 raw connections (a ZMTP greeting asking for
    # NULL, then a request; or bytes that are no greeting), and 400 CURVE
    # clients of another secret, each sending its hello.
    greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32
    heard = b""
    for batch in range(48):
        conns = []
        for i in range(200):
            c = socket.create_connection(("127.0.0.1", s.port))
            c.sendall((greeting if i % 2 else os.urandom(64)) + _wire.pack({"op": "hello"}))
            conns.append(c)
        for c in conns:
            c.settimeout(0.001 if batch % 8 else 0.2)
            try:
                heard += c.recv(4096)
            except (TimeoutError, ConnectionResetError, socket.timeout):
                pass
            c.close()
    # Half know the server's public key (it leaked, say) but not the
    # client's: refused by the ZAP check; half know neither.

    leaked = type(strangers)(
        s.keys.server_public, b"", *zmq.curve_keypair(), source="a stranger who knows the server's public key"
    )
    for round_ in range(4):
        socks = [s.client(keys=leaked if round_ % 2 else strangers) for _ in range(100)]
        for c in socks:
            c.send(_wire.pack({"op": "lookup" if round_ // 2 else "hello", "key": "k1"}))
        time.sleep(0.2)
        assert not any(c.poll(0, zmq.POLLIN) for c in socks), "an answer to a client of another secret"
        for c in socks:
            c.close(0)
            s.socks.remove(c)
    assert b"meta" not in heard and b"agent" not in heard, "no metadata to a stranger"
    assert s.server.lookups == lookups, "no lookup of a stranger reached the server"
    time.sleep(3)  # past the handshake interval: every stranger's connection closed
    cpu = _cpu_s(pid)
    time.sleep(2)
    idle = _cpu_s(pid) - cpu
    grew = _rss(pid) - rss0
    assert idle < 0.2, f"the serving process used {idle:.2f} s of CPU in 2 s after the flood"
    assert grew < 16 << 20, f"the serving process grew by {grew >> 20} MiB"
    assert s.server.pid == pid, "it never died"
    assert ask(s.client(), {"op": "lookup", "key": "k1"})["found"], "the deployment's client is still answered"
    print(f"flood: {_cpu_s(pid) - cpu0:.2f} s CPU in all, {grew >> 10} KiB more RSS")


def _flood(port, n):
    conns = []
    for _ in range(n):
        try:
            conns.append(socket.create_connection(("127.0.0.1", port), timeout=1))
        except OSError:
            break
    return conns


def test_a_flood_of_idle_connections_is_closed_and_spins_no_core(served):
    s = served()
    pid = s.server.pid
    known = s.client()
    assert ask(known, {"op": "hello"})["agent"]
    conns = _flood(s.port, 2000)
    cpu = _cpu_s(pid)
    answered = ask(known, {"op": "lookup", "key": "k0"}, timeout_ms=2000)
    time.sleep(1)
    busy = _cpu_s(pid) - cpu
    assert answered is not None and answered["found"], "a peer is answered during the flood"
    assert busy < 0.5, f"the serving process used {busy:.2f} s of CPU in 1 s with {len(conns)} idle connections"
    # Past the handshake interval, the server has closed every one.
    time.sleep(_served.HANDSHAKE_MS / 1000 + 1)
    for c in conns:
        c.settimeout(0.05)
        try:
            while c.recv(1 << 16):  # its greeting (the same to all), then the end
                pass
        except ConnectionResetError:
            pass
        except socket.timeout:
            raise AssertionError("a stranger's idle connection still open after the handshake interval") from None
        c.close()


def test_a_flood_past_the_descriptor_table_leaves_peers_answered(served):
    # libzmq's listener retries a failed accept at once (a core spins
    # while every descriptor is taken): the serving process raises its
    # descriptor limit to the hard limit, so that such a flood needs that
    # many connections within the handshake interval (docs/security.md).
    s = served(_nofile=256)
    pid = s.server.pid
    known = s.client()
    assert ask(known, {"op": "hello"})["agent"]
    conns = _flood(s.port, 400)
    answered = ask(known, {"op": "lookup", "key": "k0"}, timeout_ms=5000)
    for c in conns:
        c.close()
    assert answered is not None and answered["found"], "a peer connected before the flood is answered during it"
    time.sleep(1)
    cpu = _cpu_s(pid)
    time.sleep(1)
    assert _cpu_s(pid) - cpu < 0.2, "no core spins once the flood's connections are closed"
    assert ask(s.client(), {"op": "lookup", "key": "k1"}, timeout_ms=10000)["found"], "a new peer is answered after"
    assert s.server.pid == pid


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
        self.agent = _wire.agent(f"attacker-{os.getpid()}", progress=False)
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
        _wire.release(self, "agent", safe=False)


def _wait_restarted(s, pid, timeout=30):
    deadline = time.monotonic() + timeout
    while s.server.pid in (None, pid):
        assert time.monotonic() < deadline, "the serving process was not started again"
        time.sleep(0.05)


def test_a_peer_that_widens_its_region_reads_and_writes_nothing_of_the_engine(served):
    s = served()
    # A secret of the engine core (this process: the Server's), by address.
    secret = ctypes.create_string_buffer(b"ENGINE-CORE-SECRET-" + os.urandom(8).hex().encode())
    want = bytes(secret.raw)
    at = ctypes.addressof(secret)
    a = Attacker(s)
    try:
        # The rig works: a READ inside the region, at a looked-up place, reads the output.
        place = ask(a.sock, {"op": "lookup", "key": "k2"})
        assert a.xfer("READ", a.base + place["offset"], place["nbytes"]) == "DONE"
        assert a.buf[: place["nbytes"]].tobytes() == s.arrays["k2"].tobytes()
        # Outside it, the widening works: the serving process's heap reads.
        pid = s.server.pid
        heap = [line.split("-")[0] for line in open(f"/proc/{pid}/maps") if line.rstrip().endswith("[heap]")]
        assert a.xfer("READ", int(heap[0], 16), 1 << 16) == "DONE", "a widened READ reaches the serving process"
        assert want not in a.buf.tobytes()
        # At the engine core's secret: the serving process's own memory
        # there (or none, and it dies), never the engine's.
        state = a.xfer("READ", at, len(want))
        assert want not in a.buf.tobytes(), f"the engine core's secret read ({state})"
        if s.server.pid == pid:
            state = a.xfer("WRITE", at, len(want), b"X" * len(want))
        assert bytes(secret.raw) == want, "the engine core's memory changed"
        print(f"widened READ and WRITE at the engine's secret: {state}, serving process {pid} -> {s.server.pid}")
    finally:
        a.close()


def test_a_write_into_the_served_region_changes_no_byte_a_rank_reads(served):
    s = served()
    reader = pinshm.StoreReader.attach(s.store.handle())
    a = Attacker(s)
    try:
        place = ask(a.sock, {"op": "lookup", "key": "k1"})
        pid = s.server.pid
        state = a.xfer("WRITE", a.base + place["offset"], 4096, b"\xee" * 4096)
        assert state != "DONE", "a WRITE into the read-only region completed"
        assert np.array_equal(np.asarray(reader.get_tensor(reader.lookup("k1"))), s.arrays["k1"]), "a rank reads the output unchanged"
        # Its serving process died on its read-only page; another serves.
        _wait_restarted(s, pid)
        assert s.server.restarts == 1
        fresh = s.client()
        deadline = time.monotonic() + 30
        while (hello := ask(fresh, {"op": "hello"}, 2000)) is None or "error" in hello:
            assert time.monotonic() < deadline, hello
        assert ask(fresh, {"op": "lookup", "key": "k1"})["found"]
    finally:
        a.close()
        reader.close()


# ---- no lock-out -------------------------------------------------------


def test_one_peer_pipelining_10000_lookups_leaves_another_peers_answered(served):
    import zmq

    s = served()
    s.client()  # makes the context
    greedy = s.ctx.socket(zmq.DEALER)
    greedy.setsockopt(zmq.LINGER, 0)
    greedy.setsockopt(zmq.SNDHWM, 0)
    greedy.setsockopt(zmq.RCVHWM, 0)
    secure_client(greedy, s.keys)
    greedy.connect(f"tcp://127.0.0.1:{s.port}")
    s.socks.append(greedy)
    for i in range(10_000):
        greedy.send_multipart([b"", _wire.pack({"op": "lookup", "key": f"k{i % 4}"})])
    found = 0
    for _ in range(10_000):
        assert greedy.poll(30_000), "the server stopped answering the greedy peer"
        found += bool(_wire.unpack(greedy.recv_multipart()[-1]).get("found"))
    assert found == _serve.PEER_LEASES, f"{found} leases to one peer (its share: {_serve.PEER_LEASES})"
    other = s.client()
    for key in ("k0", "k3"):
        answer = ask(other, {"op": "lookup", "key": key})
        assert answer["found"], "another peer is still answered"
        assert ask(other, {"op": "done", "lease": answer["lease"]}) == {"stable": True}


def test_a_peer_cannot_end_another_peers_lease_and_lease_ids_are_random(served):
    s = served()
    alice, mallory = s.client(routing_id=b"alice"), s.client(routing_id=b"mallory")
    answers = [ask(alice, {"op": "lookup", "key": "k0"}) for _ in range(3)]
    ids = [x["lease"] for x in answers]
    assert len(set(ids)) == 3 and all(len(i) == 16 for i in ids)
    # Mallory names Alice's lease: told nothing, and the lease stays Alice's.
    assert ask(mallory, {"op": "done", "lease": ids[0]}) == {"stable": False}
    assert ask(mallory, {"op": "done", "lease": bytes(16)}) == {"stable": False}
    assert ask(alice, {"op": "done", "lease": ids[0]}) == {"stable": True}
    assert ask(alice, {"op": "done", "lease": ids[0]}) == {"stable": False}, "ended once"


def test_an_expired_lease_stops_counting_at_once(served):
    s = served(lease_ttl_s=0.3)
    sock = s.client()
    got = [ask(sock, {"op": "lookup", "key": "k0"})["found"] for _ in range(_serve.PEER_LEASES + 1)]
    assert got == [True] * _serve.PEER_LEASES + [False], "its share, then no more"
    time.sleep(0.3 + 2 * _serve.POLL_S)
    assert ask(sock, {"op": "lookup", "key": "k0"})["found"], "the expired leases no longer count"


# ---- where it listens, and what it leaves alone ------------------------


def _listening(pid):
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


def test_the_serving_process_listens_on_the_interface_serve_names_alone(served):
    s = served()
    ask(s.client(), {"op": "hello"})  # UCX's listener is up
    where = _listening(s.server.pid)
    assert (("127.0.0.1", s.port)) in where
    assert len(where) >= 2, f"the endpoint and UCX's listener: {where}"
    assert all(addr == "127.0.0.1" for addr, _ in where), f"loopback stays loopback: {where}"


def test_the_serving_process_holds_no_writable_mapping_of_the_store(served):
    s = served()
    ask(s.client(), {"op": "hello"})
    maps = [line.split() for line in open(f"/proc/{s.server.pid}/maps") if "/dev/shm/" in line]
    assert maps, "the region is mapped"
    assert all(m[1].startswith("r--") for m in maps), f"only read-only mappings of shared memory: {maps}"


def test_ucx_settings_stay_out_of_the_process_environment(served, monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    a = _wire.agent(f"env-{os.getpid()}", progress=False)
    try:
        assert "UCX_TLS" not in os.environ, "pinshm's UCX settings leaked into the environment"
    finally:
        holder = type("H", (), {"_agent": a})()
        _wire.release(holder)


def test_many_connections_from_one_address_share_one_budget(served):
    import zmq

    s = served()
    s.client()
    greedy = []
    for _ in range(20):  # 20 x 64 leases would be 1280
        g = s.ctx.socket(zmq.DEALER)
        g.setsockopt(zmq.LINGER, 0)
        secure_client(g, s.keys)
        g.connect(f"tcp://127.0.0.1:{s.port}")
        s.socks.append(g)
        greedy.append(g)
    for g in greedy:
        for _ in range(100):
            g.send_multipart([b"", _wire.pack({"op": "lookup", "key": "k0"})])
    found = 0
    for g in greedy:
        for _ in range(100):
            assert g.poll(30_000)
            found += bool(_wire.unpack(g.recv_multipart()[-1]).get("found"))
    assert found == _serve.ADDRESS_LEASES, f"{found} leases to one address"
    # A peer at another address is answered.
    other = s.ctx.socket(zmq.REQ)
    other.setsockopt(zmq.LINGER, 0)
    secure_client(other, s.keys)
    other.connect(f"tcp://127.0.0.2:0;127.0.0.1:{s.port}")
    s.socks.append(other)
    assert ask(other, {"op": "lookup", "key": "k1"})["found"]


def test_the_serving_process_keeps_none_of_the_engines_environment_but_what_it_needs(served, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_not_for_the_serving_process")
    monkeypatch.setenv("UCX_LOG_LEVEL", "warn")
    s = served()
    environ = open(f"/proc/{s.server.pid}/environ", "rb").read().split(b"\0")
    assert not any(e.startswith(b"HF_TOKEN=") for e in environ), "the engine's token reached the serving process"
    assert b"UCX_LOG_LEVEL=warn" in environ, "UCX's settings do"


SERVER_IN_A_PROCESS = r"""
import os, sys, threading, numpy as np, pinshm
from pinshm.vllm.ec import _serve
from pinshm.vllm.ec._config import ECSettings
store = pinshm.ObjectStore(1 << 20, 1 << 16, 4, name=sys.argv[1], cache=True, key_index=64)
made = []
# Built in a thread that then ends, as an engine may build it.
t = threading.Thread(target=lambda: made.append(_serve.Server(ECSettings.from_extra(
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
