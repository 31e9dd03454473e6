"""How a pinshm handle travels as vLLM's ``(address, monotonic_id)``.

vLLM passes a handle as ``(address, monotonic_id)``: ``address`` an int in
[0, 2**64), ``monotonic_id`` in [0, 2**32). A pinshm handle is the slot's
offset, a 64-bit id that never repeats in a segment's life, and the
segment's epoch. The wire form is::

    n            = id - 1                         # vLLM counts from 0, pinshm from 1
    address      = (n >> 32) << 48 | offset       # offset < 2**48
    monotonic_id = n & 0xFFFF_FFFF

so the ids vLLM sees are the ones its own store would give (0, 1, 2, ...),
and the full id travels: a reader checks it against the slot, and no
handle reads a later object at the same offset, however many puts a store
sees (vLLM's own ids wrap at 2**31). The epoch does not travel: the
drop-in never hard-clears, so it is constant for a store's life and
readers take it from the segment. Past 2**48 ids (about 9 years at a
million puts a second) ``put`` raises RuntimeError (after storing the
object); rings of 2**48 bytes or more are refused.

Signatures are pinshm's: HMAC-SHA256 keyed by the segment's secret over
SHA-256(key), the offset (u64 LE) and the id's low 32 bits (u32 LE), which
is vLLM 0.33.0's construction over pinshm's own address. They do not
cover the id's high bits: a reader given a signed handle with other high
bits (possible only after 2**32 puts) reads the object with that full id,
if one is still there, whatever its key; the writer's check compares the
whole handle. vLLM's ids wrap at 2**31, with the same exposure. The secret
never leaves Rust, so ``get_auth_secret()`` is not offered.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ..._pinshm import ObjectHandle, ObjectStore, StaleError

OFFSET_BITS = 48
_OFFSET_MASK = (1 << OFFSET_BITS) - 1
_LOW_ID_BITS = 32
_LOW_ID_MASK = (1 << _LOW_ID_BITS) - 1
# Ids whose high bits fit above the offset: 2**48.
MAX_ID = 1 << (_LOW_ID_BITS + 64 - OFFSET_BITS)


def stale(address: Any, monotonic_id: Any) -> StaleError:
    return StaleError(f"Data for address:id '{address}:{monotonic_id}' has been modified or is invalid.")


def to_wire(handle: ObjectHandle) -> tuple[int, int]:
    """The ``(address, monotonic_id)`` vLLM carries for ``handle`` (ids
    from 0, as vLLM's own store counts)."""
    n = handle.monotonic_id - 1
    return (n >> _LOW_ID_BITS) << OFFSET_BITS | handle.address, n & _LOW_ID_MASK


def from_wire(address: Any, monotonic_id: Any, epoch: int) -> ObjectHandle:
    """The handle vLLM's ``(address, monotonic_id)`` stands for; StaleError
    (vLLM's message) for anything that cannot be one."""
    if (
        type(address) is not int
        or type(monotonic_id) is not int
        or not 0 <= address < 1 << 64
        or not 0 <= monotonic_id <= _LOW_ID_MASK
    ):
        raise stale(address, monotonic_id)
    high = address >> OFFSET_BITS
    return ObjectHandle(address & _OFFSET_MASK, (high << _LOW_ID_BITS | monotonic_id) + 1, epoch)


class KeyIndex(Mapping[str, tuple[int, int]]):
    """``key -> (address, monotonic_id)``, live and read-only."""

    def __init__(self, store: ObjectStore):
        self._store = store

    def __getitem__(self, key: str) -> tuple[int, int]:
        h = self._store.lookup(key) if isinstance(key, str) else None
        if h is None:
            raise KeyError(key)
        return to_wire(h)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._store.is_cached(key)

    def __iter__(self) -> Iterator[str]:
        # In the order the keys were put, as vLLM's dict: ids only grow.
        return iter([k for k, _ in sorted(self._store.keys(), key=lambda kh: kh[1].monotonic_id)])

    def __len__(self) -> int:
        return len(self._store)


class IdIndex(Mapping[int, str]):
    """``monotonic_id -> key``, live and read-only (a scan per lookup)."""

    def __init__(self, store: ObjectStore):
        self._store = store

    def _ids(self) -> dict[int, str]:
        return {to_wire(h)[1]: k for k, h in self._store.keys()}

    def __getitem__(self, monotonic_id: int) -> str:
        return self._ids()[monotonic_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids())

    def __len__(self) -> int:
        return len(self._store)
