"""The SGLang plugin at the rank counts users run, and killed the way
containers kill: 128 ranks (TP × DP = 128) reading one tokenizer's store,
whose name leaves /dev/shm once they have all attached; an engine that is
PID 1 of its PID namespace killed with everything in it, after its ranks
attached (nothing left) and before (the next server's first feature
sweeps what it left). Real processes throughout; SGLang's contract from
the stand-ins (tests/python/_sglang_stand_in.py), as in CI."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from _sglang_stand_in import install, run_plugin

TOKENIZER = """
import os, pickle, sys, time, multiprocessing as mp
import numpy as np, torch
from pinshm.sglang import _store, plugin
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.managers import mm_utils
plugin.register(); HookRegistry.apply_hooks()
RANKS = int(os.environ["PINSHM_SGLANG_RANKS"])

def feature(k):
    return torch.Tensor(np.full(16 * 1024, k, dtype=np.float32))  # 64 KiB

def send(k):
    return pickle.dumps(mm_utils._wrap_shm_or_inline(feature(k), precomputed_hash=k))

def rank(conn):
    ok = True
    while True:
        msg = conn.recv()
        if msg is None:
            break
        k, blob = msg
        t = pickle.loads(blob).materialize()
        ok = ok and torch.equal(t, feature(k))
        conn.send(ok)

first = send(1)
w = _store.writer()
ctx = mp.get_context("fork")
ends = []
for _ in range(RANKS):
    a, b = ctx.Pipe()
    ctx.Process(target=rank, args=(b,), daemon=True).start()
    ends.append(a)
for e in ends:
    e.send((1, first))
assert all(e.recv() for e in ends), "a rank read wrong bytes"
named_before = os.path.exists("/dev/shm/" + w.name)
time.sleep(1.1)  # the writer looks at its reader table once a second at most
second = send(2)  # every rank has attached: the name leaves now
for e in ends:
    e.send((2, second))
assert all(e.recv() for e in ends), "a rank read wrong bytes after the name left"
print("STORE", w.name, named_before, os.path.exists("/dev/shm/" + w.name), flush=True)
if len(sys.argv) > 1:  # stay until killed, ranks and all
    time.sleep(600)
for e in ends:
    e.send(None)
"""


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    install(tmp_path)
    return tmp_path


def _gone(path: str, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not os.path.exists(path)


def test_128_ranks_read_one_store_and_its_name_leaves_once_all_attached(stand_in):
    p = run_plugin(stand_in, TOKENIZER, env={"PINSHM_SGLANG_RANKS": "128"})
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, out + err
    store, named_before, named_after = out.split("STORE ")[1].split()
    assert named_before == "True", "named while ranks were still attaching"
    assert named_after == "False", "the name stayed after all 128 ranks attached"


def _pid_namespace() -> tuple[str, ...]:
    """The prefix that runs a command as PID 1 of a new PID namespace (as
    a container's engine), or a skip saying why it cannot be made here."""
    if subprocess.run(["unshare", "-p", "-f", "true"], capture_output=True).returncode != 0:
        if os.environ.get("PINSHM_REQUIRE_NS") == "1":
            pytest.fail("PINSHM_REQUIRE_NS=1 but a PID namespace cannot be created here")
        pytest.skip("cannot create a PID namespace here (needs root and unshare)")
    return ("unshare", "-p", "-f", "--kill-child")


def _killed_as_pid_1(stand_in: Path, code: str) -> str:
    """Runs `code` as PID 1 of a new PID namespace (the tokenizer of a
    container's engine, 2 ranks) until it prints its store, then SIGKILLs
    that PID 1 (the child `unshare -f` forked): the kernel kills every
    process of the namespace, pinshm's detached reaper included. The
    store's name."""
    p = run_plugin(stand_in, code, "stay", prefix=_pid_namespace(), env={"PINSHM_SGLANG_RANKS": "2"})
    line = p.stdout.readline()
    assert line.startswith("STORE "), line + p.stderr.read()
    kids = [int(x) for x in open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()]
    assert len(kids) == 1, kids
    os.kill(kids[0], signal.SIGKILL)
    p.wait(30)
    return line.split()[1]


def test_an_engine_that_is_pid_1_leaves_nothing_when_killed_after_its_ranks_attached(stand_in):
    store = _killed_as_pid_1(stand_in, TOKENIZER)
    assert _gone(f"/dev/shm/{store}", 5), "a PID-1 engine's store stayed"


EARLY = """
import logging; logging.basicConfig(level=logging.INFO)
import pickle, sys, time
import numpy as np, torch
from pinshm.sglang import _store, plugin
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.managers import mm_utils
plugin.register(); HookRegistry.apply_hooks()
mm_utils._wrap_shm_or_inline(torch.Tensor(np.zeros(1024, np.float32)), precomputed_hash=3)
print("STORE", _store.writer().name, flush=True)
if len(sys.argv) > 1:
    time.sleep(600)
"""


def test_a_pid_1_engine_killed_before_its_ranks_attached_is_swept_by_the_next_server(stand_in):
    store = _killed_as_pid_1(stand_in, EARLY)
    time.sleep(1)
    assert os.path.exists(f"/dev/shm/{store}"), "named until its ranks attach: the reaper died with the namespace"
    nxt = run_plugin(stand_in, EARLY, env={"PINSHM_SGLANG_RANKS": "2"})
    out, err = nxt.communicate(timeout=120)
    assert nxt.returncode == 0, out + err
    assert not os.path.exists(f"/dev/shm/{store}"), "the next server's first feature did not sweep it"
    assert f"removed {store}" in err, err
    assert _gone(f"/dev/shm/{out.split()[1]}"), "the next server's own store outlived it"
