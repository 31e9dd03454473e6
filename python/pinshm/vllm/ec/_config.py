"""The connector's settings, read from vLLM's ``ec_connector_extra_config``.

A leaf: no vLLM, no torch, no store. The connector reads the dict vLLM
hands it; the tests build settings straight from a dict.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from ..._node import budget as _budget
from ..._pinshm import ObjectStore

#: The store the engines of a node share when none is named, followed by
#: ``.u<uid>`` (the engines' effective uid: :func:`default_store`), so that
#: two users of one host never meet under one name.
DEFAULT_STORE = "pinshm_ec"


def default_store() -> str:
    """The store's name when the config names none: ``pinshm_ec.u<euid>``."""
    return f"{DEFAULT_STORE}.u{os.geteuid()}"


#: Bytes of the store when no size is given: a sparse segment, so this is
#: what it may grow to, not what it takes at start.
DEFAULT_SIZE = 1 << 30
#: The least a reserved store's default size may be (its /dev/shm is too
#: small below this: an error at start).
MIN_RESERVED = 4 << 20
#: Reader entries: each engine that reads takes one for its scheduler and
#: one per worker of its first pipeline stage (TP rank), so two TP=8
#: engines need 18. The default: seven TP=8 engines, or 32 TP=1 engines,
#: each with its entries; a store has at most 1024 (the crate's
#: ``StoreConfig::MAX_READERS``). An entry costs 12 bytes in each slot's
#: header (under 1 % of a 98 KiB output at 64).
MAX_READERS = ObjectStore.MAX_READERS
DEFAULT_READERS = 64
#: Average output size the default key index is sized for (an image of 64
#: tokens of width 256 in bf16; real encoders' are larger): an index with
#: room for ``size // this`` keys (within the bounds below).
INDEX_BYTES_PER_KEY = 32 << 10
MIN_INDEX_KEYS = 64
MAX_INDEX_KEYS = 1 << 20

KNOWN_KEYS = frozenset(
    {"store", "size", "n_readers", "key_index", "max_object_size", "key_prefix", "shm_headroom", "retry_s", "reserve"}
    | {"serve", "peers", "remote_store", "remote_size", "remote_timeout_s", "lease_ttl_s", "peer_backoff_s"}
    | {"secret_file", "insecure"}
)
#: Names the remote tier's secret file where the config has no
#: ``secret_file`` (as in :mod:`._secret`, which this leaf does not import).
SECRET_FILE_ENV = "PINSHM_EC_SECRET_FILE"
#: The remote tier's defaults (docs/remote.md): the most a lookup waits on
#: the peers in all, a producer's lease on what a consumer READs, and how
#: long a peer that failed is left alone.
REMOTE_TIMEOUT_S = 1.0
LEASE_TTL_S = 10.0
PEER_BACKOFF_S = 5.0

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def does_not_fit(key: str, size: int, store: str, stores: int = 1) -> str:
    """What an engine whose reserved store (`key` of the config: ``size``,
    ``remote_size``) of `size` bytes does not fit in /dev/shm is told
    (`stores`: the reserved stores of the engine, sharing /dev/shm)."""
    shm, free = _budget.shm_size(), _budget.shm_free()
    fits = _budget.reserved_store(shm, stores) if shm is not None else 0
    return (
        f"pinshm encoder cache: store {store!r} is reserved whole at start ('serve' or 'reserve') and "
        f"{key} {_human(size)} does not fit in /dev/shm ({(free or 0) >> 20} MiB free of {(shm or 0) >> 20} MiB): "
        f"set ec_connector_extra_config '{key}' to at most {fits >> 20}m (leaving the headroom other "
        f"segments need), or leave it out (the default takes what is free), or give the engine a larger /dev/shm"
    )


def default_reserved(size: int) -> int:
    """A default-sized reserved store's capacity now: `size`, or less where
    /dev/shm has less free (after the headroom the node's other segments
    need): other engines' segments may have taken some since the default
    was worked out from /dev/shm's size."""
    shm, free = _budget.shm_size(), _budget.shm_free()
    if shm is None or free is None:
        return size
    return min(size, max(0, free - _budget.cache_headroom(shm)) // (1 << 20) * (1 << 20))


def parse_size(value: object, what: str = "size", allow_zero: bool = False) -> int:
    """Bytes from an int or a string such as ``"256m"``, ``"1g"``,
    ``"1.5GiB"`` or ``"4096"`` (units are powers of 1024). ValueError,
    naming `what`, for anything else or for a size that is not positive
    (or negative, with `allow_zero`)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a byte count (an int, or a string like '256m'), not {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"{what} must be a byte count (an int, or a string like '256m'), not {value!r}")
    if n < 0 or (n == 0 and not allow_zero):
        raise ValueError(f"{what} must be positive, not {value!r}")
    return n


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{what} must be a positive int, not {value!r}")
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{what} must be a positive int, not {value!r}") from None
    if n <= 0:
        raise ValueError(f"{what} must be a positive int, not {value!r}")
    return n


def model_fingerprint(model: object, revision: object = None) -> str:
    """A short tag of the model whose encoder made an output. vLLM's
    ``mm_hash`` names the input (the image and its processing), not the
    encoder; two engines of a node that serve different models must not
    load each other's outputs, so keys carry this tag."""
    return hashlib.sha256(f"{model}|{revision}".encode()).hexdigest()[:12]


@dataclass(frozen=True)
class ECSettings:
    """What ``ec_connector_extra_config`` says, with the defaults filled in.

    - ``store``: the segment's name (``/dev/shm/<store>``; default
      ``pinshm_ec.u<uid>``, the engines' user's), shared by the engines of
      a node: a producer (``ec_producer``, ``ec_both``) writes
      it, a consumer attaches to it.
    - ``size``: the store's capacity in bytes (an int, or ``"256m"``,
      ``"1g"``; default 1 GiB); sparse, so memory is what the outputs touch.
      A reserved store's default (``serve``, ``reserve``) is what /dev/shm
      holds after the headroom other segments need, at most 1 GiB (760 MiB
      of a 1 GiB /dev/shm, 40 MiB of 64 MiB; half that each where
      ``peers`` reserve the store of fetched outputs too); an explicit
      size that does not fit stops the engine at start, naming the most
      that does.
    - ``n_readers``: reader entries (scheduler and workers of every engine
      that reads; default 64, at most 1024).
    - ``key_index``: keys the shared index has room for (default: one per
      32 KiB of ``size``, 64 to 2^20).
    - ``max_object_size``: the largest output saved (None: what fits).
    - ``key_prefix``: put before each ``mm_hash`` (default: the model's
      fingerprint and a colon).
    - ``shm_headroom``: free bytes of /dev/shm the sparse store leaves to
      others (None: the cache drop-in's default).
    - ``retry_s``: how often a scheduler retries attaching a store that is
      not there yet, and checks that its store is still the named one.
    - ``reserve``: the writer reserves the whole store at creation (a
      full /dev/shm fails then), and, with a CUDA driver, pre-faults it:
      its mapping and the workers' are pinned: saves and loads are DMA
      from and into the slots. Default: sparse, unpinned; with ``serve``,
      always reserved. ``remote_store`` follows it (its writer, the engine
      core, never pins its own mapping).
    - ``serve``: ``"HOST:PORT"``: this engine's scheduler serves the
      node's store to other nodes (a NIXL agent and a ZMQ endpoint there).
    - ``peers``: ``["HOST:PORT", ...]``: producers of other nodes that a
      consumer asks on a local miss; what it fetches lands in
      ``remote_store`` (default ``<store>_remote``, ``remote_size`` bytes,
      default ``size``), a store of this node its first consumer writes.
    - ``remote_timeout_s``: the most one lookup waits on the peers in all;
      ``peer_backoff_s``: how long a peer that failed is skipped;
      ``lease_ttl_s``: how long a producer holds what a consumer READs.
    - ``secret_file``: the remote tier's shared secret (a file of at least
      32 random bytes, mode 0600 or 0400, owned by the engine's user;
      default: the file ``PINSHM_EC_SECRET_FILE`` names). ``serve`` and
      ``peers`` refuse to start without one, unless ``insecure`` is true
      (a trusted lab network: no authentication, a WARNING at every start).
      docs/security.md.
    """

    store: str = field(default_factory=default_store)
    size: int = DEFAULT_SIZE
    n_readers: int = DEFAULT_READERS
    key_index: int = MIN_INDEX_KEYS
    max_object_size: Optional[int] = None
    key_prefix: str = ""
    shm_headroom: Optional[int] = None
    retry_s: float = 1.0
    reserve: bool = False
    #: Whether ``size`` (``remote_size``) was given, not a default.
    size_given: bool = False
    remote_size_given: bool = False
    serve: Optional[tuple[str, int]] = None
    peers: tuple[tuple[str, int], ...] = ()
    remote_store: str = ""
    remote_size: int = DEFAULT_SIZE
    remote_timeout_s: float = REMOTE_TIMEOUT_S
    lease_ttl_s: float = LEASE_TTL_S
    peer_backoff_s: float = PEER_BACKOFF_S
    secret_file: Optional[str] = None
    insecure: bool = False

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]], fingerprint: str = "") -> ECSettings:
        """Settings from the extra config dict. ValueError on a value that
        is not what its key takes; unknown keys are returned by
        :func:`unknown_keys` for the caller to warn about."""
        extra = dict(extra or {})
        store = str(extra.get("store") or default_store()).lstrip("/")
        if not store or "/" in store or len(store) > 200:
            raise ValueError(f"store must be a name for /dev/shm (no '/'), not {extra.get('store')!r}")
        explicit_size = extra.get("size") is not None
        size = parse_size(extra["size"], "size") if explicit_size else DEFAULT_SIZE
        n_readers = _count(extra.get("n_readers", DEFAULT_READERS), "n_readers")
        if n_readers > MAX_READERS:
            raise ValueError(f"n_readers must be at most {MAX_READERS} (a segment's reader table), not {n_readers}")
        if "key_index" in extra:
            key_index = _count(extra["key_index"], "key_index")
        else:
            key_index = min(MAX_INDEX_KEYS, max(MIN_INDEX_KEYS, size // INDEX_BYTES_PER_KEY))
        max_object = extra.get("max_object_size")
        max_object_size = None if max_object is None else parse_size(max_object, "max_object_size")
        prefix = extra.get("key_prefix")
        key_prefix = f"{fingerprint}:" if prefix is None and fingerprint else str(prefix or "")
        headroom = extra.get("shm_headroom")
        shm_headroom = None if headroom is None else parse_size(headroom, "shm_headroom", allow_zero=True)
        retry = extra.get("retry_s", 1.0)
        if isinstance(retry, bool) or not isinstance(retry, (int, float)) or retry < 0:
            raise ValueError(f"retry_s must be a number of seconds >= 0, not {retry!r}")
        reserve = _flag(extra, "reserve")
        insecure = _flag(extra, "insecure")
        if extra.get("serve") not in (None, ""):
            # A served store is reserved whole at creation: a READ of a hole
            # of a sparse one (any peer, or anyone who reaches UCX's port
            # over TCP) would make the kernel allocate it, /dev/shm past
            # every headroom (docs/security.md).
            reserve = True
        serve = None if extra.get("serve") in (None, "") else parse_address(extra["serve"], "serve")
        peers_value = extra.get("peers") or []
        if isinstance(peers_value, str):
            peers_value = [p for p in peers_value.split(",") if p.strip()]
        if not isinstance(peers_value, (list, tuple)):
            raise ValueError(f"peers must be a list of 'HOST:PORT', not {peers_value!r}")
        peers = tuple(parse_address(p, "peers") for p in peers_value)
        if reserve and not explicit_size:
            # Reserved whole at start: the default is what /dev/shm holds
            # after the headroom the node's other segments need (and half
            # of it each where the store of fetched outputs is reserved too).
            shm = _budget.shm_size()
            if shm is not None:
                size = min(DEFAULT_SIZE, _budget.reserved_store(shm, 2 if peers else 1))
                if size < MIN_RESERVED:
                    raise ValueError(
                        f"a reserved store needs /dev/shm room: this one's {shm >> 20} MiB leaves "
                        f"{size >> 20} MiB after the headroom other segments need; give the engine a larger "
                        "/dev/shm (docker --shm-size), or set 'size' and PINSHM_VLLM_SHM_HEADROOM"
                    )
            if "key_index" not in extra:
                key_index = min(MAX_INDEX_KEYS, max(MIN_INDEX_KEYS, size // INDEX_BYTES_PER_KEY))
        remote_store = str(extra.get("remote_store") or f"{store}_remote").lstrip("/")
        if "/" in remote_store or len(remote_store) > 200 or remote_store == store:
            raise ValueError(f"remote_store must be a name for /dev/shm other than store, not {remote_store!r}")
        remote_size = parse_size(extra.get("remote_size", size), "remote_size")
        secret = extra.get("secret_file") or os.environ.get(SECRET_FILE_ENV) or None
        if secret is not None and not isinstance(secret, str):
            raise ValueError(f"secret_file must be a path, not {secret!r}")
        if (serve is not None or peers) and secret is None and not insecure:
            raise ValueError(
                f"{'serve' if serve is not None else 'peers'} needs a shared secret: set ec_connector_extra_config "
                f"'secret_file' (or {SECRET_FILE_ENV}) to a file of 32 random bytes that only the engine's user "
                "reads (head -c 32 /dev/urandom > F; chmod 600 F), the same file on every node. "
                "('insecure': true serves without one, on a trusted lab network only: docs/security.md)"
            )
        return cls(
            secret_file=secret,
            insecure=insecure,
            serve=serve,
            peers=peers,
            remote_store=remote_store,
            remote_size=remote_size,
            remote_timeout_s=_seconds(extra, "remote_timeout_s", REMOTE_TIMEOUT_S),
            lease_ttl_s=_seconds(extra, "lease_ttl_s", LEASE_TTL_S),
            peer_backoff_s=_seconds(extra, "peer_backoff_s", PEER_BACKOFF_S),
            store=store,
            size=size,
            n_readers=n_readers,
            key_index=key_index,
            max_object_size=max_object_size,
            key_prefix=key_prefix,
            shm_headroom=shm_headroom,
            retry_s=float(retry),
            reserve=reserve,
            size_given=explicit_size,
            remote_size_given=extra.get("remote_size") is not None or explicit_size,
        )

    def key(self, mm_hash: str) -> str:
        """The store key of an encoder output."""
        return self.key_prefix + mm_hash

    def describe(self) -> str:
        kind = "reserved" if self.reserve else "sparse"
        return (
            f"store {self.store!r}, {_human(self.size)} {kind}, {self.n_readers} readers, "
            f"index of {self.key_index} keys"
        )


def parse_address(value: object, what: str) -> tuple[str, int]:
    """``(host, port)`` from ``"HOST:PORT"``; ValueError naming `what`."""
    text = str(value).strip()
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} takes 'HOST:PORT' addresses, not {value!r}")
    return host.strip("[]"), int(port)


def _flag(extra: Mapping[str, Any], key: str) -> bool:
    value = extra.get(key, False)
    if isinstance(value, str):
        value = value.strip().lower() in ("1", "true", "yes")
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, not {value!r}")
    return value


def _seconds(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{key} must be a number of seconds >= 0, not {value!r}")
    return float(value)


def unknown_keys(extra: Optional[Mapping[str, Any]]) -> list[str]:
    """Keys of the extra config this connector does not read (typos)."""
    return sorted(k for k in (extra or {}) if k not in KNOWN_KEYS)


def _human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << (shift - 4)) == 0:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} B"
