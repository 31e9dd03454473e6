"""The remote tier's NIXL agents are destroyed when released, in the
process that made them, and never by the garbage collector, a forked
child or the exit: UCX's teardown of connections a forked child shares
with its parent aborted the parent (pinshm.vllm.ec.remote.nixl.release). A
stand-in agent records its destructor, so NIXL is not needed."""

import gc
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from _fork import in_child

from pinshm.vllm.ec.remote import nixl


class StandIn:
    """Writes the pid of the process that destroys it to a pipe."""

    def __init__(self, fd):
        self.fd = fd
        self.cycle = self  # only the collector could free it, unreleased

    def __del__(self):
        os.write(self.fd, b"%d\n" % os.getpid())


class Owner:
    """What holds an agent, as the remote tier's server and fetcher do."""

    def __init__(self):
        self._agent = nixl.agent("a", progress=False)
        self._agent.cycle = None  # from here on, only the owner holds it


@pytest.fixture
def destroyed(monkeypatch):
    """Makes agents stand-ins; returns the pids that destroyed one so far."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    monkeypatch.setattr(nixl, "_make_agent", lambda name, progress: StandIn(w))

    def pids():
        try:
            return [int(p) for p in os.read(r, 4096).split()]
        except BlockingIOError:
            return []

    yield pids
    os.close(r)
    os.close(w)


def test_an_agent_is_held_until_released_then_destroyed_at_once_in_its_process(destroyed):
    a = nixl.agent("a", progress=False)
    key = id(a)
    del a
    gc.collect()
    assert destroyed() == [], "held until released, in a cycle or not"
    owner = SimpleNamespace(_agent=nixl._LIVE[key][0])
    owner._agent.cycle = None
    nixl.release(owner)
    assert owner._agent is None
    nixl.release(owner)  # twice: nothing more
    assert destroyed() == [os.getpid()]
    assert key not in nixl._LIVE


def test_a_forked_child_never_destroys_its_parents_agents(destroyed):
    owner = Owner()
    assert nixl.made_here(owner._agent)

    def child():
        if nixl.made_here(owner._agent):
            return 1
        nixl.release(owner)  # in the child: kept, not destroyed
        gc.collect()
        return 0

    assert in_child(child) == 0
    assert destroyed() == [], "the child ran the parent's destructor"
    nixl.release(owner)
    assert destroyed() == [os.getpid()]


def test_an_agent_still_referred_to_or_maybe_in_use_is_never_destroyed(destroyed):
    owner = Owner()
    other, keys = owner._agent, [id(owner._agent)]
    nixl.release(owner)  # `other` still refers to it
    del other
    gc.collect()
    owner = Owner()
    keys.append(id(owner._agent))
    nixl.release(owner, safe=False)  # a transfer may still be in flight
    gc.collect()
    assert destroyed() == []
    assert not any(k in nixl._LIVE for k in keys)


def test_agents_never_released_are_not_destroyed_at_exit():
    code = (
        "import os\n"
        "from pinshm.vllm.ec.remote import nixl\n"
        "class S:\n"
        "    def __del__(self): os.write(1, b'destroyed')\n"
        "nixl._make_agent = lambda name, progress: S()\n"
        "a = nixl.agent('a', progress=True)\n"
        "print('made', flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "made\n"
