"""Another local user squats a name pinshm wants and keeps switching its
file's size between 1 MiB and 0 (a mapping of it would raise SIGBUS at the
next read): creating a store there (the encoder cache's writer, a plain
store), attaching it (a consumer), inspecting it and collecting garbage
never kill the process. A
store's creator refuses the file with a message naming its owner and mode;
the encoder cache's writer goes on with saving off and a WARNING that says
so (docs/security.md). The other user is real (useradd, setpriv:
_users.py); each attempt is a process of its own, so a SIGBUS is its exit
status, not the test's death."""

import os
import subprocess
import sys

import pytest
from _users import other_user, run_as

import pinshm

#: Attempts per kind of process (the hostile review saw 5 of 25 die).
ATTEMPTS = 25

#: As the other user: a real store's first 64 KiB (a valid header, so an
#: inspector goes past its checks), copied into a file at the name, whose
#: size then switches between 1 MiB and 0 until stdin closes.
SQUAT = r"""
import os, sys, threading, pinshm
name, mode = sys.argv[1], int(sys.argv[2], 8)
model = pinshm.ObjectStore(1 << 20, 1 << 18, 8, name=name + "-model", cache=True)
with open("/dev/shm/" + name + "-model", "rb") as f:
    header = f.read(1 << 16)
model.close()
fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
os.fchmod(fd, mode)
stop = threading.Event()
def toggle():
    while not stop.is_set():
        os.ftruncate(fd, (1 << 20) + (1 << 16))
        os.pwrite(fd, header, 0)
        os.ftruncate(fd, 0)
threading.Thread(target=toggle, daemon=True).start()
print("READY", flush=True)
sys.stdin.readline()
stop.set()
"""

CREATE = r"""
import sys, pinshm
try:
    pinshm.ObjectStore(1 << 20, 1 << 18, 8, name=sys.argv[1], cache=True, reserve=True)
    print("CREATED")
except pinshm.PinshmError as e:
    print(type(e).__name__, e)
"""

INSPECT = r"""
import sys, pinshm
try:
    pinshm.inspect_segment(sys.argv[1])
    print("READ")
except pinshm.PinshmError as e:
    print(type(e).__name__, e)
"""

ATTACH = r"""
import sys, pinshm
for attach in (pinshm.StoreReader.attach_by_name, pinshm.StoreHandle.of):
    try:
        attach(sys.argv[1])
        print("ATTACHED")
    except pinshm.PinshmError as e:
        print(type(e).__name__, e)
"""

GC = r"""
import sys, pinshm
print(len(pinshm.gc_segments(prefix=sys.argv[1], dry_run=True)))
"""

EC_WRITER = r"""
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
from pinshm.vllm.ec._config import ECSettings
from pinshm.vllm.ec._worker import WorkerSide
side = WorkerSide(ECSettings.from_extra({"store": sys.argv[1], "size": "1m"}), producer=True, consumer=False, writes=True)
print("STORE", side.store)
"""


@pytest.fixture(params=[0o666, 0o600], ids=["mode0666", "mode0600"])
def squatter(request, unique_name):
    """(name, uid, mode) of a name another user squats, switching its size."""
    user = other_user()
    name = unique_name("squat")
    mode = request.param
    proc = run_as(user, SQUAT, name, oct(mode)[2:])
    line = proc.stdout.readline()
    try:
        assert line.startswith("READY"), line + proc.stderr.read()
        yield name, user[0], mode
    finally:
        if proc.poll() is None:
            proc.communicate("\n", timeout=30)
        for path in ("/dev/shm/" + name, "/dev/shm/" + name + "-model"):
            if os.path.exists(path):
                os.unlink(path)


def _run(code, name):
    """Runs `code` as this user; its stdout (failing on any exit status but
    0: a SIGBUS is -7)."""
    done = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"rc {done.returncode}: {done.stdout}{done.stderr}"
    return done.stdout


def test_a_store_at_a_squatted_name_is_refused_naming_the_owner_never_a_crash(squatter):
    name, uid, mode = squatter
    for _ in range(ATTEMPTS):
        out = _run(CREATE, name)
        assert out.startswith("UntrustedError"), out
        assert f"uid {uid}" in out and f"{mode:04o}" in out, out


def test_a_consumer_attaching_a_squatted_name_is_refused_never_a_crash(squatter):
    name, uid, mode = squatter
    for _ in range(ATTEMPTS):
        for line in _run(ATTACH, name).splitlines():
            assert line.startswith("UntrustedError") and f"uid {uid}" in line, line


def test_inspect_and_gc_of_a_squatted_name_never_crash(squatter):
    name, _, mode = squatter
    outcomes = set()
    for _ in range(ATTEMPTS):
        outcomes.add(_run(INSPECT, name).split()[0])
        _run(GC, name)
    # Root reads anyone's file (inspect copies it first, never maps it);
    # the 0600 one is another user's to read where this is not root.
    assert outcomes <= {"READ", "PinshmError", "NotFoundError"}, outcomes


def test_the_encoder_caches_writer_at_a_squatted_name_saves_nothing_and_says_whose_it_is(squatter):
    name, uid, mode = squatter
    for _ in range(5):
        out = _run(EC_WRITER, name)
        assert "STORE None" in out, out
        warning = [line for line in out.splitlines() if line.startswith("WARNING")]
        assert warning and "not this engine's" in warning[0], out
        assert f"uid {uid}" in warning[0] and f"{mode:04o}" in warning[0], out
        assert "live writer" not in out, out
