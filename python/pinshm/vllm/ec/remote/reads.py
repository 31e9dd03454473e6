"""The READ of outputs a consumer claimed from a peer (:mod:`.consumer`'s
fetching thread): a slot reserved for each, one NIXL READ of all of them
into the fetch process's staging buffer (as many at a time as it holds),
then each copied into its slot and hashed in one pass, and published only
if its digest is the producer's; then the producer's leases end, their
answer not waited for. `tier` is the consumer's ``RemoteTier`` (its store,
its fetch process, its clock and counters)."""

from __future__ import annotations

import hmac
import logging
from typing import Any, Callable, Optional

from ...._pinshm import PinshmError
from .peers import Peer
from .protocol import PeerError, Place, copy_digest

logger = logging.getLogger("vllm.pinshm.ec")

#: Tests' hooks, called in the fetching thread with the batch's keys just
#: before a READ (to kill the peer) and between a READ and its check (to
#: reuse the slot or write into staging).
before_read: Optional[Callable[[str], None]] = None
after_read: Optional[Callable[[str], None]] = None


def read(tier: Any, peer: Peer, claims: list[tuple[str, Place]], deadline: float) -> set[str]:
    """READs `claims` from `peer` into slots of the store, each published
    if its digest matches; the keys published."""
    assert tier.store is not None and tier.fetcher is not None
    now = tier.clock()
    got: set[str] = set()
    reserved: list[tuple[str, Place, Any]] = []
    try:
        for key, place in claims:
            try:
                reserved.append((key, place, tier.store.reserve_tensor(key, place.dtype, list(place.shape))))
            except (PinshmError, MemoryError, ValueError) as e:  # full, too large, being fetched
                logger.debug("pinshm encoder cache: no slot for %s: %r", key, e)
        # As many at a time as the staging buffer holds: one READ each.
        for group in _groups(reserved, tier.fetcher.capacity):
            got |= _read_group(tier, peer, group, deadline)
    finally:
        for key, _, res in reserved:
            if key not in got:
                tier.store.abort(res)
        tier.end_leases(peer, [place.lease for _, place in claims], now)
    return got


def _read_group(tier: Any, peer: Peer, group: list[tuple[str, Place, Any]], deadline: float) -> set[str]:
    assert tier.store is not None and tier.fetcher is not None
    keys = [key for key, _, _ in group]
    parts, at = [], 0
    for _, place, _ in group:
        parts.append([peer.base + place.offset, place.nbytes, at])
        at += place.nbytes
    if before_read is not None:
        before_read(keys[0])
    left = deadline - tier.clock()
    try:
        msg = {"op": "read", "name": peer.agent_name, "parts": parts, "timeout": max(0.0, left)}
        state = tier.fetcher.ask(msg, max(0.0, left))["state"]
    except PeerError as e:
        tier.failed(peer, str(e), close=False)
        return set()
    if state != "DONE":
        tier.failed(peer, "READ " + ("failed" if state == "ERR" else "not done in time"), close=False)
        return set()
    if after_read is not None:
        after_read(keys[0])
    got: set[str] = set()
    staging = memoryview(tier.fetcher.staging)
    try:
        for (key, place, res), (_, nbytes, start) in zip(group, parts):
            # The slot keeps only the bytes the producer's digest names.
            if hmac.compare_digest(copy_digest(res, staging[start : start + nbytes]), place.digest):
                tier.store.publish(res)
                got.add(key)
            else:
                tier.corrupt += 1
                logger.warning(
                    "pinshm encoder cache: the bytes of %s read from %s are not the ones its digest names: a miss",
                    key,
                    peer.address,
                )
    finally:
        staging.release()
    tier.fetched += len(got)
    if got and not peer.fetched:
        logger.info("pinshm encoder cache: first output fetched from peer %s", peer.address)
    peer.fetched += len(got)
    return got


def _groups(items: list[tuple[str, Place, Any]], capacity: int) -> list[list[tuple[str, Place, Any]]]:
    """`items` in runs whose bytes fit `capacity` together, in order."""
    groups: list[list[tuple[str, Place, Any]]] = []
    used = capacity
    for item in items:
        if used + item[1].nbytes > capacity:
            groups.append([])
            used = 0
        groups[-1].append(item)
        used += item[1].nbytes
    return groups
