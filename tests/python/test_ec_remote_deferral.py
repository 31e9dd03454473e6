"""The remote tier off the scheduler's path (docs/remote.md): vLLM's
``ensure_cache_available`` defers a request while its outputs are
fetched by the tier's thread, never the engine; a request's items are one
lookup; a slow peer is backed off. Stand-in engines, a producer node in a
process of its own, NIXL over UCX TCP on 127.0.0.1 (skipped without NIXL
unless PINSHM_REQUIRE_NIXL=1)."""

import time
from types import SimpleNamespace

from _ec_fixtures import engines, stand_in, want  # noqa: F401 - fixtures
from _ec_remote import BadPeer
from test_ec_remote import consumer_extra, nodes, producer  # noqa: F401 - a fixture


def test_a_request_of_eight_items_is_one_lookup_round_trip(nodes):
    from _ec_vllm import MODEL

    from pinshm.vllm.ec._config import ECSettings, model_fingerprint
    from pinshm.vllm.ec.remote.consumer import RemoteTier

    images = [f"img-{i}" for i in range(8)]
    node = producer(nodes, images=images)
    tier = RemoteTier(ECSettings.from_extra(consumer_extra(nodes), model_fingerprint(MODEL, None)))
    try:
        tier.want(["no-such-key"])  # the first lookup waits for the peer's hello
        assert tier.wait(["no-such-key"], 30)
        keys = [tier.settings.key(h) for h in images]
        tier.want(keys)  # what ensure_cache_available does with a request's items
        assert tier.wait(keys, 30)
        assert all(tier.has_local(k) for k in keys) and tier.fetched == 8
        stats = node.stats()
        assert stats["lookups"] == 9 and stats["lookup_requests"] == 2, stats
    finally:
        tier.close()


def test_a_slow_peer_defers_requests_not_the_engine_and_is_then_skipped(nodes, engines):
    import msgpack

    from pinshm.vllm.ec.remote.nixl import agent, release

    _, _, port, made = nodes
    holder = SimpleNamespace(_agent=agent("slow", progress=True))
    meta = holder._agent.get_agent_metadata()
    lookups = []

    def answer(request):
        msg = msgpack.unpackb(request)
        if msg["op"] == "hello":
            return msgpack.packb({"v": 4, "agent": "slow", "meta": meta, "base": 1 << 20, "length": 1 << 20, "gen": 1})
        lookups.append(msg["keys"])
        time.sleep(0.7)  # past its share of the 1 s budget, within the budget
        return msgpack.packb({"found": [None] * len(msg["keys"])})

    try:
        peer = BadPeer(port, answer)
        made.append(peer)
        c = engines("fork", "ec_consumer", consumer_extra(nodes, remote_timeout_s=1.0))
        c.step([])
        r = c.step(["img-a"])
        assert r.computed == ["img-a"] and r.digests == [want(["img-a"])]
        # The request waited for its lookup; the engine stepped on meanwhile.
        assert r.steps > 1 and c.deferrals >= 1
        remote = c.scheduler._scheduler.remote
        assert remote.slow_answers == 1 and remote.peer_failures == 1
        r = c.step(["img-b"])
        assert r.computed == ["img-b"] and r.steps == 1, "a slow peer is skipped: nothing to wait for"
        assert lookups == [[remote.settings.key("img-a")]], "not asked again while backed off"
        assert c.wrong_answers() == {}
    finally:
        release(holder)


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
