"""The remote tier's control messages (docs/remote.md). A leaf: no store,
no vLLM, no NIXL.

Every message is one msgpack map. A consumer asks, a producer answers:

- ``{"op": "hello"}`` → ``{"v", "agent", "meta", "base", "length", "gen"}``:
  the protocol's version (:data:`VERSION`), the producer's NIXL agent (name
  and metadata) and its registration of the store's data region (address
  and length in the NIXL process's read-only mapping; `gen` changes when
  it registers another segment, or that process restarts);
- ``{"op": "lookup", "keys": [key, ...]}`` (at most :data:`MAX_KEYS`: a
  request's items, one round trip) → ``{"found": [place or None, ...]}``,
  one entry per key, a place being ``{"lease", "digest", "offset",
  "nbytes", "dtype", "shape", "id", "epoch", "gen"}``: the tensor's
  elements lie at `offset` in the region, held by `lease` (random bytes,
  bound to the asking connection) until done or the producer's TTL;
  `digest` is their BLAKE3 digest, taken once per object by the
  producer's scheduler from its own reader: the consumer publishes what
  it read only if it matches;
- ``{"op": "done", "leases": [lease, ...]}`` → ``{"stable": [bool, ...]}``:
  the leases end (whether each slot still held the same object is said,
  for the producer's counts). The consumer sends it after its READ and
  does not wait for the answer: the digest, not the re-check, proves the
  bytes (a slot reused mid-READ gives bytes that do not match it).

Requests carry a request id as a frame of their envelope (ZeroMQ DEALER
to ROUTER), which the answer echoes: a late answer is matched to its
request or dropped, never taken for another's.

Messages travel only over ZeroMQ connections authenticated and encrypted
with keys derived from the deployment's secret (:mod:`.keys`), unless
the config says ``insecure``. Even so, nothing a peer sends is trusted:
:func:`check_place` checks a lookup's answer against the region and the
consumer's own limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

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
#: The most keys one lookup names (a request's items; a request with
#: more is looked up in several).
MAX_KEYS = 64
#: Keys, lease ids and the like that a peer sends are at most this long.
MAX_KEY = 1024
#: The messages' version, in a hello's answer: 2 has random lease ids, 3
#: a lookup's digest of the elements, 4 lookups and dones of many keys
#: and BLAKE3 digests.
VERSION = 4
#: A digest's bytes (BLAKE3, pinshm's native code: SIMD, the GIL released).
DIGEST_BYTES = 32
#: A lease id's bytes (random: unguessable, so one peer cannot name another's).
LEASE_BYTES = 16


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
    from ...._pinshm import _digest

    return _digest(data)
