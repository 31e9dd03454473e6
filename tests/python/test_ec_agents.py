"""The remote tier's NIXL agents are destroyed when released, in the
process that made them, and never by the garbage collector of a forked
child or at exit: UCX's teardown of connections a forked child shares
with its parent aborted the parent (pinshm.vllm.ec._wire.release). A
stand-in agent records its destructor, so NIXL is not needed."""

import gc
import os

import pytest
from _fork import in_child

from pinshm.vllm.ec import _wire


class StandIn:
    """Writes the pid of the process that destroys it to a pipe."""

    def __init__(self, fd):
        self.fd = fd
        self.cycle = self  # only the collector could free it, unreleased

    def __del__(self):
        os.write(self.fd, b"%d\n" % os.getpid())


@pytest.fixture
def made(monkeypatch):
    r, w = os.pipe()
    os.set_blocking(r, False)
    monkeypatch.setattr(_wire, "_make_agent", lambda name, progress: StandIn(w))

    def destroyed_by():
        try:
            return [int(p) for p in os.read(r, 4096).split()]
        except BlockingIOError:
            return []

    yield destroyed_by
    os.close(r)
    os.close(w)


def test_a_released_agent_is_destroyed_at_once_in_the_process_that_made_it(made):
    a = _wire.agent("a", progress=False)
    del a
    gc.collect()
    assert made() == [], "held until released, cycle or not"
    a = next(x for x, _ in _wire._LIVE.values() if isinstance(x, StandIn))
    a.cycle = None
    _wire.release(a)
    _wire.release(a)  # twice: nothing more
    del a
    assert made() == [os.getpid()]


def test_a_forked_child_never_destroys_its_parents_agents(made):
    a = _wire.agent("a", progress=False)

    def child():
        nonlocal a
        _wire.release(a)  # in the child: kept, not destroyed
        del a
        gc.collect()
        return 0

    assert in_child(child) == 0
    assert made() == [], "the child ran the parent's destructor"
    a.cycle = None
    _wire.release(a)
    del a
    assert made() == [os.getpid()]


def test_an_agent_released_while_a_transfer_may_be_in_flight_is_never_destroyed(made):
    a = _wire.agent("a", progress=False)
    a.cycle = None
    _wire.release(a, safe=False)
    del a
    gc.collect()
    assert made() == []
    assert not any(isinstance(x, StandIn) for x, _ in _wire._LIVE.values())


def test_agents_never_released_are_not_destroyed_at_exit(tmp_path):
    import subprocess
    import sys

    code = (
        "import os\n"
        "from pinshm.vllm.ec import _wire\n"
        "class S:\n"
        "    def __del__(self): os.write(1, b'destroyed')\n"
        "_wire._make_agent = lambda name, progress: S()\n"
        "a = _wire.agent('a', progress=True)\n"
        "print('made', flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "made\n"
