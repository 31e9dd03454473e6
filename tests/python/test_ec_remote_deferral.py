"""The remote tier off the scheduler's path (docs/remote.md): vLLM's
``ensure_cache_available`` defers a request while its outputs are
fetched by the tier's thread, never the engine; a request's items are one
lookup; a slow peer is backed off. Stand-in engines, a producer node in a
process of its own, NIXL over UCX TCP on 127.0.0.1 (skipped without NIXL
unless PINSHM_REQUIRE_NIXL=1)."""

import time
from types import SimpleNamespace

from _ec_fixtures import engines, stand_in, want  # noqa: F401 - fixtures
from _ec_remote import BadPeer, FakeRegion
from test_ec_remote import consumer_extra, nodes, producer  # noqa: F401 - a fixture


def test_a_request_of_eight_items_is_one_lookup_round_trip(nodes):
    from _ec_vllm import MODEL

    from pinshm.vllm.ec._config import ECSettings, model_fingerprint
    from pinshm.vllm.ec.remote.consumer import RemoteTier

    images = [f"img-{i}" for i in range(8)]
    node = producer(nodes, images=images)
    extra = consumer_extra(nodes, remote_timeout_s=30)  # round trips counted here, not time
    tier = RemoteTier(ECSettings.from_extra(extra, model_fingerprint(MODEL, None)))
    try:
        deadline = time.monotonic() + 60
        while tier.peers_ready < 1:  # its hello answered (the tier says it at start)
            assert time.monotonic() < deadline, "the producer never answered the hello"
            time.sleep(0.01)
        keys = [tier.settings.key(h) for h in images]
        tier.want(keys)  # what ensure_cache_available does with a request's items
        assert tier.wait(keys, 30)
        assert all(tier.has_local(k) for k in keys) and tier.fetched == 8
        stats = node.stats()
        assert stats["lookups"] == 8 and stats["lookup_requests"] == 1, stats
    finally:
        tier.close()


def test_a_slow_peer_defers_requests_not_the_engine_and_is_then_skipped(nodes, engines, caplog):
    import logging

    import msgpack

    _, _, port, made = nodes
    slow = FakeRegion("slow")
    lookups = []

    def answer(request):
        msg = msgpack.unpackb(request)
        if msg["op"] == "hello":
            return slow.hello()
        lookups.append(msg["keys"])
        time.sleep(0.7)  # past its share of the 1 s budget, within the budget
        return msgpack.packb({"found": [None] * len(msg["keys"])})

    try:
        peer = BadPeer(port, answer)
        made.append(peer)
        c = engines("fork", "ec_consumer", consumer_extra(nodes, remote_timeout_s=1.0))
        c.step([])
        with caplog.at_level(logging.WARNING, logger="vllm.pinshm.ec"):
            r = c.step(["img-a"])
        assert r.computed == ["img-a"] and r.digests == [want(["img-a"])]
        # The request waited for its lookup; the engine stepped on meanwhile.
        assert r.steps > 64 and c.deferrals >= 1
        # Its empty steps (nothing scheduled, no model run) are not taken
        # for steps whose report never came.
        assert not any("no worker of this engine" in m for m in caplog.messages)
        remote = c.scheduler._scheduler.remote
        assert remote.slow_answers == 1 and remote.peer_failures == 1
        r = c.step(["img-b"])
        assert r.computed == ["img-b"] and r.steps == 1, "a slow peer is skipped: nothing to wait for"
        assert lookups == [[remote.settings.key("img-a")]], "not asked again while backed off"
        assert c.wrong_answers() == {}
    finally:
        slow.release()


def test_an_input_already_computed_or_in_vllms_cache_is_not_fetched(nodes, engines):
    from _ec_vllm import Request

    node = producer(nodes)
    c = engines("fork", "ec_consumer", consumer_extra(nodes))
    c.step([])
    s = c.scheduler
    done = Request("req-done", ["img-a"])
    assert s.ensure_cache_available(done, 64), "its tokens are computed: nothing to fetch"
    c.encoder_cache_manager.cached["img-b"] = {"other"}
    assert s.ensure_cache_available(Request("req-b", ["img-b"]), 0), "vLLM's own cache has it"
    assert node.stats()["lookups"] == 0
    c.encoder_cache_manager.cached.pop("img-b")


def test_outputs_read_in_chunks_smaller_than_one_output_arrive_whole_and_checked(nodes, engines, monkeypatch):
    import pinshm.vllm.ec.remote.reads as reads

    # 16 KiB outputs in READs of 5 KiB: each output spans chunks, and
    # chunks span outputs; each chunk is checked while the next is read.
    monkeypatch.setattr(reads, "PIPELINE_BYTES", 5 << 10)
    images = ["img-a", "img-b", "img-c"]
    producer(nodes, images=images)
    c = engines("fork", "ec_consumer", consumer_extra(nodes), tp=2)
    c.step([])
    r = c.step(images)
    assert r.loads == images and r.computed == [] and r.digests == [want(images)] * 2
    assert c.scheduler._scheduler.remote.fetched == 3
    assert c.wrong_answers() == {}


def test_chunks_cover_every_byte_once_in_order():
    from pinshm.vllm.ec.remote.protocol import Place
    from pinshm.vllm.ec.remote.reads import _chunks

    places = [Place(b"", b"", off, n, "uint8", (n,), 0) for off, n in ((0, 7), (100, 3), (200, 10))]
    chunks = _chunks(places, 1000, 4)
    assert all(sum(p[2] for p in c) <= 4 for c in chunks)
    pieces = [p for c in chunks for p in c]
    assert [p[3] for p in pieces] == sorted(p[3] for p in pieces), "staging offsets in order"
    for i, place in enumerate(places):
        mine = [p for p in pieces if p[0] == i]
        assert sum(p[2] for p in mine) == place.nbytes
        assert [p[1] for p in mine] == [sum(q[2] for q in mine[:j]) for j in range(len(mine))]
        assert all(p[4] == 1000 + place.offset + p[1] for p in mine)
    assert pieces[-1][3] + pieces[-1][2] == 20, "end to end in staging"


def test_a_request_is_deferred_while_its_fetches_run_and_never_past_its_budget():
    from pinshm.vllm.ec.remote.deferral import MAX_DEFERRED, Deferrals

    now = [0.0]
    d = Deferrals(1.0, clock=lambda: now[0])
    assert d.ready("r1", []), "nothing in flight: it runs"
    assert not d.ready("r1", ["k"]), "a fetch in flight: deferred"
    now[0] = 0.9
    assert not d.ready("r1", ["k"]), "within its budget, counted from its first deferral"
    now[0] = 1.0
    assert d.ready("r1", ["k"]) and d.expired == 1, "past it: it runs, the fetch a miss for it"
    now[0] = 5.0
    assert d.ready("r1", ["k2"]) and d.expired == 1, "waiting on (for KV room, say): no second budget"
    assert not d.ready("r2", ["k"]) and len(d) == 2
    d.forget("r1")  # finished
    d.forget("r2")  # aborted while deferred
    assert len(d) == 0
    for i in range(MAX_DEFERRED + 10):
        d.ready(f"many-{i}", ["k"])
    assert len(d) == MAX_DEFERRED, "requests never asked about again are forgotten, oldest first"


def test_a_read_answered_with_an_error_takes_one_answer_and_blames_the_peer_once():
    # The fetch process answers each request once: after an error answer
    # nothing is outstanding, and nothing more is waited for (a second
    # take would wait the budget out, then stop the fetch process).
    import pinshm.vllm.ec.remote.reads as reads
    from pinshm.vllm.ec.remote.peers import Peer
    from pinshm.vllm.ec.remote.protocol import PeerError, Place

    class Fetcher:
        staging = bytearray(1 << 16)
        posted = taken = 0

        def post(self, msg, timeout):
            self.posted += 1

        def take(self, timeout):
            self.taken += 1
            raise PeerError("NIXL_ERR_REMOTE_DISCONNECT")

    blamed = []
    tier = SimpleNamespace(
        fetcher=Fetcher(), store=object(), clock=time.monotonic, failed=lambda p, why, close: blamed.append(why)
    )
    place = Place(bytes(16), bytes(32), 0, 1024, "uint8", (1024,), 0)
    got = reads._read_group(
        tier, Peer("127.0.0.1", 1, agent_name="a"), [("k", place, bytearray(1024))], time.monotonic() + 5
    )
    assert got == set() and tier.fetcher.posted == tier.fetcher.taken == 1
    assert blamed == ["NIXL_ERR_REMOTE_DISCONNECT"]


def test_a_peer_address_zeromq_cannot_use_is_a_peer_error_not_a_dead_thread():
    import zmq

    from pinshm.vllm.ec.remote.peers import Peer
    from pinshm.vllm.ec.remote.protocol import PeerError

    ctx = zmq.Context()
    try:
        peer = Peer("no such host!", 1)
        try:
            peer.connect(ctx, None)
        except PeerError as e:
            assert "cannot connect" in str(e)
        else:
            raise AssertionError("an address ZeroMQ refuses was taken")
        assert peer.sock is None, "the socket made for it is closed"
    finally:
        ctx.term()
