"""NIXL, loaded lazily, and the life of this process's NIXL agents: made
with UCX's settings for them alone, destroyed only in the process that
made them. A leaf: no store, no vLLM."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any, Optional

#: UCX's transports where the environment names none: TCP, on hosts
#: without RDMA as on this project's machines. Set for pinshm's own agents
#: only (:func:`ucx_env`), never in the environment other libraries read.
DEFAULT_UCX_TLS = "tcp"


_NIXL: Optional[Any] = None


def nixl() -> Any:
    """NIXL's Python API (``nixl_agent``, ``nixl_agent_config``), imported
    on first use. ImportError saying what to install where there is none."""
    global _NIXL
    if _NIXL is None:
        import importlib

        # The extra's other modules, checked here too, so that a missing one
        # stops the engine at start with this advice, not at every lookup.
        for name in ("msgpack", "zmq"):
            try:
                importlib.import_module(name)
            except ImportError as e:
                raise ImportError(
                    "pinshm's remote encoder cache (ec_connector_extra_config 'serve' or 'peers') needs "
                    f"{name}: pip install 'pinshm[nixl]' ({e})"
                ) from None

        errors = []
        for name in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
            try:
                _NIXL = importlib.import_module(name)
                break
            except Exception as e:  # noqa: BLE001 - a variant's import may raise anything
                errors.append(f"{name}: {e!r}")
        else:
            raise ImportError(
                "pinshm's remote encoder cache (ec_connector_extra_config 'serve' or 'peers') needs NIXL: "
                "pip install 'pinshm[nixl]' (or nixl-cu12). Tried " + "; ".join(errors)
            )
    return _NIXL


#: How long NIXL's progress thread sleeps between polls, in microseconds.
#: NIXL's Python API sets 0, a thread that spins: a core of the producer's
#: engine core, idle or not. A READ over TCP waits for the producer's
#: progress, so this is added to a READ's time at most once per poll.
PROGRESS_DELAY_US = 200


#: The NIXL agents this process made and has not released, by id, with
#: the pid that made each: held here so that none waits in a reference
#: cycle for the garbage collector, which would run its destructor at any
#: moment, in a forked child too. There, UCX closes connections whose
#: sockets and epoll set the parent shares, and the parent's own teardown
#: of them later aborts it (``uct_tcp_ep_mod_events``: seen in the test
#: suite, an agent of an earlier test collected after a fork). So an agent
#: is destroyed by :func:`release` alone, in the process that made it.
_LIVE: dict[int, tuple[Any, int]] = {}


def _keep_forever(a: Any) -> None:
    """Makes agent `a` immortal: a reference never given back, so neither
    the collector nor the interpreter's exit runs its destructor."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(a))


@atexit.register
def _keep_all_forever() -> None:
    """At exit, every agent not released is made immortal: its destructor
    never runs (a forked child that exits never runs its parent's)."""
    while _LIVE:
        _, (a, _) = _LIVE.popitem()
        _keep_forever(a)


def made_here(a: Any) -> bool:
    """Whether agent `a` is one this process made and has not released (in a
    forked child, its parent's are not: leave their connections alone)."""
    entry = _LIVE.get(id(a))  # two live objects never share an id
    return entry is not None and entry[1] == os.getpid()


def release(owner: Any, attr: str = "_agent", safe: bool = True) -> None:
    """Takes the agent out of ``owner.attr`` (None after) and destroys it
    now, in the process that made it, while its connections are its own.
    It is kept for the life of the process instead where `safe` is False
    (a transfer may still be in flight, or another thread may still use
    it), in a forked child, and where anything else still refers to it
    (its destructor would run whenever that reference goes). Nothing where
    the attribute is None or the agent was released already."""
    a = getattr(owner, attr, None)
    setattr(owner, attr, None)
    entry = _LIVE.pop(id(a), None) if a is not None else None
    if entry is None:
        return
    mine = entry[1] == os.getpid()
    del entry
    # References: `a` here and getrefcount's argument, nothing else.
    if not safe or not mine or sys.getrefcount(a) > 2:
        _keep_forever(a)


def agent(name: str, progress: bool) -> Any:
    """A NIXL agent with the UCX backend, destroyed only through
    :func:`release`. `progress`: with a progress thread (the producer: a
    READ over TCP needs the side read from to make progress), sleeping
    PROGRESS_DELAY_US between polls; without, the agent progresses when its
    transfers are checked (the consumer)."""
    a = _make_agent(name, progress)
    _LIVE[id(a)] = (a, os.getpid())
    return a


@contextlib.contextmanager
def ucx_env(extra: Optional[Mapping[str, str]] = None) -> Iterator[None]:
    """UCX's settings for an agent being made, and only for it: UCX reads
    its transports (``UCX_TLS``) and devices from the environment when an
    agent's backend is made, so they are set for that moment and put back
    after, and the process's other libraries (vLLM's own NIXL connectors)
    never see them. ``UCX_TLS`` becomes :data:`DEFAULT_UCX_TLS` where the
    environment names none; `extra` adds others (a serving process's
    devices). Not a lock: another thread reading the environment at that
    moment sees them."""
    want = {"UCX_TLS": os.environ.get("UCX_TLS") or DEFAULT_UCX_TLS, **(extra or {})}
    before = {k: os.environ.get(k) for k in want}
    os.environ.update(want)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _make_agent(name: str, progress: bool) -> Any:
    api = nixl()
    with ucx_env():
        return _make_in_env(api, name, progress)


def _make_in_env(api: Any, name: str, progress: bool) -> Any:
    cfg = api.nixl_agent_config(enable_prog_thread=progress, backends=["UCX"])
    if not progress:
        return api.nixl_agent(name, cfg)
    bind: Any = getattr(api, "nixlBind", None)
    base: Any = getattr(bind, "nixlAgentConfig", None)
    if base is None or not hasattr(base, "pthrDelay"):
        return api.nixl_agent(name, cfg)  # another API: its own delay

    class _Delayed(base):  # type: ignore[misc]
        """NIXL's agent config, whose progress delay is at least ours."""

        @property
        def pthrDelay(self) -> int:
            return int(base.pthrDelay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            base.pthrDelay.__set__(self, max(int(value), PROGRESS_DELAY_US))

    bind.nixlAgentConfig = _Delayed
    try:
        return api.nixl_agent(name, cfg)
    finally:
        bind.nixlAgentConfig = base
