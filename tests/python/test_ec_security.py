"""The remote tier's defences (docs/security.md) against peers without the
secret and greedy ones: no secret, no answer (10,000 messages of
strangers, floods of connections), and no lock-out (leases per
connection, per address, expiring at once, bound to their peer). The
producer is a real `Server` (its serving process a real process), the
clients real ZeroMQ sockets over 127.0.0.1. Skipped where NIXL is not
installed (unless PINSHM_REQUIRE_NIXL=1)."""

import os
import socket
import time

import pytest
from _ec_remote import make_secret
from _ec_security import ask, cpu_s, done, found_one, lookup, rss, served  # noqa: F401 - a fixture

from pinshm.vllm.ec.remote import budget, nixl, producer, protocol, serving_process
from pinshm.vllm.ec._config import ECSettings
from pinshm.vllm.ec.remote.keys import derive, read_secret, secure_client

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
    # A served store is reserved whole: READs of a sparse one's holes would
    # grow /dev/shm (anyone reaching UCX's port over TCP can make them).
    assert ECSettings.from_extra({"serve": "127.0.0.1:7100", "insecure": True}).reserve is True
    assert ECSettings.from_extra({"peers": ["127.0.0.1:7100"], "insecure": True}).reserve is False


@pytest.mark.parametrize(
    "mode, size, said",
    [(0o644, 32, "mode 0644"), (0o640, 32, "mode 0640"), (0o600, 16, "holds 16 bytes"), (0o400, 32, None)],
)
def test_a_secret_file_others_may_read_or_too_short_is_refused(tmp_path, mode, size, said):
    from pinshm.vllm.ec.remote.keys import SecretError

    path = make_secret(tmp_path, mode=mode, size=size)
    if said is None:
        assert len(read_secret(path)) == size
        return
    with pytest.raises(SecretError) as e:
        read_secret(path)
    assert said in str(e.value) and "head -c 32 /dev/urandom" in str(e.value)


def test_a_secret_file_of_another_user_is_refused(tmp_path):
    from pinshm.vllm.ec.remote.keys import SecretError

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
    rss0, cpu0 = rss(pid), cpu_s(pid)
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
            c.sendall((greeting if i % 2 else os.urandom(64)) + protocol.pack({"op": "hello"}))
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
            # A REQ whose handshake the server refused may have no pipe to
            # send on (it blocks for ever): undelivered is not answered.
            c.setsockopt(zmq.SNDTIMEO, 1000)
            try:
                c.send(protocol.pack({"op": "lookup", "keys": ["k1"]} if round_ // 2 else {"op": "hello"}))
            except zmq.Again:
                pass
        time.sleep(0.2)
        assert not any(c.poll(0, zmq.POLLIN) for c in socks), "an answer to a client of another secret"
        for c in socks:
            c.close(0)
            s.socks.remove(c)
    assert b"meta" not in heard and b"agent" not in heard, "no metadata to a stranger"
    assert s.server.lookups == lookups, "no lookup of a stranger reached the server"
    time.sleep(3)  # past the handshake interval: every stranger's connection closed
    cpu = cpu_s(pid)
    time.sleep(2)
    idle = cpu_s(pid) - cpu
    grew = rss(pid) - rss0
    assert idle < 0.2, f"the serving process used {idle:.2f} s of CPU in 2 s after the flood"
    assert grew < 16 << 20, f"the serving process grew by {grew >> 20} MiB"
    assert s.server.pid == pid, "it never died"
    assert lookup(s.client(), "k1") is not None, "the deployment's client is still answered"
    print(f"flood: {cpu_s(pid) - cpu0:.2f} s CPU in all, {grew >> 10} KiB more RSS")


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
    cpu = cpu_s(pid)
    answered = ask(known, {"op": "lookup", "keys": ["k0"]}, timeout_ms=2000)
    time.sleep(1)
    busy = cpu_s(pid) - cpu
    assert answered is not None and found_one(answered), "a peer is answered during the flood"
    assert busy < 0.5, f"the serving process used {busy:.2f} s of CPU in 1 s with {len(conns)} idle connections"
    # Past the handshake interval, the server has closed every one.
    time.sleep(serving_process.HANDSHAKE_MS / 1000 + 1)
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
    answered = ask(known, {"op": "lookup", "keys": ["k0"]}, timeout_ms=5000)
    for c in conns:
        c.close()
    assert answered is not None and found_one(answered), "a peer connected before the flood is answered during it"
    time.sleep(1)
    cpu = cpu_s(pid)
    time.sleep(1)
    assert cpu_s(pid) - cpu < 0.2, "no core spins once the flood's connections are closed"
    assert found_one(ask(s.client(), {"op": "lookup", "keys": ["k1"]}, timeout_ms=10000)), "a new peer is answered after"
    assert s.server.pid == pid


# ---- no lock-out -------------------------------------------------------


def test_one_peer_pipelining_10000_lookups_leaves_another_peers_answered(served):
    s = served()
    s.client()  # makes the context
    found = _greedy(s, ["127.0.0.1"], 1, 10_000, keys=[f"k{i}" for i in range(4)])
    assert found == budget.PEER_LEASES, f"{found} leases to one peer (its share: {budget.PEER_LEASES})"
    other = s.client()
    for key in ("k0", "k3"):
        answer = lookup(other, key)
        assert answer is not None, "another peer is still answered"
        assert done(other, answer["lease"]) is True


def test_a_peer_cannot_end_another_peers_lease_and_lease_ids_are_random(served):
    s = served()
    alice, mallory = s.client(routing_id=b"alice"), s.client(routing_id=b"mallory")
    answers = [lookup(alice, "k0") for _ in range(3)]
    ids = [x["lease"] for x in answers]
    assert len(set(ids)) == 3 and all(len(i) == 16 for i in ids)
    # Mallory names Alice's lease: told nothing, and the lease stays Alice's.
    assert done(mallory, ids[0]) is False
    assert done(mallory, bytes(16)) is False
    assert done(alice, ids[0]) is True
    assert done(alice, ids[0]) is False, "ended once"


def test_an_expired_lease_stops_counting_at_once(served):
    s = served(lease_ttl_s=0.3)
    sock = s.client()
    got = [lookup(sock, "k0") is not None for _ in range(budget.PEER_LEASES + 1)]
    assert got == [True] * budget.PEER_LEASES + [False], "its share, then no more"
    time.sleep(0.3 + 2 * producer.POLL_S)
    assert lookup(sock, "k0") is not None, "the expired leases no longer count"


def _greedy(s, sources, per_source, lookups, keys=("k0",)):
    """Leases found by `per_source` DEALER connections from each source
    address, each sending `lookups` lookups at once (of `keys` in turn)."""
    import zmq

    greedy = []
    for source in sources:
        for _ in range(per_source):
            g = s.ctx.socket(zmq.DEALER)
            g.setsockopt(zmq.LINGER, 0)
            g.setsockopt(zmq.SNDHWM, 0)
            g.setsockopt(zmq.RCVHWM, 0)
            secure_client(g, s.keys)
            g.connect(f"tcp://{source}:0;127.0.0.1:{s.port}")
            s.socks.append(g)
            greedy.append(g)
    for g in greedy:
        for i in range(lookups):
            g.send_multipart([b"", protocol.pack({"op": "lookup", "keys": [keys[i % len(keys)]]})])
    found = 0
    for g in greedy:
        for _ in range(lookups):
            assert g.poll(30_000), "the server stopped answering"
            found += found_one(protocol.unpack(g.recv_multipart()[-1]))
    return found


def _newcomer(s, source):
    """A REQ connection from `source`."""
    import zmq

    other = s.ctx.socket(zmq.REQ)
    other.setsockopt(zmq.LINGER, 0)
    secure_client(other, s.keys)
    other.connect(f"tcp://{source}:0;127.0.0.1:{s.port}")
    s.socks.append(other)
    return other


def test_many_connections_from_one_address_share_one_budget(served):
    s = served()
    s.client()
    found = _greedy(s, ["127.0.0.1"], 20, 100)  # 20 x 64 leases would be 1280
    assert found == budget.GROUP_LEASES, f"{found} leases to one address"
    # A peer at another address is answered.
    assert lookup(_newcomer(s, "127.0.0.2"), "k1") is not None


def test_sixteen_addresses_of_one_peer_leave_a_newcomer_answered(served):
    # 16 addresses (127.0.0.2-17), 4 connections each: the whole pool of
    # leases if each address took its share of 16; a 17th address still
    # gets leases (taken back from the groups over their share of 17).
    s = served(lease_ttl_s=600)
    s.client()
    found = _greedy(s, [f"127.0.0.{2 + i}" for i in range(16)], 4, budget.PEER_LEASES + 8)
    assert found == budget.MAX_LEASES, f"{found}: the pool, shared by 16 addresses"
    other = _newcomer(s, "127.0.0.99")
    got = [lookup(other, "k1") for _ in range(8)]
    assert all(x is not None for x in got), "a newcomer is answered while 16 addresses hold the pool"
    assert s.server.revoked == 8
