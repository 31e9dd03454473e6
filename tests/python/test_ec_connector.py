"""pinshm.vllm.ec_connector.PinshmECConnector against a stand-in of vLLM's
connector base (CI has no vLLM), called in vLLM's order by a stand-in
engine whose workers are real processes, started with fork (as vLLM's
executor does) and spawn. See _ec_vllm.py."""

import multiprocessing as mp
import os
import pickle
import subprocess
import sys
from dataclasses import replace

import pytest

import pinshm
from _ec_fixtures import HOLDS, engines, extra, run_with_installed_vllm, stand_in, store, want  # noqa: F401 - fixtures
from _ec_vllm import MODEL, consumer_engine_main
from pinshm.vllm.ec import ECSettings, parse_size
from pinshm.vllm.ec._attach import NamedReader
from pinshm.vllm.ec._config import model_fingerprint

START_METHODS = ["fork", "spawn"]


@pytest.mark.parametrize("method", START_METHODS)
def test_an_output_saved_by_rank_0_is_found_by_the_scheduler_and_loaded_by_every_rank(engines, extra, method):
    # Rank 1 may look for the store before rank 0 has made it: retried at
    # every step here, not once a second.
    e = engines(method, "ec_both", dict(extra, retry_s=0), tp=2)
    assert e.writes == [True, False], "TP rank 0 writes the store, rank 1 does not"
    first = e.step(["img-a"])
    assert first.computed == ["img-a"] and first.loads == []
    e.forget()  # vLLM's own encoder cache let it go
    again = e.step(["img-a"])
    assert again.loads == ["img-a"] and again.computed == []
    assert again.digests == [want(["img-a"])] * 2 and again.missing == [[], []]
    s0, s1 = e.stats()
    assert (s0["saved"], s0["encoded"], s0["loaded"]) == (1, 1, 1)
    assert (s1["saved"], s1["encoded"], s1["loaded"]) == (0, 1, 1)


def test_a_lease_keeps_an_output_through_a_lap_of_puts_that_would_evict_it(engines, extra):
    e = engines("fork", "ec_both", extra)
    e.step(["img-a"])
    e.forget()
    plan = e.schedule(["img-a"])
    assert plan.loads == ["img-a"]
    e.save([f"lap-{i}" for i in range(3 * HOLDS)])  # three times what the store holds
    r = e.execute(plan)
    assert r.digests == [want(["img-a"])] and r.missing == [[]]
    assert e.stats()[0]["unsaved"] == 0, "the lap went around the leased output"


def test_a_lease_ends_when_the_workers_report_the_step_and_the_output_may_go_then(engines, extra):
    e = engines("fork", "ec_both", extra)
    e.step(["img-a"])
    e.forget()
    plan = e.schedule(["img-a"])
    side = e.scheduler._scheduler
    assert side.leases_out == 1
    e.execute(plan)
    assert side.leases_out == 0
    e.save([f"lap-{i}" for i in range(3 * HOLDS)])
    e.forget()
    assert e.step(["img-a"]).computed == ["img-a"], "evicted once its lease ended"


def test_a_hit_whose_request_is_not_scheduled_is_released_when_the_step_is_built(engines, extra):
    e = engines("fork", "ec_both", extra)
    e.step(["img-a"])
    side = e.scheduler._scheduler
    assert e.scheduler.has_cache_item("img-a")
    assert side.leases_out == 1
    e.scheduler.build_connector_meta(None)  # no update_state_after_alloc: not scheduled
    assert side.leases_out == 0


@pytest.mark.parametrize("method", START_METHODS)
def test_a_consumer_engine_loads_what_a_producer_saved_without_the_writer_doing_anything(
    engines, extra, method
):
    images = [f"img-{i}" for i in range(4)]
    producer = engines(method, "ec_both", extra)
    producer.step(images)
    before = producer.stats()
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=consumer_engine_main, args=(b, extra, 2, images, method))
    p.start()
    try:
        assert a.poll(120), "the consumer engine did not answer"
        _, loads, computed, digests, missing, stats = a.recv()
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0
    assert loads == images and computed == []
    assert digests == [want(images)] * 2 and missing == [[], []]
    assert [s["encoded"] for s in stats] == [0, 0], "the consumer never ran its encoder"
    assert [s["saved"] for s in stats] == [0, 0]
    assert producer.stats() == before, "the producer's writer did nothing"


def test_an_output_gone_before_its_load_fails_its_request_not_the_engine(engines, extra):
    e = engines("fork", "ec_both", extra)
    e.step(["img-a"])
    e.forget()
    plan = e.schedule(["img-a"])
    (spec,) = plan.meta.loads
    gone = pickle.loads(pickle.dumps(plan.meta))
    gone.loads = [replace(spec, monotonic_id=spec.monotonic_id + 10_000)]  # no such object
    r = e.execute(plan, meta=gone)
    assert r.missing == [[]], "a placeholder stands in: the model runner does not stop"
    assert "img-a" not in e.cached, "vLLM's encoder cache no longer holds the placeholder"
    e.step([])  # vLLM takes unavailable requests at the next update
    assert e.failed == {spec.request_id}
    assert e.step(["img-b"]).computed == ["img-b"], "the engine goes on"
    assert e.stats()[0]["failed"] == 1
    assert e.scheduler._scheduler.leases_out == 0
    assert e.wrong_answers() == {}


def test_a_store_replaced_between_the_lease_and_the_load_still_loads_the_leased_output(engines, extra):
    extra = dict(extra, retry_s=0)
    producer = engines("fork", "ec_producer", extra)
    producer.step(["img-a"])
    consumer = engines("fork", "ec_consumer", extra)
    consumer.step([])  # its rank reports the store it reads
    plan = consumer.schedule(["img-a"])
    assert plan.loads == ["img-a"]
    producer.close()  # the store goes; a new producer makes a new one
    engines("fork", "ec_producer", extra).step(["img-z"])
    r = consumer.execute(plan)
    assert r.digests == [want(["img-a"])] and r.missing == [[]], "the lease kept the old segment's bytes"
    assert consumer.stats()[0]["failed"] == 0
    # Its scheduler and rank move to the new segment (a miss until the
    # rank has said so, then hits).
    assert consumer.step(["img-z"]).digests == [want(["img-z"])]
    consumer.forget()
    assert consumer.step(["img-z"]).loads == ["img-z"]
    assert consumer.wrong_answers() == {} and consumer.failed == set()


def test_more_images_than_the_store_holds_keep_being_served(engines, extra):
    e = engines("fork", "ec_both", extra)
    images = [f"img-{i}" for i in range(4 * HOLDS)]
    hits = []
    # In order, then back: the last ones of the first pass are still there.
    for order in (images, images[::-1]):
        for i in range(0, len(order), 4):
            batch = order[i : i + 4]
            r = e.step(batch)
            assert r.digests == [want(batch)] and r.missing == [[]]
            hits += r.loads
            e.forget()
        if order is images:
            assert hits == []
    assert 0 < len(hits) < len(images) and hits[0] == images[-1]
    assert e.stats()[0]["unsaved"] == 0, "a cache reclaims what nobody holds: never full"


def test_a_full_store_skips_the_save_and_the_engine_goes_on(engines, extra, store):
    e = engines("fork", "ec_both", extra)
    images = [f"img-{i}" for i in range(3 * HOLDS)]
    e.step(images)
    settings = ECSettings.from_extra(extra, model_fingerprint(MODEL))
    reader = pinshm.StoreReader.attach_by_name(store, pin="off")
    try:
        leases = [lease for lease in (reader.lease_key(settings.key(h)) for h in images) if lease]
        assert leases, "the store is full of leased outputs"
        r = e.step(["img-new"])
        assert r.computed == ["img-new"] and r.digests == [want(["img-new"])]
        assert e.stats()[0]["unsaved"] == 1
        for lease in leases:
            lease.release()
        e.step(["img-new-2"])
        assert e.stats()[0]["saved"] == len(images) + 1
    finally:
        reader.close()


def test_engines_of_different_models_never_load_each_others_outputs(engines, extra):
    producer = engines("fork", "ec_both", extra, model="org/model-a")
    producer.step(["img-a"])
    other = engines("fork", "ec_consumer", extra, model="org/model-b")
    other.step([])  # its rank reports the store it reads
    assert other.step(["img-a"]).computed == ["img-a"]
    same = engines("fork", "ec_consumer", extra, model="org/model-a")
    same.step([])
    assert same.step(["img-a"]).loads == ["img-a"]


def test_a_producer_only_engine_never_loads(engines, extra):
    e = engines("fork", "ec_producer", extra)
    e.step(["img-a"])
    e.forget()
    assert e.step(["img-a"]).computed == ["img-a"]
    assert e.stats()[0]["already"] == 1, "saved once"


def test_a_second_producer_of_a_store_reads_it_and_saves_nothing(engines, extra):
    first = engines("fork", "ec_both", extra)
    first.step(["img-a"])
    second = engines("fork", "ec_both", extra)
    assert second.writes == [False]
    second.step([])  # its rank reports the store it reads
    assert second.step(["img-a"]).loads == ["img-a"]
    assert second.step(["img-b"]).computed == ["img-b"]
    assert second.stats()[0]["saved"] == 0


def test_a_consumer_started_before_its_producer_finds_the_store_once_it_is_there(engines, extra):
    consumer = engines("fork", "ec_consumer", dict(extra, retry_s=0))
    assert consumer.step(["img-a"]).computed == ["img-a"]
    consumer.forget()
    engines("fork", "ec_producer", extra).step(["img-a"])
    consumer.step([])  # its rank attaches and says so: hits from the next step
    assert consumer.step(["img-a"]).loads == ["img-a"]


def test_a_missing_store_is_retried_at_its_pace_not_at_every_lookup(unique_name):
    now = [0.0]
    r = NamedReader(unique_name("absent"), retry_s=1.0, clock=lambda: now[0])
    tries = []
    r._attach = lambda: tries.append(now[0])  # type: ignore[method-assign]
    for _ in range(1000):
        assert r.get() is None
    now[0] = 1.5
    for _ in range(1000):
        r.get()
    assert tries == [0.0, 1.5]


SIGKILL_SCRIPT = r"""
import multiprocessing as mp, os, signal, sys
from multiprocessing import resource_tracker
from _ec_vllm import config

def worker(extra, conn):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from pinshm._node import tracker as _tracker
    from pinshm.vllm.ec_connector import PinshmECConnector
    c = PinshmECConnector(config("ec_both", extra), ECConnectorRole.WORKER)
    conn.send((c._worker.store is not None, _tracker.reaper_pid()))
    signal.pause()

if __name__ == "__main__":
    name, method = sys.argv[1], sys.argv[2]
    resource_tracker.ensure_running()  # vLLM's processes have one
    ctx = mp.get_context(method)
    a, b = ctx.Pipe()
    p = ctx.Process(target=worker, args=({"store": name, "size": "256k"}, b))
    p.start()
    wrote, reaper = a.recv()
    print("WROTE", wrote, os.path.exists("/dev/shm/" + name), flush=True)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    print("REAPER", reaper, flush=True)
"""


@pytest.mark.parametrize("method", START_METHODS)
def test_the_store_is_unlinked_after_its_writers_process_is_sigkilled(stand_in, store, tmp_path, method):
    if not hasattr(os, "pidfd_open"):
        pytest.skip("needs os.pidfd_open (Linux 5.3, Python 3.9)")
    from test_vllm_queue_shm import wait_exit

    script = tmp_path / "engine.py"
    script.write_text(SIGKILL_SCRIPT)
    here = os.path.dirname(__file__)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stand_in), here, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, str(script), store, method], capture_output=True, text=True, timeout=120, env=env
    )
    lines = dict(x.split(" ", 1) for x in out.stdout.splitlines() if " " in x)
    assert lines.get("WROTE") == "True True", out.stdout + out.stderr[-3000:]
    wait_exit(int(lines["REAPER"]))
    assert not os.path.exists("/dev/shm/" + store), "left in /dev/shm after SIGKILL"


def test_sizes_are_ints_or_strings_with_units():
    assert parse_size(4096) == 4096
    assert parse_size("256m") == 256 << 20
    assert parse_size("1g") == 1 << 30
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size(" 64 KB ") == 64 << 10
    for bad in ["", "lots", "-1", 0, -5, True, None, 1.5, "1x"]:
        with pytest.raises(ValueError):
            parse_size(bad)


def test_settings_fill_in_defaults_and_refuse_bad_values():
    s = ECSettings.from_extra({}, "f00d")
    assert (s.store, s.size, s.n_readers, s.max_object_size, s.reserve) == (f"pinshm_ec.u{os.geteuid()}", 1 << 30, 64, None, False)
    assert s.key("abc") == "f00d:abc" and s.key_index == (1 << 30) // (32 << 10)
    assert ECSettings.from_extra({"size": "48k"}).key_index == 64, "at least 64 keys"
    assert ECSettings.from_extra({"reserve": "true"}).reserve is True
    s = ECSettings.from_extra({"store": "/x", "size": "64m", "n_readers": "4", "key_index": 99, "key_prefix": ""})
    assert (s.store, s.size, s.n_readers, s.key_index, s.key("abc")) == ("x", 64 << 20, 4, 99, "abc")
    for bad in [{"store": "a/b"}, {"n_readers": 0}, {"n_readers": 1025}, {"size": "big"}, {"retry_s": -1}, {"key_index": True}, {"reserve": 2}]:
        with pytest.raises(ValueError):
            ECSettings.from_extra(bad)


def test_importing_the_connectors_parts_imports_neither_vllm_nor_torch():
    code = (
        "import sys, pinshm.vllm.ec, pinshm.vllm.ec._scheduler, pinshm.vllm.ec._worker;"
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


def test_the_connector_is_a_vllm_connector_that_vllms_factory_can_make(stand_in, extra):
    import importlib

    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole

    from _ec_vllm import config

    module = importlib.import_module("pinshm.vllm.ec_connector")  # as vLLM's factory does
    cls = getattr(module, "PinshmECConnector")
    assert issubclass(cls, ECConnectorBase)
    c = cls(config("ec_consumer", extra), ECConnectorRole.SCHEDULER)  # not abstract
    try:
        assert c.has_cache_item("nothing") is False
        meta = c.build_connector_meta(None)
        assert pickle.loads(pickle.dumps(meta)).loads == []
    finally:
        c.shutdown()


def test_a_step_that_never_reports_ends_its_leases_after_a_while(engines, extra):
    from pinshm.vllm.ec._scheduler import MAX_STEPS_IN_FLIGHT

    e = engines("fork", "ec_both", extra)
    e.step(["img-a"])
    e.forget()
    e.schedule(["img-a"])  # its workers never run it: no report
    side = e.scheduler._scheduler
    for _ in range(MAX_STEPS_IN_FLIGHT - 1):
        e.scheduler.build_connector_meta(None)
    assert side.leases_out == 1, "a report may still come"
    e.scheduler.build_connector_meta(None)
    assert side.leases_out == 0


REAL_VLLM = r"""
import inspect
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorWorkerMetadata
from pinshm.vllm.ec_connector import PinshmECConnector, PinshmECWorkerMetadata
assert issubclass(PinshmECConnector, ECConnectorBase)
assert issubclass(PinshmECWorkerMetadata, ECConnectorWorkerMetadata)
assert not PinshmECConnector.__abstractmethods__, PinshmECConnector.__abstractmethods__
for name, ours in vars(PinshmECConnector).items():
    theirs = getattr(ECConnectorBase, name, None)
    if name.startswith("_") or not callable(theirs):
        continue
    want = [p.name for p in inspect.signature(theirs).parameters.values() if p.kind != p.VAR_KEYWORD]
    got = [p.name for p in inspect.signature(ours).parameters.values() if p.kind != p.VAR_KEYWORD]
    assert got == want, (name, got, want)
print("OK")
"""


def test_against_the_installed_vllm_the_connector_implements_its_base_with_its_signatures():
    run_with_installed_vllm(REAL_VLLM, "vLLM is not installed (CI): the stand-in tests above cover the connector")


def test_a_consumer_engine_hits_from_its_first_step_its_workers_entries_answer_before_their_reports(engines, extra):
    engines("fork", "ec_producer", extra).step(["img-a", "img-b"])
    consumer = engines("fork", "ec_consumer", extra, tp=2)
    # No step before: no rank has reported yet; its workers attached at
    # start, and the segment's reader table shows their two entries.
    r = consumer.step(["img-a", "img-b"])
    assert r.loads == ["img-a", "img-b"] and r.computed == []
    assert r.digests == [want(["img-a", "img-b"])] * 2
    assert consumer.scheduler._scheduler.not_ready == 0
    assert consumer.wrong_answers() == {}


def _hold_a_reader(name, then_fork, conn):
    """A child: attaches a reader of `name` (and, with `then_fork`, forks a
    grandchild that attaches one too), says so, waits to be told to go."""
    r = pinshm.StoreReader.attach_by_name(name)
    grandchild = None
    if then_fork:
        ctx = mp.get_context("fork")
        a, b = ctx.Pipe()
        grandchild = ctx.Process(target=_hold_a_reader, args=(name, False, b))
        grandchild.start()
        a.recv()
    conn.send("attached")
    conn.recv()
    if grandchild is not None:
        a.send("go")
        grandchild.join()
    r.close()


def test_only_live_reader_entries_of_this_processs_children_count_for_its_ranks(unique_name):
    from pinshm.vllm.ec._table import workers_holding

    name = unique_name("table")
    w = pinshm.ObjectStore(1 << 20, 64 << 10, 8, name=name, cache=True)
    mine = pinshm.StoreReader.attach_by_name(name)
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()
    child = ctx.Process(target=_hold_a_reader, args=(name, True, b))
    child.start()
    try:
        assert a.recv() == "attached"
        # Three entries: this process's own, the child's and the
        # grandchild's; only the child is a worker of this process.
        assert pinshm.inspect_segment(name).entries_used == 3
        epoch = mine.epoch
        # The scheduler's own reader answers from the table it reads.
        live = mine.live_readers()
        assert len(live) == 3 and (mine.index, os.getpid()) in live, live
        assert workers_holding(mine, epoch) == 1
        assert workers_holding(mine, epoch + 1) == 0, "another segment's epoch"
        assert workers_holding(None, epoch) == 0, "no reader: no answer"
    finally:
        a.send("go")
        child.join(10)
        mine.close()
        w.close()
    assert child.exitcode == 0
