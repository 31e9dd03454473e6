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
from ...._pinshm import _Digest as Digest
from .fetcher import FetcherError
from .peers import Peer
from .protocol import PeerError, Place

logger = logging.getLogger("vllm.pinshm.ec")

#: Bytes of one READ: an output's bytes are copied and hashed while the
#: READ of the next chunk runs (the fetch process serves the next request
#: meanwhile), so a large output costs about its READ, not its READ and
#: then its check.
PIPELINE_BYTES = 2 << 20
#: Tests' hooks, called in the fetching thread with an output's key just
#: before a group's first READ (to kill the peer) and between each READ
#: and its check (to reuse the slot or write into staging).
before_read: Optional[Callable[[str], None]] = None
after_read: Optional[Callable[[str], None]] = None


def read(tier: Any, peer: Peer, claims: list[tuple[str, Place]], deadline: float) -> set[str]:
    """READs `claims` from `peer` into slots of the store, each published
    if its digest matches; the keys published."""
    assert tier.store is not None and tier.fetcher is not None
    now = tier.clock()
    got: set[str] = set()
    if not tier.ready(peer):  # its agent is gone (a new hello is on the way): misses
        tier.end_leases(peer, [place.lease for _, place in claims], now)
        return got
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
    """READs `group` (outputs that fit the staging buffer together) in
    chunks of PIPELINE_BYTES, each chunk's READ running while the one
    before is copied into its slots and hashed; publishes those whose
    digest is the producer's."""
    assert tier.store is not None and tier.fetcher is not None
    chunks = _chunks([place for _, place, _ in group], peer.base, PIPELINE_BYTES)
    if before_read is not None:
        before_read(group[0][0])
    digests = [Digest() for _ in group]
    slots = [memoryview(res) for _, _, res in group]
    staging = memoryview(tier.fetcher.staging)
    posted = 0  # READs posted whose answer is not taken yet
    try:
        _post(tier, peer, chunks[0], deadline)
        posted = 1
        for k, chunk in enumerate(chunks):
            posted = 0  # take() consumes its answer, or stops the fetch process
            state = tier.fetcher.take(max(0.0, deadline - tier.clock()))["state"]
            if state != "DONE":
                raise PeerError("READ " + ("failed" if state == "ERR" else "not done in time"))
            if k + 1 < len(chunks):
                _post(tier, peer, chunks[k + 1], deadline)
                posted = 1
            if after_read is not None:
                after_read(group[chunk[0][0]][0])
            for i, at_item, nbytes, at, _ in chunk:
                # The slot keeps only the bytes the producer's digest names.
                digests[i].copy_update(slots[i][at_item : at_item + nbytes], staging[at : at + nbytes])
    except FetcherError:
        return set()  # this node's fetch process, not the peer: it starts again
    except PeerError as e:
        tier.failed(peer, str(e), close=False)
        return set()
    finally:
        if posted:  # the next READ's answer, so that the next ask reads its own
            try:
                tier.fetcher.take(max(0.0, deadline - tier.clock()))
            except PeerError:
                pass
        for view in slots:
            view.release()  # no export of a reservation is alive at publish
        staging.release()
    got: set[str] = set()
    for (key, place, res), digest in zip(group, digests):
        if hmac.compare_digest(digest.finish(), place.digest):
            tier.store.publish(res)
            got.add(key)
        else:
            tier.corrupt += 1
            logger.warning(
                "pinshm encoder cache: the bytes of %s read from %s are not the ones its digest names: a miss",
                key,
                peer.address,
            )
    tier.fetched += len(got)
    if got and not peer.fetched:
        logger.info("pinshm encoder cache: first output fetched from peer %s", peer.address)
    peer.fetched += len(got)
    return got


def _post(tier: Any, peer: Peer, chunk: list[tuple[int, int, int, int, int]], deadline: float) -> None:
    left = max(0.0, deadline - tier.clock())
    parts = [[addr, nbytes, at] for _, _, nbytes, at, addr in chunk]
    tier.fetcher.post({"op": "read", "name": peer.agent_name, "parts": parts, "timeout": left}, left)


def _chunks(places: list[Place], base: int, size: int) -> list[list[tuple[int, int, int, int, int]]]:
    """The outputs of `places`, laid end to end in the staging buffer, cut
    into READs of at most `size` bytes: each a list of pieces (output's
    index, offset in the output, bytes, offset in staging, address at the
    peer)."""
    chunks: list[list[tuple[int, int, int, int, int]]] = [[]]
    room, at = size, 0
    for i, place in enumerate(places):
        done = 0
        while done < place.nbytes:
            if room == 0:
                chunks.append([])
                room = size
            n = min(room, place.nbytes - done)
            chunks[-1].append((i, done, n, at, base + place.offset + done))
            done += n
            at += n
            room -= n
    return chunks


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
