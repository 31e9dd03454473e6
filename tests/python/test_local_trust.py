"""Whose segments a process trusts (docs/security.md, on a node): a segment
opened by name is read only if this process's user (or a uid it was told
to trust, PINSHM_TRUSTED_UIDS) made it and nobody else may write it; a
FIFO at a name is an error at once, never a hang; the names pinshm
derives cannot be pre-empted; a process's reaper removes only what that
process made; an output that is not this model's is never loaded. The
other user is real (useradd, setpriv: _users.py)."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from _ec_fixtures import engines, extra, stand_in, store  # noqa: F401 - fixtures
from _ec_vllm import MODEL, ROWS, WIDTH
from _users import other_user, run_as

import pinshm
from pinshm.vllm.ec._config import model_fingerprint

MAKE_STORE = r"""
import os, sys, numpy as np, pinshm
name, mode, key, rows, width = sys.argv[1], int(sys.argv[2], 8), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
s = pinshm.ObjectStore(1 << 20, 1 << 18, 8, name=name, cache=True, key_index=64)
s.put_tensor(key, np.full((rows, width), 7.0, dtype=np.float32))
os.chmod("/dev/shm/" + name, mode)
print("READY", os.geteuid(), flush=True)
sys.stdin.readline()
s.close()
"""


class OthersStore:
    """A store another user made, held open (a live writer) until closed."""

    def __init__(self, user, name, mode=0o600, key="k", rows=ROWS, width=WIDTH):
        self.name = name
        self.proc = run_as(user, MAKE_STORE, name, oct(mode)[2:], key, str(rows), str(width))
        line = self.proc.stdout.readline()
        assert line.startswith("READY"), line + self.proc.stderr.read()

    def close(self):
        if self.proc.poll() is None:
            self.proc.communicate("\n", timeout=30)
        if os.path.exists("/dev/shm/" + self.name):
            os.unlink("/dev/shm/" + self.name)


@pytest.fixture
def others(unique_name):
    made = []

    def make(**kw):
        s = OthersStore(other_user(), unique_name("other"), **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


# ---- another user's segment -------------------------------------------


@pytest.mark.parametrize("mode", [0o600, 0o666])
def test_another_users_store_is_never_read_and_root_reads_it_only_when_told(others, monkeypatch, mode):
    uid, _ = other_user()
    s = others(mode=mode)
    monkeypatch.delenv("PINSHM_TRUSTED_UIDS", raising=False)
    for attach in (pinshm.StoreHandle.of, pinshm.StoreReader.attach_by_name):
        with pytest.raises(pinshm.UntrustedError) as e:
            attach(s.name)
        assert f"uid {uid}" in str(e.value) and f"{mode:04o}" in str(e.value), str(e.value)
    # Inspection still reads it, and says whose it is.
    info = pinshm.inspect_segment(s.name)
    assert (info.owner_uid, info.mode) == (uid, mode)
    # Told to trust that user: its 0600 store is read; one that anyone
    # could have written never is.
    monkeypatch.setenv("PINSHM_TRUSTED_UIDS", f"12345,{uid}")
    if mode == 0o600:
        r = pinshm.StoreReader.attach_by_name(s.name, pin="off")
        assert np.asarray(r.get_tensor(r.lookup("k")))[0, 0] == 7.0
        r.close()
    else:
        with pytest.raises(pinshm.UntrustedError, match="writable by everyone"):
            pinshm.StoreReader.attach_by_name(s.name)


def test_a_squatted_encoder_cache_store_is_a_miss_and_a_warning_naming_its_owner(others, engines, caplog):  # noqa: F811
    import logging

    uid, _ = other_user()
    key = f"{model_fingerprint(MODEL)}:img-a"
    s = others(mode=0o666, key=key)  # a valid output under the key vLLM asks for
    e = engines("fork", "ec_consumer", {"store": s.name, "size": "1m", "n_readers": 8, "retry_s": 0})
    with caplog.at_level(logging.WARNING, logger="vllm.pinshm.ec"):
        e.step([])
        r = e.step(["img-a"])
    assert r.computed == ["img-a"] and r.loads == [], "the squatter's output was loaded"
    said = [m for m in caplog.messages if "is not read" in m]
    assert said and f"uid {uid}" in said[0], caplog.messages
    assert e.wrong_answers() == {}


# ---- a FIFO at a name ---------------------------------------------------


def _within(seconds, fn):
    """What `fn()` returned or raised, or AssertionError if it took longer."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still blocked after {seconds} s"
    return out


def test_a_fifo_at_a_segments_name_is_an_error_within_a_second(unique_name):
    from pinshm.vllm.ec._attach import NamedReader

    name = unique_name("fifo")
    os.mkfifo("/dev/shm/" + name, 0o600)
    try:
        for what, fn in [
            ("StoreHandle.of", lambda: pinshm.StoreHandle.of(name)),
            ("attach_by_name", lambda: pinshm.StoreReader.attach_by_name(name)),
            ("inspect_segment", lambda: pinshm.inspect_segment(name)),
            ("ObjectStore", lambda: pinshm.ObjectStore(1 << 20, 1 << 16, 1, name=name)),
        ]:
            out = _within(1, fn)
            assert isinstance(out.get("error"), pinshm.PinshmError), (what, out)
            assert "FIFO" in str(out["error"]), (what, str(out["error"]))
        assert _within(1, lambda: pinshm.gc_segments(name, dry_run=False))["value"] == []
        assert _within(1, lambda: NamedReader(name, 0).get())["value"] is None
        t0 = time.monotonic()
        cli = subprocess.run(
            [sys.executable, "-m", "pinshm", "inspect", name], capture_output=True, text=True, timeout=30
        )
        assert time.monotonic() - t0 < 10 and cli.returncode != 0 and "FIFO" in cli.stderr + cli.stdout
    finally:
        os.unlink("/dev/shm/" + name)


# ---- names nobody can pre-empt -------------------------------------------


def test_a_file_at_a_would_be_overflow_name_costs_nothing(unique_name, monkeypatch):
    from pinshm.vllm.queue import MessageQueue, _overflow

    name = unique_name("mq")
    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2, name=name)
    rd = MessageQueue.create_from_handle(mq.export_handle(), 0)
    prefix = mq._tx.name
    # The name of old (`-big1`), and the first name the writer will draw:
    # both taken by empty files (another user's, where there is one).
    drawn = iter(["0123456789ab"])
    real = _overflow.secrets.token_hex
    monkeypatch.setattr(_overflow.secrets, "token_hex", lambda n: next(drawn, None) or real(n))
    squatted = [f"{prefix}-big1", f"{prefix}-big1-0123456789ab"]
    for n in squatted:
        fd = os.open("/dev/shm/" + n, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.close(fd)
        if os.geteuid() == 0:
            try:
                os.chown("/dev/shm/" + n, other_user()[0], -1)
            except BaseException:  # noqa: BLE001 - skip/fail of other_user: the file stays ours
                pass
    try:
        big = b"x" * (1 << 20)
        mq.enqueue(big)
        assert rd.dequeue() == big, "a large message went through"
        assert mq._overflow.store.name not in squatted
        assert all(os.path.getsize("/dev/shm/" + n) == 0 for n in squatted), "the squatted files left alone"
    finally:
        rd.close()
        mq.close()
        for n in squatted:
            os.unlink("/dev/shm/" + n)


# ---- only the maker removes a name ---------------------------------------

KILLED_ENGINE = r"""
import os, signal, sys, time
import pinshm
from pinshm._node import tracker as _tracker

_tracker._pipe()  # the reaper first, then a child that only holds its pipe
child = os.fork()
if child == 0:
    signal.pause()
    os._exit(0)
store = pinshm.ObjectStore(1 << 20, 1 << 16, 1, name=sys.argv[1])
_tracker.Tracked().add(sys.argv[1])
print("READY", _tracker.reaper_pid(), child, flush=True)
signal.pause()
"""


def _engine_with_store(name):
    """An engine (KILLED_ENGINE) that made store `name`: (process, its
    reaper's pid, the pid of its child that holds only the reaper's pipe)."""
    a = subprocess.Popen([sys.executable, "-c", KILLED_ENGINE, name], stdout=subprocess.PIPE, text=True)
    line = a.stdout.readline().split()
    assert line[:1] == ["READY"], line
    return a, int(line[1]), int(line[2])


def test_a_killed_engines_reaper_never_removes_another_engines_live_store(unique_name):
    name = unique_name("reaped")
    a, reaper, child = _engine_with_store(name)
    mine = None
    try:
        os.kill(a.pid, signal.SIGKILL)  # engine A dies; its reaper waits for the child's pipe end
        a.wait()
        # Engine B: a live store under the same name (A's is abandoned).
        mine = pinshm.ObjectStore(1 << 20, 1 << 16, 1, name=name)
        ino = os.stat("/dev/shm/" + name).st_ino
        os.kill(child, signal.SIGKILL)  # now A's reaper runs
        fd = os.pidfd_open(reaper)
        import select

        assert select.select([fd], [], [], 30)[0], "the reaper did not finish"
        os.close(fd)
        assert os.path.exists("/dev/shm/" + name), "A's reaper removed B's live store"
        assert os.stat("/dev/shm/" + name).st_ino == ino
        mine.put("k", b"still mine")
    finally:
        for pid in (a.pid, child):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if mine is not None:
            mine.close()
        if os.path.exists("/dev/shm/" + name):
            os.unlink("/dev/shm/" + name)


def test_a_killed_engines_reaper_removes_what_it_made(unique_name):
    name = unique_name("reaped")
    a, reaper, child = _engine_with_store(name)
    try:
        for pid in (a.pid, child):
            os.kill(pid, signal.SIGKILL)
        a.wait()
        deadline = time.monotonic() + 30
        while os.path.exists("/dev/shm/" + name):
            assert time.monotonic() < deadline, "left in /dev/shm after its engine was killed"
            time.sleep(0.02)
    finally:
        if os.path.exists("/dev/shm/" + name):
            os.unlink("/dev/shm/" + name)
    del reaper


# ---- an output that is not this model's -----------------------------------


@pytest.mark.parametrize("shape, dtype", [((ROWS, 3), np.float32), ((ROWS, WIDTH), np.int32), ((ROWS * WIDTH,), np.float32)])
def test_an_output_of_another_shape_or_dtype_is_a_miss_with_a_warning(engines, extra, store, caplog, shape, dtype):  # noqa: F811
    import logging

    key = f"{model_fingerprint(MODEL)}:img-a"
    s = pinshm.ObjectStore(1 << 20, 1 << 18, 8, name=store, cache=True, key_index=64)
    try:
        s.put_tensor(key, np.ones(shape, dtype=dtype))
        e = engines("fork", "ec_consumer", dict(extra, retry_s=0))
        with caplog.at_level(logging.WARNING, logger="vllm.pinshm.ec"):
            e.step([])
            r = e.step(["img-a"])
        assert r.computed == ["img-a"] and r.loads == [], "an output of another shape was loaded"
        assert any("not this model's" in m for m in caplog.messages), caplog.messages
        assert e.scheduler._scheduler.wrong_shape == 1
        assert e.wrong_answers() == {} and e.failed == set()
    finally:
        s.close()
