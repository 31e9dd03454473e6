"""The encoder cache across nodes (docs/remote.md): a producer node serves
its store over NIXL, a consumer node fetches what it misses into its own
store of fetched outputs, and every rank loads it as a local hit. Whatever
a peer does costs a miss with the encoder's own output, never a crash, a
hang or a wrong answer. Engines are the stand-in's (_ec_vllm.py), the
producer node a process of its own, workers real processes; NIXL over
UCX TCP on 127.0.0.1. Skipped where NIXL is not installed (unless
PINSHM_REQUIRE_NIXL=1)."""

import os
import threading
import time
from types import SimpleNamespace

import pytest
from _ec_fixtures import SIZE, engines, stand_in, want  # noqa: F401 - fixtures
from _ec_remote import BadPeer, FakeRegion, ProducerNode, free_port, make_secret, nixl_or_skip
from _ec_security import listening

import pinshm
import pinshm.vllm.ec.remote.reads as fetch
from pinshm.vllm.ec.remote import nixl

IMAGES = ["img-a", "img-b", "img-c"]


@pytest.fixture
def nodes(unique_name, stand_in, tmp_path, monkeypatch):  # noqa: F811 - a fixture
    """Names of a producer node's store and a consumer node's, and a port;
    every segment of both is gone at the end, whatever happened. Both
    nodes share a secret (PINSHM_EC_SECRET_FILE, which their processes
    inherit)."""
    nixl_or_skip()
    monkeypatch.setenv("PINSHM_EC_SECRET_FILE", make_secret(tmp_path))
    a, b = unique_name("ec-a"), unique_name("ec-b")
    made = []
    yield a, b, free_port(), made
    for p in made:
        p.close()
    fetch.before_read = fetch.after_read = None
    # Every agent of this process was released when its owner closed.
    assert not nixl._LIVE, f"agents never released: {list(nixl._LIVE.values())}"
    left = [n for n in (a, b, a + "_remote", b + "_remote") if os.path.exists("/dev/shm/" + n)]
    for n in left:
        os.unlink("/dev/shm/" + n)
    assert left == [], f"left in /dev/shm: {left}"


def gone_after_kill(name, timeout=30):
    """A node SIGKILLed whole leaves no store: its reaper (its own session)
    removes what the node made."""
    deadline = time.monotonic() + timeout
    while os.path.exists("/dev/shm/" + name):
        assert time.monotonic() < deadline, f"{name} left in /dev/shm by a SIGKILLed node"
        time.sleep(0.05)


def producer(nodes, images=IMAGES, rows=None, **extra):
    a, _, port, made = nodes
    extra = dict({"store": a, "size": SIZE, "n_readers": 8, "serve": f"127.0.0.1:{port}"}, **extra)
    node = ProducerNode(extra, images, rows)
    made.append(node)
    return node


def consumer_extra(nodes, peers=None, **extra):
    _, b, port, _ = nodes
    peers = [f"127.0.0.1:{port}"] if peers is None else peers
    return dict({"store": b, "size": SIZE, "n_readers": 8, "retry_s": 0, "peers": peers}, **extra)


def test_a_consumer_node_reads_a_producer_nodes_outputs_and_every_rank_loads_them(nodes, engines):
    node = producer(nodes)
    c = engines("fork", "ec_consumer", consumer_extra(nodes), tp=2)
    c.step([])  # the ranks say which stores they read
    r = c.step(IMAGES)
    assert r.loads == IMAGES and r.computed == [], "fetched, not encoded"
    assert r.digests == [want(IMAGES)] * 2, "the producer's outputs on every rank"
    remote = c.scheduler._scheduler.remote
    assert remote.fetched == 3 and c.scheduler._scheduler.remote_hits == 3
    # Later requests: local hits in the node's store of fetched outputs.
    c.forget()
    r = c.step(IMAGES)
    assert r.loads == IMAGES and remote.fetched == 3
    stats = node.stats()
    assert dict(stats, lookup_requests=0) == dict(lookups=3, found=3, stable=3, unstable=0, lookup_requests=0)
    assert c.wrong_answers() == {} and c.failed == set()
    assert all(s["encoded"] == 0 for s in c.stats())


def test_a_consumer_engine_fetches_from_its_first_step(nodes, engines):
    producer(nodes)
    c = engines("fork", "ec_consumer", consumer_extra(nodes), tp=2)
    # The scheduler made the store of fetched outputs after the workers
    # started (as vLLM builds it); each worker's thread attaches it as it
    # appears, before any step, as in vLLM between the engine's start and
    # its first request.
    remote = nodes[1] + "_remote"
    deadline = time.monotonic() + 10
    while pinshm.inspect_segment(remote).entries_used < 3:  # the scheduler's reader and 2 workers'
        assert time.monotonic() < deadline, "the workers never attached the store of fetched outputs"
        time.sleep(0.005)
    r = c.step(IMAGES)  # no step before: no rank has reported yet
    assert r.loads == IMAGES and r.computed == [], "fetched in the first step, not encoded"
    assert r.digests == [want(IMAGES)] * 2
    assert c.scheduler._scheduler.remote.fetched == 3
    assert c.wrong_answers() == {} and c.failed == set()


def test_the_consumers_engine_core_holds_no_nixl_agent_its_fetch_process_does(nodes, engines):
    # UCX over TCP lets whoever reaches an agent's process read and write
    # its memory: the consumer's agent lives in a fetch process of its own.
    producer(nodes)
    c = engines("fork", "ec_consumer", consumer_extra(nodes), tp=2)
    c.step([])
    assert c.step(IMAGES[:2]).loads == IMAGES[:2]
    remote = c.scheduler._scheduler.remote
    assert remote.fetcher is not None and remote.fetcher.pid != os.getpid()
    assert not nixl._LIVE, "no NIXL agent in the engine core (this process)"
    maps = open(f"/proc/{remote.fetcher.pid}/maps").read()
    assert "/dev/shm/" not in maps, "the fetch process maps no store"
    # Its peers are on loopback: so is every listener of the consumer's
    # tree (the fetch process's UCX; the workers', but for what they
    # inherit from this test process, where earlier tests made agents).
    assert remote.fetcher.devices is not None and remote.fetcher.devices.split(",")[0] == "lo"
    inherited = set(listening(os.getpid()))
    where = listening(remote.fetcher.pid) + [a for p in c.procs for a in listening(p.pid) if a not in inherited]
    assert where and all(addr in ("127.0.0.1", "::1") for addr, _ in where), where


def test_bytes_changed_in_the_fetch_process_before_they_are_checked_are_a_miss(nodes, engines):
    # What a stranger reaching the fetch process's UCX listener could do:
    # write its staging buffer between the READ and the copy. The digest
    # the producer's scheduler sent does not match: a miss, never loaded.
    producer(nodes)
    c = engines("fork", "ec_consumer", consumer_extra(nodes, peer_backoff_s=0))
    c.step([])
    remote = c.scheduler._scheduler.remote
    fetch.after_read = lambda key: os.pwrite(remote.fetcher._fd, b"\xee" * 64, 0)
    r = c.step(["img-a"])
    assert r.computed == ["img-a"] and r.loads == [] and r.digests == [want(["img-a"])]
    assert remote.corrupt == 1 and remote.fetched == 0
    fetch.after_read = None
    assert c.step(["img-b"]).loads == ["img-b"], "the next fetch is clean"
    assert c.wrong_answers() == {}


def test_a_fetch_process_that_dies_is_started_again_and_fetches_again(nodes, engines):
    import signal

    producer(nodes)
    c = engines("fork", "ec_consumer", consumer_extra(nodes, peer_backoff_s=0))
    c.step([])
    assert c.step(["img-a"]).loads == ["img-a"]
    remote = c.scheduler._scheduler.remote
    first = remote.fetcher.pid
    os.kill(first, signal.SIGKILL)  # a stranger reaching its UCX port can do as much
    r = c.step(["img-b"])
    assert r.computed == ["img-b"] and r.digests == [want(["img-b"])], "a miss while it starts again"
    deadline = time.monotonic() + 60
    while not remote.fetcher.alive:
        assert time.monotonic() < deadline, "the fetch process was not started again"
        time.sleep(0.05)
    assert remote.fetcher.pid != first
    assert c.step(["img-c"]).loads == ["img-c"], "fetched through the new process (a new hello)"
    assert c.wrong_answers() == {}


def test_the_store_of_fetched_outputs_follows_reserve_so_that_gpu_hosts_pin_it(nodes, engines):
    producer(nodes)
    for reserve in (False, True):
        c = engines("fork", "ec_consumer", consumer_extra(nodes, reserve=reserve, remote_size="64m"))
        c.step([])
        st = os.stat("/dev/shm/" + nodes[1] + "_remote")
        backed = st.st_blocks * 512 >= st.st_size
        assert backed == reserve, f"reserve={reserve}: {st.st_blocks * 512} of {st.st_size} bytes backed"
        assert c.step(IMAGES[:1]).loads == IMAGES[:1]
        c.close()


def test_a_second_consumer_engine_of_the_node_hits_what_the_first_fetched(nodes, engines):
    node = producer(nodes)
    first = engines("fork", "ec_consumer", consumer_extra(nodes))
    first.step([])
    assert first.step(IMAGES[:2]).loads == IMAGES[:2]
    second = engines("fork", "ec_consumer", consumer_extra(nodes))
    second.step([])
    r = second.step(IMAGES[:2])
    assert r.loads == IMAGES[:2] and r.digests == [want(IMAGES[:2])]
    assert second.scheduler._scheduler.remote.store is None, "the first engine writes the node's fetched outputs"
    assert node.stats()["lookups"] == 2, "nothing fetched again"
    # Its own misses it does not fetch (it is not that store's writer).
    assert second.step(["img-c"]).computed == ["img-c"]
    assert second.wrong_answers() == {} and first.wrong_answers() == {}


def test_a_key_no_peer_has_is_a_miss(nodes, engines):
    producer(nodes)
    c = engines("fork", "ec_consumer", consumer_extra(nodes))
    c.step([])
    r = c.step(["img-z"])
    assert r.computed == ["img-z"] and r.digests == [want(["img-z"])]
    assert c.scheduler._scheduler.remote.not_found == 1
    assert c.wrong_answers() == {}


def test_a_key_no_peer_has_is_not_asked_for_again_until_absent_s_has_passed(nodes):
    from pinshm.vllm.ec._config import ECSettings
    from pinshm.vllm.ec.remote.consumer import ABSENT_S, RemoteTier

    node = producer(nodes)
    now = [0.0]
    tier = RemoteTier(ECSettings.from_extra(consumer_extra(nodes)), clock=lambda: now[0])
    try:
        assert tier.fetch("img-z") is None and tier.fetch("img-z") is None
        assert node.stats()["lookups"] == 1, "the second lookup was answered from memory"
        now[0] += ABSENT_S
        assert tier.fetch("img-z") is None and node.stats()["lookups"] == 2
    finally:
        tier.close()


def test_a_peer_that_is_not_listening_costs_a_miss_and_is_then_skipped(nodes, engines):
    c = engines("fork", "ec_consumer", consumer_extra(nodes, remote_timeout_s=0.3))
    c.step([])
    r = c.step(IMAGES)
    assert r.computed == IMAGES and r.digests == [want(IMAGES)]
    remote = c.scheduler._scheduler.remote
    wait_for(lambda: remote.peer_failures == 1, "its hello unanswered: one failure")
    r = c.step(["img-d"])
    assert r.computed == ["img-d"] and r.steps == 1, "skipped for peer_backoff_s: not even deferred"
    assert remote.peer_failures == 1
    assert c.wrong_answers() == {}


def test_a_peer_that_hangs_costs_a_miss(nodes, engines):
    _, _, port, made = nodes
    peer = BadPeer(port, lambda request: None)
    made.append(peer)
    c = engines("fork", "ec_consumer", consumer_extra(nodes, remote_timeout_s=0.3, peer_backoff_s=0))
    c.step([])
    r = c.step(IMAGES[:2])
    assert r.computed == IMAGES[:2] and r.digests == [want(IMAGES[:2])]
    # The requests were deferred, not the engine: it stepped on meanwhile.
    assert r.steps > 1 and c.deferrals >= 2
    assert peer.requests >= 1
    assert c.wrong_answers() == {}


def wait_for(condition, what, timeout=30):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


LIES = {
    # Each a place the consumer must refuse before any byte moves.
    "outside the region": dict(offset=1 << 30, nbytes=16384, dtype="float32", shape=[64, 64]),
    "bytes that are not dtype x shape": dict(offset=0, nbytes=7, dtype="float32", shape=[64, 64]),
    "an unknown dtype": dict(offset=0, nbytes=16384, dtype="complex32", shape=[64, 64]),
    "a shape that is no tensor's": dict(offset=0, nbytes=0, dtype="float32", shape=[]),
    "more than this node takes": dict(offset=0, nbytes=1 << 30, dtype="uint8", shape=[1 << 30]),
}


@pytest.mark.parametrize(
    "reply",
    [b"\xc1garbage", b"\x93\x01\x02\x03", "bad metadata", *LIES],  # b"\x93...": a list, not a map
)
def test_a_peer_that_sends_garbage_or_lies_costs_a_miss(nodes, engines, reply, caplog):
    # A real agent's metadata and region, so that a lie about the place is
    # what is refused.
    liar = FakeRegion("liar") if reply in LIES else None
    try:
        _a_lying_peer_costs_a_miss(nodes, engines, reply, caplog, liar)
    finally:
        if liar is not None:
            liar.release()


def _a_lying_peer_costs_a_miss(nodes, engines, reply, caplog, liar):
    import logging

    import msgpack

    _, _, port, made = nodes

    def answer(request):
        if isinstance(reply, bytes):
            return reply
        msg = msgpack.unpackb(request)
        if msg["op"] == "hello":
            if liar is None:  # metadata that is not NIXL's
                return msgpack.packb({"v": 4, "agent": "liar", "meta": b"not nixl", "base": 1, "length": 1, "gen": 1})
            return liar.hello()
        if msg["op"] == "done":
            return msgpack.packb({"stable": [True] * len(msg["leases"])})
        place = dict({"lease": bytes(16), "digest": bytes(32), "gen": 1}, **LIES[reply])
        return msgpack.packb({"found": [place] * len(msg["keys"])})

    peer = BadPeer(port, answer)
    made.append(peer)
    c = engines("fork", "ec_consumer", consumer_extra(nodes, remote_timeout_s=0.5, peer_backoff_s=0))
    c.step([])
    with caplog.at_level(logging.DEBUG, logger="vllm.pinshm.ec"):
        r = c.step(IMAGES[:2])
    assert r.computed == IMAGES[:2] and r.digests == [want(IMAGES[:2])]
    # One failure per batch of keys asked (the two requests' keys may go
    # in one lookup or two), then skipped for peer_backoff_s.
    assert peer.requests >= 1 and c.scheduler._scheduler.remote.fetched == 0
    assert c.scheduler._scheduler.remote.peer_failures >= 1
    if reply in LIES:
        said = " ".join(m for m in caplog.messages if "failed" in m)
        assert any(w in said for w in ("outside", "is not a", "not one an encoder", "takes at most")), said
    assert c.wrong_answers() == {}


def test_an_output_whose_slot_is_reused_before_the_read_is_never_loaded(nodes, engines):
    # The producer lets go of its lease at once (a TTL of 0), and its
    # writer fills the store with other outputs between the lookup and
    # the READ: the slot holds another object's bytes, which do not match
    # the digest of the one looked up.
    node = producer(nodes, images=["img-a"], lease_ttl_s=0)
    c = engines("fork", "ec_consumer", consumer_extra(nodes))
    c.step([])
    fetch.before_read = lambda key: node.save([f"other-{i}" for i in range(40)])
    r = c.step(["img-a"])
    assert r.computed == ["img-a"] and r.loads == [] and r.digests == [want(["img-a"])]
    remote = c.scheduler._scheduler.remote
    assert remote.corrupt == 1 and remote.fetched == 0
    assert c.wrong_answers() == {}


def test_an_output_whose_slot_is_reused_after_the_read_is_loaded_as_read(nodes, engines):
    # The digest, not the producer's re-check at done, proves the bytes:
    # a slot reused once the READ is over changes nothing that was read.
    node = producer(nodes, images=["img-a"], lease_ttl_s=0)
    c = engines("fork", "ec_consumer", consumer_extra(nodes))
    c.step([])
    fetch.after_read = lambda key: node.save([f"other-{i}" for i in range(40)])
    r = c.step(["img-a"])
    assert r.loads == ["img-a"] and r.computed == [] and r.digests == [want(["img-a"])]
    assert c.wrong_answers() == {}


def test_a_peer_killed_during_the_read_costs_a_miss(nodes, engines):
    node = producer(nodes)
    c = engines("fork", "ec_consumer", consumer_extra(nodes, remote_timeout_s=2))
    c.step([])
    fetch.before_read = lambda key: node.kill()
    r = c.step(["img-a"])
    gone_after_kill(nodes[0])
    assert r.computed == ["img-a"] and r.digests == [want(["img-a"])]
    fetch.before_read = None
    r = c.step(["img-b"])  # the peer is skipped now, or down: a miss either way
    assert r.computed == ["img-b"] and r.digests == [want(["img-b"])]
    assert c.scheduler._scheduler.remote.fetched == 0
    assert c.wrong_answers() == {}


def test_a_peer_killed_while_its_read_is_in_flight_costs_a_miss(nodes, engines, monkeypatch):
    # 32 MiB outputs: a READ over UCX TCP on 127.0.0.1 takes tens of ms,
    # and the producer node dies 2 ms after it is posted.
    rows, big = 128 * 1024, "80m"
    node = producer(nodes, images=["img-big"], rows=rows, size=big)
    c = engines("fork", "ec_consumer", consumer_extra(nodes, size=big, remote_size=big, remote_timeout_s=3))
    c.step([])
    completed = []
    monkeypatch.setattr(fetch, "PIPELINE_BYTES", 1 << 30)  # one READ of the whole output
    fetch.before_read = lambda key: threading.Timer(0.002, node.kill).start()
    fetch.after_read = completed.append
    t0 = time.monotonic()
    r = c.step(["img-big"], rows=rows)
    took = time.monotonic() - t0
    gone_after_kill(nodes[0])
    assert completed == [], "the READ completed before the kill: nothing was in flight"
    assert r.computed == ["img-big"] and r.loads == []
    assert r.digests == [want(["img-big"], rows)], "the encoder's own output"
    assert took < 3 + 10, f"a miss within the bound (remote_timeout_s 3 s), not {took:.1f} s"
    assert c.scheduler._scheduler.remote.fetched == 0
    assert c.wrong_answers() == {} and c.failed == set()


NODE_A = """
import json, multiprocessing as mp, os, sys
from _ec_vllm import Engine
e = Engine(mp.get_context("fork"), "ec_both", json.loads(sys.argv[1]))
e.step(json.loads(sys.argv[2]))
print("READY", flush=True)
sys.stdin.readline()
stats = e.ec_connector._server.found
e.close()
print(json.dumps({"found": stats, "left": sorted(os.listdir("/dev/shm"))}), flush=True)
"""

NODE_B = """
import json, multiprocessing as mp, os, sys
from _ec_vllm import Engine, digest, encode
extra, images, other = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
out = {"sees_other_node": os.path.exists("/dev/shm/" + other)}
first = Engine(mp.get_context("fork"), "ec_consumer", extra, tp=2)
first.step([])
r = first.step(images)
out["first"] = dict(loads=r.loads, computed=r.computed, right=r.digests == [{h: digest(encode(h)) for h in images}] * 2)
second = Engine(mp.get_context("fork"), "ec_consumer", extra)
second.step([])
r = second.step(images)
out["second"] = dict(loads=r.loads, computed=r.computed, right=r.digests == [{h: digest(encode(h)) for h in images}])
out["fetched"] = first.scheduler._scheduler.remote.fetched
out["wrong"] = len(first.wrong_answers()) + len(second.wrong_answers())
out["encoded"] = sum(s["encoded"] for s in first.stats() + second.stats())
second.close()
first.close()
out["left"] = sorted(os.listdir("/dev/shm"))
print(json.dumps(out), flush=True)
"""


def _node(code, *args):
    import subprocess
    import sys

    script = 'mount -t tmpfs -o size=64m pinshm-node /dev/shm && exec "$0" -c "$1" "$2" "$3" "$4"'
    return subprocess.Popen(
        ["unshare", "-m", "sh", "-c", script, sys.executable, code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.abspath(__file__)),
        start_new_session=True,  # a node: killed whole (its engine's workers with it)
        env=dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")]),
        ),
    )


def test_two_nodes_each_with_its_own_dev_shm_share_outputs_over_nixl(nodes):
    import json
    import subprocess

    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        if os.environ.get("PINSHM_REQUIRE_NS") == "1":
            pytest.fail("PINSHM_REQUIRE_NS=1 but a mount namespace cannot be created here")
        pytest.skip("cannot create a mount namespace here (needs root and unshare)")
    a, b, port, _ = nodes
    extra_a = {"store": a, "size": SIZE, "n_readers": 8, "serve": f"127.0.0.1:{port}"}
    node_a = _node(NODE_A, json.dumps(extra_a), json.dumps(IMAGES), "")
    node_b = None
    try:
        lines = iter(node_a.stdout.readline, "")  # NIXL logs to stdout too
        assert any(line.strip() == "READY" for line in lines), node_a.stderr.read()[-3000:]
        extra_b = dict(consumer_extra(nodes), store=a)  # the same store name: a node of its own
        node_b = _node(NODE_B, json.dumps(extra_b), json.dumps(IMAGES), a)
        out_b, err_b = node_b.communicate(timeout=300)
        assert node_b.returncode == 0, err_b[-3000:]
        out_a, err_a = node_a.communicate("stop\n", timeout=120)
        assert node_a.returncode == 0, err_a[-3000:]
    finally:
        for node in (node_a, node_b):
            if node is not None and node.poll() is None:
                os.killpg(node.pid, 9)
                node.wait()
    b_said = json.loads([line for line in out_b.splitlines() if line.startswith("{")][-1])
    a_said = json.loads([line for line in out_a.splitlines() if line.startswith("{")][-1])
    assert b_said["sees_other_node"] is False, "each node has its own /dev/shm"
    assert b_said["first"] == dict(loads=IMAGES, computed=[], right=True), b_said
    assert b_said["second"] == dict(loads=IMAGES, computed=[], right=True), "the second engine hits locally"
    assert b_said["fetched"] == 3 and a_said["found"] == 3, "fetched once for the node"
    assert b_said["wrong"] == 0 and b_said["encoded"] == 0
    assert b_said["left"] == [] and a_said["left"] == [], "nothing left in either node's /dev/shm"


def test_a_missing_module_of_the_nixl_extra_stops_the_remote_tier_at_start_with_advice():
    # Not a miss at every lookup: msgpack (or zmq, or NIXL) missing is an
    # ImportError where the tier starts, naming the extra to install.
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['msgpack'] = None\n"
        "from pinshm.vllm.ec.remote import nixl\n"
        "try:\n    nixl.nixl()\nexcept ImportError as e:\n    print('ImportError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ImportError:" in out.stdout and "msgpack" in out.stdout and "pinshm[nixl]" in out.stdout, out.stdout
