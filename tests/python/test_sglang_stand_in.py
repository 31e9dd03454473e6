"""The SGLang plugin in CI, without SGLang or torch: SGLang's contract
(tests/python/_sglang_stand_in.py) with pinshm's class bound by the
plugin, in a subprocess. The same checks run against the real SGLang in
tests/python/test_sglang_plugin.py (locally, never in CI)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _sglang_stand_in import install, run_plugin

ROUND_TRIP = """
import os, pickle, sys, types
import torch
from pinshm.sglang import _fit, _store, plugin
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.managers import mm_utils
from sglang.srt.managers.mm_utils import ShmPointerMMData as copied  # a `from X import Y` copy

assert _fit.misfit() is None, _fit.misfit()
stock = [mm_utils.ShmPointerMMData]  # in a list: the hook rebinds module names bound to the class
plugin.register(); HookRegistry.apply_hooks()
assert mm_utils.ShmPointerMMData is not stock[0] and issubclass(mm_utils.ShmPointerMMData, stock[0])
assert sys.modules[__name__].copied is mm_utils.ShmPointerMMData, "the copy is rebound"

class Item:
    # SGLang's MultimodalDataItem as far as the plugin uses it: a hash
    # (None until set_pad_value) and a feature.
    def __init__(self, feature, hash):
        self.feature, self.hash, self.pad_value = feature, hash, None
    def set_pad_value(self):
        import hashlib
        self.hash = int.from_bytes(hashlib.sha256(self.feature.numpy().tobytes()).digest()[:8], "big")
        self.pad_value = self.hash % (1 << 30)

def request(feats, hashes):
    items = [Item(f, h) for f, h in zip(feats, hashes)]
    return types.SimpleNamespace(mm_inputs=types.SimpleNamespace(mm_items=items))

before = {n for n in os.listdir("/dev/shm") if n.startswith("sgl_shm_mm")}
feats = [torch.arange(64), torch.arange(6, dtype=torch.int64).reshape(2, 3)]
req = mm_utils.wrap_shm_features(request([f.clone() for f in feats], [0x11, 0x12]))
assert mm_utils.has_shm_features([req])
ptr = req.mm_inputs.mm_items[0].feature
assert ptr.shm_name.startswith("pinshm:") and mm_utils.is_shm_pointer_by_name(ptr)
assert {n for n in os.listdir("/dev/shm") if n.startswith("sgl_shm_mm")} == before
for _ in range(2):  # two ranks, each its own private tensor
    got = pickle.loads(pickle.dumps(req))
    mm_utils.unwrap_shm_features(got)
    assert all(torch.equal(i.feature, f) for i, f in zip(got.mm_inputs.mm_items, feats))
    got.mm_inputs.mm_items[0].feature.numpy()[:] = 0  # private: no other rank sees it
mm_utils.discard_shm_features(pickle.loads(pickle.dumps(req)))
w = _store.writer()
for _ in range(3):
    mm_utils.wrap_shm_features(request([feats[0].clone()], [0x11]))
assert (w.puts, w.hits) == (2, 3), (w.puts, w.hits)
# No hash from SGLang's processor (its default): SGLang's own hash is set
# here, once, and a repeat is still served from the store.
for _ in range(2):
    r = mm_utils.wrap_shm_features(request([torch.arange(32)], [None]))
    assert r.mm_inputs.mm_items[0].hash is not None and r.mm_inputs.mm_items[0].pad_value is not None
assert (w.puts, w.hits) == (3, 4), (w.puts, w.hits)
print("STORE", w.name, flush=True)
if len(sys.argv) > 1:  # stay until killed
    import time; time.sleep(600)
"""


BURST = """
import os, pickle, multiprocessing as mp
os.environ["PINSHM_SGLANG_CACHE_MIB"] = "4"  # a 4 MiB store under a burst of 50 MiB
os.environ["PINSHM_SGLANG_GRACE_S"] = "0.05"  # leases end before the ranks read
import numpy as np, torch
from pinshm.sglang import _store, plugin
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.managers import mm_utils

plugin.register(); HookRegistry.apply_hooks()

def feat(k):
    return torch.Tensor(np.full(64 * 1024, k, dtype=np.float32))  # 256 KiB

sent = []
for i in range(200):  # 40 images, each sent five times
    sent.append((i % 40, pickle.dumps(mm_utils._wrap_shm_or_inline(feat(i % 40), precomputed_hash=i % 40))))

def rank(conn):
    ok = miss = wrong = 0
    for k, blob in sent:
        p = pickle.loads(blob)
        try:
            t = p.materialize() if isinstance(p, mm_utils.ShmPointerMMData) else p
        except RuntimeError:
            miss += 1  # evicted after its lease: SGLang fails the request
            continue
        if torch.equal(t, feat(k)):
            ok += 1
        else:
            wrong += 1
    conn.send((ok, miss, wrong))

ctx = mp.get_context("fork")
pipes, procs = [], []
for _ in range(8):  # TP=8: eight ranks attach and read at once
    a, b = ctx.Pipe()
    procs.append(ctx.Process(target=rank, args=(b,)))
    pipes.append(a)
for p in procs:
    p.start()
for i in range(300):  # the writer goes on putting while the ranks read: it evicts what they want
    mm_utils._wrap_shm_or_inline(feat(100 + i), precomputed_hash=100 + i)
got = [a.recv() for a in pipes]
for p in procs:
    p.join(60)
assert all(w == 0 for _, _, w in got), got
assert all(ok > 0 for ok, _, _ in got), got
print("RANKS", got, "puts", _store.writer().puts, "hits", _store.writer().hits, flush=True)
"""


IN_PLACE = """
import os, pickle, multiprocessing as mp
import numpy as np, torch
from pinshm.sglang import _store, plugin
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.managers import mm_utils
plugin.register(); HookRegistry.apply_hooks()

def mapping_of(addr):
    # (path, Private_Dirty KiB) of the mapping holding addr
    cur = None
    for line in open("/proc/self/smaps"):
        f = line.split()
        if "-" in f[0] and not f[0].endswith(":"):
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            cur = (f[5] if len(f) > 5 else "") if lo <= addr < hi else None
        elif f[0] == "Private_Dirty:" and cur is not None:
            return cur, int(f[1])
    raise AssertionError(hex(addr))

want = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
blob = pickle.dumps(mm_utils._wrap_shm_or_inline(torch.Tensor(want.copy()), precomputed_hash=7))
store = _store.writer().name

def rank(conn, writes):
    t = pickle.loads(blob).materialize()
    a = t.numpy()
    path, dirty = mapping_of(a.ctypes.data + a.nbytes // 2)
    same = bool((a == want).all())
    conn.send((path, dirty, same))
    conn.recv()  # the writing rank has written
    if writes:
        a[:] = -1.0  # this rank's tensor: private
        dirty_after = mapping_of(a.ctypes.data + a.nbytes // 2)[1]
    else:
        dirty_after = dirty
    conn.send((bool((a == want).all()), dirty_after))
    conn.recv()

ctx = mp.get_context("fork")
ends, procs = [], []
for r in range(4):  # TP=4: rank 0 writes into its tensor, ranks 1-3 read
    a, b = ctx.Pipe()
    procs.append(ctx.Process(target=rank, args=(b, r == 0)))
    ends.append(a)
for p in procs:
    p.start()
first = [e.recv() for e in ends]
for e in ends:
    e.send("go")
after = [e.recv() for e in ends]
for e in ends:
    e.send("bye")
for p in procs:
    p.join(60)
for path, dirty, same in first:
    assert path == "/dev/shm/" + store, (path, store)  # the tensor is the store's pages
    assert dirty == 0, dirty  # not one page copied
    assert same
assert after[0][0] is False and after[0][1] >= 4096, after[0]  # the writer's tensor changed, privately
assert all(ok for ok, _ in after[1:]), after  # no other rank saw it
r = __import__("pinshm").StoreReader.attach_by_name(store, pin="off")
assert np.array_equal(np.frombuffer(bytes(r.get_copy(pickle.loads(blob)._pinshm.handle)), np.float32), want)
print("OK", first, after, flush=True)
"""


def test_ranks_read_a_feature_in_place_and_a_rank_that_writes_changes_no_other(stand_in):
    """Four forked ranks materialize one 4 MiB feature: each tensor is the
    store's own pages (its mapping is the store's file, 0 KiB copied);
    the rank that writes into its tensor copies the pages it wrote into
    memory of its own, and neither the other ranks nor the store see it."""
    p = _run(stand_in, IN_PLACE)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, out + err


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    install(tmp_path)
    return tmp_path


_run = run_plugin


def test_the_plugin_round_trips_features_through_sglangs_contract(stand_in):
    p = _run(stand_in, ROUND_TRIP)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    store = out.split("STORE ")[1].split()[0]
    # The tokenizer exited: its store goes with it (its reaper removes it).
    deadline = time.monotonic() + 30
    while os.path.exists(f"/dev/shm/{store}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/dev/shm/{store}"), "the store outlived its tokenizer"


def _descendants(root: int) -> list[int]:
    parent = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    out, todo = [], [root]
    while todo:
        at = todo.pop()
        kids = [c for c, pp in parent.items() if pp == at]
        out += kids
        todo += kids
    return out


def test_a_sigkilled_tokenizer_leaves_nothing_in_dev_shm(stand_in):
    p = _run(stand_in, ROUND_TRIP, "stay")
    line = p.stdout.readline()
    assert line.startswith("STORE "), line + p.stderr.read()
    store = line.split()[1]
    assert os.path.exists(f"/dev/shm/{store}")
    # As SGLang's kill_process_tree at shutdown: every descendant, then the
    # process. pinshm's reaper is nobody's child, so it is not among them.
    for pid in _descendants(p.pid):
        os.kill(pid, signal.SIGKILL)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(30)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/dev/shm/{store}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/dev/shm/{store}"), "a SIGKILLed tokenizer's store stayed"


def test_an_sglang_the_plugin_was_not_checked_against_keeps_its_own_path(stand_in):
    meta = next(stand_in.glob("sglang-*.dist-info"))
    meta.rename(stand_in / "sglang-0.6.0.dist-info")
    (stand_in / "sglang-0.6.0.dist-info/METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.6.0\n")
    code = """
    import logging; logging.basicConfig()
    from pinshm.sglang import plugin
    from sglang.srt.managers import mm_utils
    stock = mm_utils.ShmPointerMMData
    plugin.register()
    assert not plugin.bound and mm_utils.ShmPointerMMData is stock
    """
    p = _run(stand_in, code)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert err.count("WARNING") == 1 and "SGLang 0.6.0 is not one the plugin was checked against" in err, err


def test_pinshm_sglang_0_leaves_sglangs_path(stand_in):
    code = """
    import os
    os.environ["PINSHM_SGLANG"] = "0"
    from pinshm.sglang import plugin
    plugin.register()
    assert not plugin.bound
    """
    p = _run(stand_in, code)
    assert p.wait(60) == 0, p.stderr.read()


def test_a_name_that_lies_parses_to_nothing():
    from pinshm.sglang._store import Ref

    for name in (
        "",
        "sgl_shm_mm_1_ab",
        "pinshm:",
        "pinshm:s:1:2",
        "pinshm::1:2:3",
        "pinshm:s:a:2:3",
        "pinshm:s:-1:2:3",
        f"pinshm:s:{1 << 64}:2:3",
        "pinshm:s:1:2:3:4x",
    ):
        assert Ref.parse(name) is None, name
    for name in (
        "pinshm:pinshm_ec:1:2:3",
        "pinshm:../x:1:2:3",
        "pinshm:pinshm_sgl_1_ab12cd34:+1:2:3",
        "pinshm:pinshm_sgl_1_ab12cd34:1_0:2:3",
        "pinshm:pinshm_sgl_1_ab12cd34:\u0661:2:3",
    ):
        assert Ref.parse(name) is None, name  # another store, a path, numbers int() would take
    r = Ref.parse("pinshm:pinshm_sgl_1_ab12cd34:128:7:99")
    assert r is not None
    assert (r.store, r.handle.address, r.handle.monotonic_id, r.handle.epoch) == ("pinshm_sgl_1_ab12cd34", 128, 7, 99)
    assert Ref.parse(r.name()) == r


def test_eight_ranks_under_a_burst_through_a_small_store_read_right_bytes_or_miss(stand_in):
    # A fault (an object evicted once its lease ended, a full store sending
    # features inline) costs a miss, never another feature's bytes.
    p = _run(stand_in, BURST)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert "RANKS" in out, out


WORKER = """
import importlib, os, pkgutil, sys
import numpy as np, torch
from sglang.srt.managers import mm_utils
stock = [mm_utils.ShmPointerMMData]  # in a list: the hook rebinds names bound to the class
# SGLang's tokenizer worker: no plugin loader, but it imports every module
# of SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE (multimodal_processor.import_processors).
pkg = importlib.import_module(os.environ["SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE"])
for _, name, ispkg in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
    importlib.import_module(name)
assert mm_utils.ShmPointerMMData is not stock[0] and mm_utils.ShmPointerMMData._pinshm_bound
p = mm_utils._wrap_shm_or_inline(torch.Tensor(np.arange(8, dtype=np.float32)), precomputed_hash=5)
assert p.shm_name.startswith("pinshm:pinshm_sgl_"), p.shm_name
print("BOUND", os.getpid(), flush=True)
"""

LAUNCHER = """
import os, subprocess, sys
from pinshm.sglang import plugin
plugin.register()
assert plugin.bound
print("HASH", os.environ.get("SGLANG_MM_PRECOMPUTE_HASH"), "PKG", os.environ.get("SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE"))
# A tokenizer worker, spawned from here as uvicorn spawns SGLang's.
r = subprocess.run([sys.executable, "-c", sys.argv[1]], capture_output=True, text=True, timeout=120)
print(r.stdout, r.stderr, "WORKER_RC", r.returncode, flush=True)
"""


def test_the_launcher_sends_hashing_off_the_loop_and_binds_the_tokenizer_workers(stand_in):
    """register() in the launcher leaves its children SGLang's thread-pool
    hashing (SGLANG_MM_PRECOMPUTE_HASH=1) and the package SGLang's
    tokenizer workers import modules of: a worker started from it, which
    loads no plugin, is bound and puts features into a pinshm store."""
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_MM_PRECOMPUTE_HASH", "SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE")}
    env["PYTHONPATH"] = os.pathsep.join([str(stand_in), os.environ.get("PYTHONPATH", "")])
    r = subprocess.run(
        [sys.executable, "-c", LAUNCHER, textwrap.dedent(WORKER)], env=env, capture_output=True, text=True, timeout=180
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "HASH 1 PKG pinshm.sglang.workers" in r.stdout, r.stdout
    assert "WORKER_RC 0" in r.stdout and "BOUND" in r.stdout, r.stdout
    # A user's own choices stay theirs, said once.
    env.update(SGLANG_MM_PRECOMPUTE_HASH="0", SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE="their.processors")
    code = "import logging; logging.basicConfig()\n" + LAUNCHER.split("# A tokenizer worker")[0]
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "HASH 0 PKG their.processors" in r.stdout, r.stdout
    assert "HTTP tokenizer workers (--tokenizer-worker-num > 1) keep SGLang's own segments" in r.stderr, r.stderr


FULL_OF_LEASES = """
import os, time
os.environ.update(PINSHM_SGLANG_CACHE_MIB="4", PINSHM_SGLANG_GRACE_S="300", PINSHM_SGLANG_MIN_GRACE_S="0.5")
import numpy as np, torch
from pinshm.sglang import _store, plugin
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.managers import mm_utils
plugin.register(); HookRegistry.apply_hooks()
def wrap(k):  # 768 KiB each: the 4 MiB store (2 MiB objects) holds a few
    return mm_utils._wrap_shm_or_inline(torch.Tensor(np.full(192 * 1024, k, np.float32)), precomputed_hash=k)
sent = [wrap(k) for k in range(12)]
inline = [k for k, p in enumerate(sent) if not isinstance(p, mm_utils.ShmPointerMMData)]
assert inline, "the store should have filled with leased features"
time.sleep(0.6)  # every lease is now older than the least grace
late = wrap(100)
assert isinstance(late, mm_utils.ShmPointerMMData), "a full store of old leases took no new feature"
print("INLINE", inline, flush=True)
"""


def test_a_store_full_of_old_leases_lets_them_go_for_a_new_feature(stand_in):
    """Leases are insurance for the moment between a put and the ranks'
    reads; a store full of leased features takes a new one by letting go
    of the leases older than PINSHM_SGLANG_MIN_GRACE_S, and only then."""
    p = _run(stand_in, FULL_OF_LEASES)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, out + err


FINISHED_REQUESTS = """
import os
os.environ.update(PINSHM_SGLANG_CACHE_MIB="4", PINSHM_SGLANG_GRACE_S="300", PINSHM_SGLANG_MIN_GRACE_S="300")
import pickle
import numpy as np, torch
from types import SimpleNamespace as NS
from pinshm.sglang import _pointer, _store, plugin
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.managers import mm_utils
plugin.register(); HookRegistry.apply_hooks()
def request(rid, k):  # one 768 KiB feature: the 4 MiB store (2 MiB objects) holds a few
    item = NS(feature=torch.Tensor(np.full(192 * 1024, k, np.float32)), hash=k, pad_value=k)
    return mm_utils.wrap_shm_features(NS(rid=rid, mm_inputs=NS(mm_items=[item])))
def read(req):  # a rank's read, then its tensor goes (as at the request's end)
    wire = pickle.loads(pickle.dumps(req.mm_inputs.mm_items[0].feature))
    return float(wire.materialize().numpy()[0])
def finish(*rids):
    _pointer.note_finished(None, NS(rids=list(rids), finished_reasons=[{"type": "stop"}] * len(rids)))
held = request("held", 1000)  # never finished: its lease stays
assert isinstance(held.mm_inputs.mm_items[0].feature, mm_utils.ShmPointerMMData)
w = _store.writer()
for k in range(24):  # each read, then finished: its lease ends with it
    r = request(f"r{k}", k)
    assert isinstance(r.mm_inputs.mm_items[0].feature, mm_utils.ShmPointerMMData), k
    assert read(r) == k
    finish(f"r{k}")
assert read(held) == 1000.0, "an unfinished request's feature was evicted"
# One object sent by two requests: the first to finish keeps it leased.
a, b = request("a", 7), request("b", 7)
assert w.sending[a.mm_inputs.mm_items[0].feature._pinshm.handle.monotonic_id] == 2
finish("a")
assert a.mm_inputs.mm_items[0].feature._pinshm.handle.monotonic_id in w.leases
finish("b", "never-sent")
assert a.mm_inputs.mm_items[0].feature._pinshm.handle.monotonic_id not in w.leases
print("EARLY", w.finished_early, "FALLBACKS", w.fallbacks, flush=True)
assert w.fallbacks == 0, w.fallbacks
# Not finished, the same traffic fills the store with leases: inline.
inline = 0
for k in range(24):
    r = request(f"u{k}", 500 + k)
    inline += not isinstance(r.mm_inputs.mm_items[0].feature, mm_utils.ShmPointerMMData)
assert inline, "unfinished requests' features should have filled the store"
"""


def test_a_finished_requests_leases_end_with_it_and_an_unfinished_ones_stay(stand_in):
    """A feature is leased until every request that sent it has finished
    (its output, after a prefill every rank ran, says so): a small store
    then takes feature after feature where leases held for the grace
    period sent them inline; a request not finished keeps its own."""
    p = _run(stand_in, FINISHED_REQUESTS)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, out + err
    assert "EARLY 25 FALLBACKS 0" in out, out


LYING_HASH = """
import pickle
import numpy as np, torch
from pinshm.sglang import _store, plugin
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.managers import mm_utils
plugin.register(); HookRegistry.apply_hooks()
a = np.full(4096, 1.0, np.float32)
b = np.full(4096, 2.0, np.float32)  # same dtype and shape, other bytes
pa = pickle.dumps(mm_utils._wrap_shm_or_inline(torch.Tensor(a.copy()), precomputed_hash=0xBAD))
pb = pickle.dumps(mm_utils._wrap_shm_or_inline(torch.Tensor(b.copy()), precomputed_hash=0xBAD))  # a client's lie
pc = pickle.dumps(mm_utils._wrap_shm_or_inline(torch.Tensor(a.copy()), precomputed_hash=0xBAD))  # a true repeat
ta, tb, tc = (pickle.loads(p).materialize().numpy() for p in (pa, pb, pc))
assert np.array_equal(ta, a) and np.array_equal(tb, b) and np.array_equal(tc, a), (ta[:2], tb[:2], tc[:2])
w = _store.writer()
assert (w.puts, w.hits, w.mismatches) == (2, 1, 1), (w.puts, w.hits, w.mismatches)
"""


def test_a_hash_that_names_other_bytes_is_never_served_another_features_bytes(stand_in):
    """A client may send its own item hashes (SGLang's mm_hashes): a hit
    is served only where the stored bytes are the feature's, so a lying
    hash costs a put, never another request's image."""
    p = _run(stand_in, LYING_HASH)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, out + err
