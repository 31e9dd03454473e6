"""pinshm's ShmPointerMMData in SGLang's own code: SGLang's helpers wrap,
test, unwrap and discard requests whose features live in a pinshm store;
the object survives SGLang's pickle and msgpack hops, a process without
the plugin passing it on, and a full store (SGLang's inline path). Needs
SGLang and torch (about 4 GB, never in CI: tests/python/test_sglang_stand_in.py
runs the same contract there); PINSHM_REQUIRE_SGLANG=1 makes them required."""

from __future__ import annotations

import os
import pickle
from array import array
import subprocess
import sys

import pytest

if os.environ.get("PINSHM_REQUIRE_SGLANG") != "1":
    pytest.importorskip("torch", reason="needs torch (the SGLang venv: examples/sglang_e2e/setup_venv.sh)")
    pytest.importorskip("sglang.srt.managers.mm_utils", reason="needs SGLang 0.5.23 (examples/sglang_e2e)")

import torch  # noqa: E402
from sglang.srt.managers import mm_utils  # noqa: E402

from pinshm.sglang import _fit, _store, plugin  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def bound():
    from sglang.srt.plugins.hook_registry import HookRegistry

    assert _fit.misfit() is None, _fit.misfit()
    plugin.register()
    HookRegistry.apply_hooks()
    assert mm_utils.ShmPointerMMData.__module__ == "sglang.srt.managers.mm_utils"
    assert getattr(mm_utils.ShmPointerMMData, "_pinshm_bound", False)
    yield


def _sgl_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("sgl_shm_mm")}


def _request(features, hashes):
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, MultimodalProcessorOutput
    import msgspec

    items = [MultimodalDataItem(modality=Modality.IMAGE, hash=h, feature=f) for f, h in zip(features, hashes)]
    kwargs = {f.name: None for f in msgspec.structs.fields(TokenizedGenerateReqInput) if f.required}
    kwargs.update(
        rid="r1", input_text="", input_ids=array("q", [1, 2, 3]), mm_inputs=MultimodalProcessorOutput(mm_items=items)
    )
    return TokenizedGenerateReqInput(**kwargs)


def _transport(monkeypatch):
    # SGLang decides "not the default transport" from the node topology;
    # a test has none.
    monkeypatch.setattr(mm_utils, "_get_is_default_transport", lambda: False)
    monkeypatch.setattr(mm_utils, "get_serving", lambda: type("S", (), {"skip_tokenizer_init": False})())


def test_a_request_round_trips_through_sglangs_helpers_and_both_hops(monkeypatch):
    _transport(monkeypatch)
    before = _sgl_segments()
    feats = [torch.randn(16, 32), torch.arange(12, dtype=torch.int64).reshape(3, 4)]
    req = mm_utils.wrap_shm_features(_request([f.clone() for f in feats], [0xABC1, 0xABC2]))
    assert mm_utils.has_shm_features([req])
    for item in req.mm_inputs.mm_items:
        assert item.feature.shm_name.startswith("pinshm:"), item.feature.shm_name
    assert _sgl_segments() == before, "no sgl_shm_mm segment made"
    import msgspec
    from sglang.srt.managers.schedule_batch import MultimodalProcessorOutput
    from sglang.srt.utils.msgpack_utils import enc_hook, ext_hook

    encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook)
    decoder = msgspec.msgpack.Decoder(MultimodalProcessorOutput, ext_hook=ext_hook)

    def msgpack_hop(r):
        # SGLang's msgpack codec (its ext hook: the class found by name)
        # on the request's multimodal inputs; the rest travels as pickled.
        out = pickle.loads(pickle.dumps(r))
        out.mm_inputs = decoder.decode(encoder.encode(r.mm_inputs))
        return out

    for hop in (lambda r: pickle.loads(pickle.dumps(r)), msgpack_hop):
        got = hop(req)
        assert mm_utils.has_shm_features([got])
        mm_utils.unwrap_shm_features(got)
        for item, want in zip(got.mm_inputs.mm_items, feats):
            assert torch.equal(item.feature, want)
            item.feature.add_(1)  # private: writable, and no other rank sees it
    again = pickle.loads(pickle.dumps(req))
    mm_utils.unwrap_shm_features(again)
    assert all(torch.equal(i.feature, f) for i, f in zip(again.mm_inputs.mm_items, feats))
    mm_utils.discard_shm_features(pickle.loads(pickle.dumps(req)))  # nothing to unlink, no error


def test_a_ranks_tensor_is_the_slot_and_its_writes_stay_its_own(monkeypatch):
    """SGLang's own unwrap on a torch tensor: the feature is the store's
    pages (torch's storage lies in the store's mapping), and a write into
    one rank's tensor changes neither another rank's nor the store."""
    _transport(monkeypatch)
    f = torch.randn(256, 1024)  # 1 MiB
    req = mm_utils.wrap_shm_features(_request([f.clone()], [0xF00D]))
    ranks = [mm_utils.unwrap_shm_features(pickle.loads(pickle.dumps(req))) for _ in range(2)]
    t0, t1 = (r.mm_inputs.mm_items[0].feature for r in ranks)
    store = _store.writer().name
    for t in (t0, t1):
        addr = t.data_ptr()
        maps = [ln.split() for ln in open("/proc/self/maps")]
        holder = [m for m in maps if int(m[0].split("-")[0], 16) <= addr < int(m[0].split("-")[1], 16)]
        assert holder and holder[0][-1] == f"/dev/shm/{store}", holder  # no copy: the slot's pages
    t0.mul_(0).add_(1)  # in place, as a model might
    assert torch.equal(t1, f), "another rank's tensor is unchanged"
    again = mm_utils.unwrap_shm_features(pickle.loads(pickle.dumps(req))).mm_inputs.mm_items[0].feature
    assert torch.equal(again, f), "the store is unchanged"
    assert bool((t0 == 1).all())


def test_the_same_image_again_is_served_from_the_store(monkeypatch):
    _transport(monkeypatch)
    w = _store.writer()
    puts, hits = w.puts, w.hits
    f = torch.randn(64, 64)
    for _ in range(3):
        mm_utils.wrap_shm_features(_request([f.clone()], [0x5EED]))
    assert (w.puts - puts, w.hits - hits) == (1, 2)
    # No hash from the processor (SGLang's default): SGLang's own is set
    # once here (the ranks then skip it), and repeats are served.
    g = torch.randn(64, 64)
    for _ in range(3):
        req = mm_utils.wrap_shm_features(_request([g.clone()], [None]))
        item = req.mm_inputs.mm_items[0]
        assert item.hash == mm_utils.hash_feature(g) and item.pad_value is not None
    assert (w.puts - puts, w.hits - hits) == (2, 4)
    monkeypatch.setenv("PINSHM_SGLANG_HASH", "0")  # hashing left to the ranks: no reuse
    req = mm_utils.wrap_shm_features(_request([g.clone()], [None]))
    assert req.mm_inputs.mm_items[0].hash is None and w.puts - puts == 3


def test_a_process_without_the_plugin_passes_the_object_on_whole(monkeypatch, tmp_path):
    _transport(monkeypatch)
    f = torch.randn(5, 7)
    req = mm_utils.wrap_shm_features(_request([f.clone()], [0x77]))
    blob = tmp_path / "req.pkl"
    blob.write_bytes(pickle.dumps(req))
    # SGLang's class (no plugin) unpickles and pickles it again, as a
    # router would: it cannot open the name, and keeps it.
    code = (
        "import pickle,sys; from sglang.srt.managers import mm_utils as m;"
        "r=pickle.loads(open(sys.argv[1],'rb').read());"
        "assert not getattr(m.ShmPointerMMData,'_pinshm_bound',False);"
        "open(sys.argv[1],'wb').write(pickle.dumps(r))"
    )
    env = dict(os.environ, PINSHM_SGLANG="0")
    subprocess.run([sys.executable, "-c", code, str(blob)], check=True, env=env, timeout=300)
    back = pickle.loads(blob.read_bytes())
    mm_utils.unwrap_shm_features(back)
    assert torch.equal(back.mm_inputs.mm_items[0].feature, f)


def test_sglangs_own_segments_still_work_through_the_bound_class():
    # SGLang's Rust server builds stubs of its own segments with the stock
    # state: they go to SGLang's code.
    from multiprocessing import shared_memory

    t = torch.arange(6, dtype=torch.float32)
    shm = shared_memory.SharedMemory(create=True, size=t.numel() * 4, name=f"sgl_shm_mm_test_{os.getpid()}")
    torch.frombuffer(shm.buf, dtype=torch.uint8).copy_(t.view(torch.uint8))
    stub = mm_utils.ShmPointerMMData.__new__(mm_utils.ShmPointerMMData)
    stub.__setstate__({"shm_name": shm.name, "shape": (6,), "dtype": torch.float32, "precomputed_hash": None})
    assert torch.equal(stub.materialize(), t)
    shm.close()
    assert not os.path.exists(f"/dev/shm/{shm.name}"), "SGLang's materialize unlinks its segment"


def test_a_feature_that_does_not_fit_goes_inline(monkeypatch):
    _transport(monkeypatch)
    monkeypatch.setenv("PINSHM_SGLANG_CACHE_MIB", "8")
    small = _store.Writer()
    monkeypatch.setattr(_store, "_WRITER", small)
    try:
        big = torch.zeros((5 << 20) // 4, dtype=torch.float32)  # past the 4 MiB largest object
        assert mm_utils._wrap_shm_or_inline(big, precomputed_hash=0xB16) is big, "SGLang's inline path"
        # Leased (sent, not yet read): two 3 MiB features fill 8 MiB; the
        # third goes inline, and no leased object was evicted for it.
        sent = [
            mm_utils._wrap_shm_or_inline(torch.full(((3 << 20) // 4,), float(i)), precomputed_hash=i) for i in range(3)
        ]
        assert [type(x).__name__ for x in sent] == ["ShmPointerMMData", "ShmPointerMMData", "Tensor"], sent
        assert small.fallbacks == 2
        for i, p in enumerate(sent[:2]):
            assert torch.equal(pickle.loads(pickle.dumps(p)).materialize(), torch.full(((3 << 20) // 4,), float(i)))
    finally:
        small.store.close()


def test_a_name_that_lies_is_a_failed_feature_never_a_wrong_one():
    for name in ("pinshm:", "pinshm:x:1:2", "pinshm:x:a:b:c", "pinshm:x:-1:2:3", f"pinshm:x:{1 << 64}:1:1"):
        assert _store.Ref.parse(name) is None, name
    w = _store.writer()
    ref = w.put(torch.ones(8).view(torch.uint8), None)
    h = ref.handle
    stub = mm_utils.ShmPointerMMData.__new__(mm_utils.ShmPointerMMData)
    # Another object's id at this address, a wrong epoch, a store that is not there.
    for bad in (
        f"pinshm:{ref.store}:{h.address}:{h.monotonic_id + 99}:{h.epoch}",
        f"pinshm:{ref.store}:{h.address}:{h.monotonic_id}:{h.epoch ^ 1}",
        f"pinshm:pinshm_sgl_1_00000000:{h.address}:{h.monotonic_id}:{h.epoch}",
        f"pinshm:pinshm_ec:{h.address}:{h.monotonic_id}:{h.epoch}",
    ):
        stub.__setstate__({"shm_name": bad, "shape": (8,), "dtype": torch.float32, "precomputed_hash": None})
        with pytest.raises(RuntimeError):  # pinshm's failure, or SGLang's for a name not ours
            stub.materialize()
    # A shape that claims terabytes: refused before anything is allocated.
    stub.__setstate__({"shm_name": ref.name(), "shape": (1 << 40,), "dtype": torch.float32, "precomputed_hash": None})
    with pytest.raises(RuntimeError, match="bytes where"):
        stub.materialize()
    # Right object, a shape that claims more bytes than it holds.
    stub.__setstate__({"shm_name": ref.name(), "shape": (9,), "dtype": torch.float32, "precomputed_hash": None})
    with pytest.raises(RuntimeError, match="bytes where"):
        stub.materialize()


def test_hashing_runs_in_sglangs_thread_pool_and_the_tokenizer_workers_are_bound(monkeypatch):
    """The plugin (bound in this process by the fixture) left SGLang's
    precompute switch on, which SGLang reads at each request, and named its
    package for SGLang's tokenizer workers; SGLang's own hash executor then
    hashes an item off the calling thread, once, to the value the ranks
    would compute, and the wrap hook finds nothing left to hash."""
    import asyncio
    import threading

    from sglang.srt.environ import envs
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem
    from sglang.srt.multimodal.processors.hash_executor import MultimodalHashExecutor

    assert envs.SGLANG_MM_PRECOMPUTE_HASH.get() is True
    assert os.environ["SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE"] == "pinshm.sglang.workers"
    f = torch.randn(64, 64)
    item = MultimodalDataItem(modality=Modality.IMAGE, feature=f)
    threads = []
    real = MultimodalDataItem.set_pad_value

    def spy(self):
        threads.append(threading.current_thread().name)
        return real(self)

    monkeypatch.setattr(MultimodalDataItem, "set_pad_value", spy)
    asyncio.run(MultimodalHashExecutor().set_pad_values([item]))
    assert item.hash == mm_utils.hash_feature(f)
    assert threads and all(t.startswith("sglang-mm-hash") for t in threads), threads
    _transport(monkeypatch)
    req = _request([f.clone()], [item.hash])
    req.mm_inputs.mm_items[0].pad_value = item.pad_value
    threads.clear()
    mm_utils.wrap_shm_features(req)
    assert threads == [], "the wrap hook hashed again"


def test_a_finished_requests_leases_end_through_sglangs_own_outputs(monkeypatch):
    """The tokenizer's store binds a hook before SGLang's
    `TokenizerManager._handle_batch_output` at its first feature; SGLang's
    own output batch with a finish reason ends the leases of the objects
    that request sent (and only once no other unfinished request sent them)."""
    import msgspec
    from sglang.srt.managers import tokenizer_manager
    from sglang.srt.managers.io_struct import BatchStrOutput

    _transport(monkeypatch)
    req = _request([torch.full((64,), 3.0)], [0xF1F1])
    req.rid = "fin-1"
    req = mm_utils.wrap_shm_features(req)
    w = _store.current()
    ident = req.mm_inputs.mm_items[0].feature._pinshm.handle.monotonic_id
    assert ident in w.leases and w.requests["fin-1"][1] == [ident]
    bound = tokenizer_manager.TokenizerManager._handle_batch_output
    assert getattr(bound, "__wrapped__", None) is not None, "the finish hook is not bound"

    def outputs(rids, reasons):
        kwargs = {f.name: None for f in msgspec.structs.fields(BatchStrOutput) if f.required}
        kwargs.update(rids=rids, finished_reasons=reasons)
        return BatchStrOutput(**kwargs)

    # A batch where the request is still running: nothing ends.
    bound(None, outputs(["fin-1"], [None])).close()  # the hook runs before SGLang's coroutine starts
    assert ident in w.leases
    bound(None, outputs(["other", "fin-1"], [{"type": "stop"}, {"type": "length", "length": 8}])).close()
    assert ident not in w.leases and "fin-1" not in w.requests
    # The feature stays stored (a repeat still finds it), only evictable now.
    assert w.store.get_cached(f"h:{0xF1F1:x}:float32:64") is not None
