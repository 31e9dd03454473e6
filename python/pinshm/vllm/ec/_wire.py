"""The remote tier's control messages (docs/remote.md), and NIXL, loaded
lazily. A leaf: no store, no vLLM.

Every message is one msgpack map. A consumer asks, a producer answers:

- ``{"op": "hello"}`` → ``{"v", "agent", "meta", "base", "length", "gen"}``:
  the protocol's version (:data:`VERSION`), the producer's NIXL agent (name
  and metadata) and its registration of the store's data region (address
  and length in the serving process's read-only mapping; `gen` changes
  when it registers another segment, or the serving process restarts);
- ``{"op": "lookup", "key"}`` → ``{"found": False}`` or ``{"found": True,
  "lease", "offset", "nbytes", "dtype", "shape", "id", "epoch", "gen"}``:
  the tensor's elements lie at `offset` in the region, held by `lease`
  (random bytes, bound to the asking connection) until done or the
  producer's TTL; `digest` is their SHA-256, taken by the producer's
  scheduler: the consumer publishes what it read only if it matches;
- ``{"op": "done", "lease"}`` → ``{"stable": bool}``: whether the slot still
  held the same object (id and tag re-checked) after the READ; the lease
  ends.

Messages travel only over ZeroMQ connections authenticated and encrypted
with keys derived from the deployment's secret (:mod:`._secret`), unless
the config says ``insecure``. Even so, nothing a peer sends is trusted:
:func:`check_place` checks a lookup's answer against the region and the
consumer's own limits.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import math
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

#: Element sizes of the dtypes an encoder output may have (torch's names,
#: as `reserve_tensor` takes them).
ITEMSIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
MAX_DIMS = 8
#: The largest message a peer may send (a hello carries NIXL's metadata).
MAX_MESSAGE = 1 << 20
#: The messages' version, in a hello's answer: 2 has random lease ids, 3
#: a lookup's digest of the elements.
VERSION = 3
#: A digest's bytes (SHA-256, hashlib's: the CPU's SHA instructions where
#: it has them, x86's SHA-NI and Arm's crypto extensions).
DIGEST_BYTES = 32
#: A lease id's bytes (random: unguessable, so one peer cannot name another's).
LEASE_BYTES = 16
#: UCX's transports where the environment names none: TCP, on hosts
#: without RDMA as on this project's machines. Set for pinshm's own agents
#: only (:func:`ucx_env`), never in the environment other libraries read.
DEFAULT_UCX_TLS = "tcp"


class PeerError(Exception):
    """A peer that did not answer in time, or answered what it may not."""


def _msgpack() -> Any:
    import msgpack  # type: ignore[import-untyped]  # ships no type information

    return msgpack


def pack(msg: dict[str, Any]) -> bytes:
    return bytes(_msgpack().packb(msg, use_bin_type=True))


def unpack(data: bytes) -> dict[str, Any]:
    """A message from a peer: PeerError for anything but a msgpack map."""
    if len(data) > MAX_MESSAGE:
        raise PeerError(f"a message of {len(data)} bytes (at most {MAX_MESSAGE})")
    try:
        msg = _msgpack().unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - whatever garbage raises
        raise PeerError(f"not a message: {e!r}") from None
    if not isinstance(msg, dict):
        raise PeerError(f"not a map: {type(msg).__name__}")
    return msg


def field(msg: dict[str, Any], name: str, kind: type) -> Any:
    """`msg[name]`, which must be a `kind` (PeerError if not)."""
    value = msg.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise PeerError(f"field {name!r} is {type(value).__name__}, not {kind.__name__}")
    return value


@dataclass(frozen=True)
class Place:
    """Where a producer says an output's elements are, checked."""

    lease: bytes
    digest: bytes
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    gen: int


def check_place(msg: dict[str, Any], region: int, max_bytes: int) -> Place:
    """The place a lookup's answer names, checked against the region's
    length (`region`) and the most this node takes (`max_bytes`):
    PeerError for anything off (a malformed or lying peer is a miss)."""
    lease = field(msg, "lease", bytes)
    if len(lease) != LEASE_BYTES:
        raise PeerError(f"a lease id of {len(lease)} bytes")
    sums = field(msg, "digest", bytes)
    if len(sums) != DIGEST_BYTES:
        raise PeerError(f"a digest of {len(sums)} bytes")
    offset = field(msg, "offset", int)
    nbytes = field(msg, "nbytes", int)
    dtype = field(msg, "dtype", str)
    shape_value = field(msg, "shape", list)
    gen = field(msg, "gen", int)
    if dtype not in ITEMSIZE:
        raise PeerError(f"dtype {dtype!r} is not one an encoder output has")
    if not 0 < len(shape_value) <= MAX_DIMS or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 < d < 1 << 40 for d in shape_value
    ):
        raise PeerError(f"shape {shape_value!r} is not a tensor's")
    shape = tuple(shape_value)
    if nbytes != math.prod(shape) * ITEMSIZE[dtype]:
        raise PeerError(f"{nbytes} bytes is not a {dtype} tensor of shape {shape}")
    if nbytes > max_bytes:
        raise PeerError(f"an output of {nbytes} bytes (this node takes at most {max_bytes})")
    if offset < 0 or offset + nbytes > region:
        raise PeerError(f"bytes {offset}..{offset + nbytes} lie outside the region of {region}")
    return Place(lease, sums, offset, nbytes, dtype, shape, gen)


def digest(data: Any) -> bytes:
    """The digest of a tensor's elements (any C-contiguous buffer)."""
    import hashlib

    return hashlib.sha256(data).digest()


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
