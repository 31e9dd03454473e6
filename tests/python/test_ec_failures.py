"""The encoder-cache connector when something fails: reader entries run
out, a load fails, a node's worth of engines read one store. Whatever
fails costs a miss or a failed request, never a request that completes
with an output the encoder would not have given (`Engine.wrong_answers`).
Engines are the stand-in's (_ec_vllm.py), workers in real processes. A
served store's size in the /dev/shm it has (a mount namespace's tmpfs)."""

import json
import logging

import pytest
from _ec_fixtures import HOLDS, engines, extra, run_with_installed_vllm, stand_in, store, want  # noqa: F401 - fixtures
from _ec_vllm import ROWS
from _small_shm import run_in_small_dev_shm

import pinshm

LOGGER = "vllm.pinshm.ec"


def test_an_engine_whose_workers_find_every_reader_entry_taken_runs_its_encoder_and_says_why(
    engines, extra, store, caplog
):
    extra = dict(extra, n_readers=5, retry_s=0)
    producer = engines("fork", "ec_both", extra)  # its scheduler and its worker: 2 entries
    producer.step(["img-a", "img-b"])
    blocker = pinshm.StoreReader.attach_by_name(store, pin="off")  # a third
    with caplog.at_level(logging.INFO, logger=LOGGER):
        # Its workers (started first, as vLLM's executor starts them) take
        # the fourth and the fifth; its scheduler finds none.
        consumer = engines("fork", "ec_consumer", extra, tp=2)
        for _ in range(3):
            r = consumer.step(["img-a", "img-b"])
            assert r.loads == [] and r.computed == ["img-a", "img-b"]
            assert r.digests == [want(["img-a", "img-b"])] * 2
            consumer.forget()
        said = [m for m in caplog.messages if "cannot read store" in m]
        assert len(said) == 1, f"once, not once a step: {said}"
        assert "needs 3 reader entries" in said[0] and "0 are free" in said[0] and "n_readers" in said[0]
        assert consumer.scheduler._scheduler.misses == 6
        assert consumer.stats() and all(s["failed"] == 0 for s in consumer.stats()), "no load was tried"
        # An entry frees: the scheduler takes it, says so, and the engine hits.
        blocker.close()
        r = consumer.step(["img-a", "img-b"])
        assert r.loads == ["img-a", "img-b"] and r.digests == [want(["img-a", "img-b"])] * 2
        assert any("reads store" in m and "now" in m for m in caplog.messages)
    assert consumer.wrong_answers() == {} and consumer.failed == set()


def test_the_scheduler_says_yes_only_once_every_rank_of_its_engine_reads_the_store(engines, extra, store, caplog):
    extra = dict(extra, n_readers=4, retry_s=0)
    consumer = engines("fork", "ec_consumer", extra, tp=2)  # before the store exists
    producer = engines("fork", "ec_both", extra)  # 2 entries
    producer.step(["img-a"])
    blocker = pinshm.StoreReader.attach_by_name(store, pin="off")  # the third
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER):
            # The scheduler takes the fourth; neither worker finds one.
            for _ in range(3):
                r = consumer.step(["img-a"])
                assert r.computed == ["img-a"] and r.digests == [want(["img-a"])] * 2
                consumer.forget()
            said = sorted(m for m in caplog.messages if "cannot read store" in m)
            assert len(said) == 2 and said[0].startswith("pinshm encoder cache: worker 0"), said
            assert all("needs 3 reader entries" in m for m in said), said
    finally:
        blocker.close()
    # One rank takes the freed entry; the other still has none: still no.
    for _ in range(2):
        assert consumer.step(["img-a"]).computed == ["img-a"]
        consumer.forget()
    states = consumer.scheduler._scheduler._rank_states
    assert sorted(s.epoch is not None for s in states.values()) == [False, True]
    assert consumer.wrong_answers() == {} and consumer.failed == set()


def test_a_failed_load_is_evicted_from_vllms_encoder_cache_and_every_request_that_read_it_fails(engines, extra):
    e = engines("fork", "ec_both", extra)
    e.step(["img-a"])
    e.forget()
    # vLLM expects more rows than the saved output has: the load fails on
    # the worker, and a placeholder stands in so that the runner goes on.
    failing = e.schedule(["img-a"], rows=ROWS + 1)
    assert failing.loads == ["img-a"]
    # Scheduled before the failure is known (async scheduling): served from
    # vLLM's own encoder cache, that is, from the placeholder.
    ahead = e.schedule(["img-a"], rows=ROWS + 1)
    assert ahead.loads == [] and ahead.compute == []
    r = e.execute(failing)
    assert r.missing == [[]], "the model runner did not stop"
    assert "img-a" not in e.cached, "evicted from vLLM's encoder cache"
    e.execute(ahead)
    e.step([])
    assert e.failed == {r.request_id for r in failing.requests + ahead.requests}, "both read the placeholder: both fail"
    assert e.wrong_answers() == {}
    # The key is a miss while it names the object that failed: the encoder
    # runs, and its output (not the placeholder) is what later requests get.
    again = e.step(["img-a"], rows=ROWS + 1)
    assert again.computed == ["img-a"] and again.loads == []
    later = e.step(["img-a"], rows=ROWS + 1)
    assert later.computed == [] and later.loads == [], "from vLLM's encoder cache: the encoder's output"
    assert e.wrong_answers() == {}, "no request completed from the placeholder"
    assert e.scheduler._scheduler.failed_loads == 1


def test_a_request_served_the_placeholder_by_vllms_cache_in_the_same_step_fails_too(engines, extra):
    e = engines("fork", "ec_both", extra)
    e.step(["img-a"])
    e.forget()
    # One pass: the first request loads img-a (and fails: vLLM expects more
    # rows), the second is served it by vLLM's own cache. Both are done
    # with the image before the failure is reported (their prefill ran).
    plan = e.schedule(["img-a", "img-a"], rows=ROWS + 1)
    assert plan.loads == ["img-a"] and len(plan.requests) == 2
    e.execute(plan)
    e.step([])
    assert e.failed == {r.request_id for r in plan.requests}
    assert e.wrong_answers() == {}


def test_a_key_whose_load_failed_is_a_hit_again_once_it_is_saved_again(engines, extra):
    e = engines("fork", "ec_both", extra)
    e.step(["img-a"])
    e.forget()
    e.step(["img-a"], rows=ROWS + 1)  # fails, the key becomes a miss
    e.step([])
    e.forget()
    assert e.step(["img-a"]).computed == ["img-a"], "a miss: the object whose load failed is still the key's"
    e.forget()
    # A lap of puts evicts the old object; the encoder's next output of
    # img-a is saved under the key again, a new object.
    e.save([f"lap-{i}" for i in range(3 * HOLDS)])
    assert e.step(["img-a"]).computed == ["img-a"]
    e.forget()
    assert e.step(["img-a"]).loads == ["img-a"]
    assert e.wrong_answers() == {}


def test_two_tp8_consumer_engines_and_a_producer_read_one_store_with_the_default_reader_entries(engines, store):
    extra = {"store": store, "size": "1m", "retry_s": 0}  # n_readers: the default
    producer = engines("fork", "ec_both", extra)
    images = [f"img-{i}" for i in range(4)]
    producer.step(images)
    consumers = [engines("fork", "ec_consumer", extra, tp=8) for _ in range(2)]
    for c in consumers:
        c.step([])  # every rank reports the store it reads
        r = c.step(images)
        assert r.loads == images and r.computed == []
        assert r.digests == [want(images)] * 8 and r.missing == [[]] * 8
    assert pinshm.inspect_segment(store).entries_used == 2 + 2 * (1 + 8)
    assert all(c.wrong_answers() == {} and c.failed == set() for c in consumers)


EVICT_IN_REAL_VLLM = r"""
from types import SimpleNamespace as NS
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from pinshm.vllm.ec._evict import evict

def request(rid, h, n):
    f = NS(identifier=h, mm_position=NS(get_num_embeds=lambda: n))
    return NS(request_id=rid, mm_features=[f], get_num_encoder_embeds=lambda i: n)

m = EncoderCacheManager(cache_size=100)
a, b = request("a", "H", 10), request("b", "G", 20)
for r in (a, b):
    assert m.can_allocate(r, 0, 100, 0)
    m.allocate(r, 0)
m.free(b)  # G: unreferenced, freeable
assert evict(m, "H") == {"a"} and evict(m, "G") == set() and evict(m, "X") == set()
assert "H" not in m.cached and "G" not in m.cached
assert (m.num_free_slots, m.num_freeable_slots) == (100, 100)
m.free(a)  # the failed request finishes: nothing left to free
assert (m.num_free_slots, m.num_freeable_slots) == (100, 100)
assert sorted(m.get_freed_mm_hashes()) == ["G", "H"]
assert not m.check_and_update_cache(request("c", "H", 10), 0)
c = request("c", "H", 10)
assert m.can_allocate(c, 0, 100, 0)
m.allocate(c, 0)
assert m.cached["H"] == {"c"} and m.num_free_slots == 90
print("OK")
"""


def test_against_the_installed_vllm_the_eviction_keeps_its_encoder_cache_managers_books():
    run_with_installed_vllm(EVICT_IN_REAL_VLLM, "vLLM is not installed (CI): the stand-in's manager, above, keeps vLLM's books")


# ---- a reserved store's size and the /dev/shm it has --------------------

RESERVED_DEFAULT = r"""
import json, os
from pinshm.vllm.ec._config import ECSettings
from pinshm.vllm.ec._worker import WorkerSide
if os.environ.get("FILL_MIB"):  # another engine's segments, there first
    fd = os.open("/dev/shm/others", os.O_CREAT | os.O_RDWR, 0o600)
    os.posix_fallocate(fd, 0, int(os.environ["FILL_MIB"]) << 20)
extra = {"serve": "127.0.0.1:1", "insecure": True, "store": "ec-fit", **json.loads(os.environ["EXTRA"])}
s = ECSettings.from_extra(extra)
try:
    side = WorkerSide(s, producer=True, consumer=False, writes=True)
except ValueError as e:
    print("REFUSED", e)
else:
    st = os.stat("/dev/shm/ec-fit") if side.store is not None else None
    print(json.dumps({"size": s.size, "file": st and st.st_size, "backed": bool(st) and st.st_blocks * 512 >= st.st_size}))
"""


@pytest.mark.parametrize("shm, want_mib", [("1g", 760), ("64m", 40)])
def test_a_served_stores_default_size_fits_the_dev_shm_it_has(shm, want_mib):
    # serve implies reserve: the default (1 GiB sparse) became 'nothing is
    # saved' in a 1 GiB /dev/shm. Now it is what /dev/shm holds after the
    # headroom the node's other segments need.
    done = run_in_small_dev_shm(RESERVED_DEFAULT, size=shm, env={"EXTRA": "{}"})
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["size"] == want_mib << 20 and got["backed"], got
    assert want_mib << 20 < got["file"] < (want_mib + 4) << 20, got


def test_a_default_size_takes_what_others_left_free():
    # 600 MiB of the 1 GiB taken by others first: the default store is
    # made smaller (what is free after the headroom), never an error.
    done = run_in_small_dev_shm(RESERVED_DEFAULT, size="1g", env={"EXTRA": "{}", "FILL_MIB": "600"})
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["backed"] and got["file"] < (1024 - 600 - 264 + 4) << 20, got


def test_an_explicit_size_that_cannot_fit_stops_the_engine_naming_the_size_that_does():
    done = run_in_small_dev_shm(RESERVED_DEFAULT, size="1g", env={"EXTRA": '{"size": "1g"}'})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("REFUSED"), done.stdout + done.stderr
    assert "'size' to at most 760m" in done.stdout and "nothing is saved" not in done.stdout, done.stdout
