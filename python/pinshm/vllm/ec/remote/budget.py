"""Who may hold how many of a producer's leases (:mod:`.producer`). A leaf.

A lease pins an object in the served store until its peer says done or
its TTL passes, so leases are a pool that one peer must not drain. A
connection holds at most :data:`PEER_LEASES`; the connections of one
address group together at most :data:`GROUP_LEASES`, and never more than
an equal share of the pool among the groups holding leases. A group is an
IPv4 address, or an IPv6 /64 (one host gets a whole /64 as easily as one
address: 64 addresses of it are one group).

The pool is never closed to a newcomer: where it is full, a group holding
less than its share takes one lease back from the group most over its own
(the oldest of that group's, ended as its TTL would end it: the peer that
held it reads a miss, never a wrong answer, for the consumer checks the
digest and the producer re-checks the handle at done).
"""

from __future__ import annotations

import ipaddress
from typing import Any, Optional

#: Leases out at once, all peers together; a connection's; an address
#: group's (the most, before the pool's share).
MAX_LEASES = 4096
PEER_LEASES = 64
GROUP_LEASES = 512


def group_of(addr: str) -> str:
    """The group of peer address `addr`: an IPv4 address as it is (an
    IPv4-mapped IPv6 one too), an IPv6 address's /64, anything else (a
    name, "?") as it is."""
    try:
        ip = ipaddress.ip_address(addr.split("%")[0].strip("[]"))
    except ValueError:
        return addr
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{ip}/64", strict=False))
    return str(ip)


class Budget:
    """The leases each connection and group holds, and whether one more may
    be granted."""

    def __init__(self, total: int = MAX_LEASES, per_peer: int = PEER_LEASES, per_group: int = GROUP_LEASES):
        self.total, self.per_peer, self.per_group = total, per_peer, per_group
        self.held = 0
        self.by_peer: dict[bytes, int] = {}
        self.by_group: dict[str, int] = {}

    def share(self, group: str) -> int:
        """The most `group` may hold now: an equal part of the pool among
        the groups holding leases (it counted among them)."""
        n = len(self.by_group) + (0 if group in self.by_group else 1)
        return max(1, min(self.per_group, self.total // n))

    def admit(self, peer: bytes, group: str) -> tuple[bool, Optional[str]]:
        """Whether `peer` (of `group`) may take one more lease, and where
        the pool is full, the group to take one back from first."""
        if self.by_peer.get(peer, 0) >= self.per_peer:
            return False, None
        share = self.share(group)
        if self.by_group.get(group, 0) >= share:
            return False, None
        if self.held < self.total:
            return True, None
        others = [(n, g) for g, n in self.by_group.items() if g != group]
        if not others:
            return False, None
        n, victim = max(others)
        # Its share with `group` among the holders (as `share` counts).
        if n > share:
            return True, victim
        return False, None

    def add(self, peer: bytes, group: str) -> None:
        self.held += 1
        self.by_peer[peer] = self.by_peer.get(peer, 0) + 1
        self.by_group[group] = self.by_group.get(group, 0) + 1

    def remove(self, peer: bytes, group: str) -> None:
        self.held = max(0, self.held - 1)
        _less(self.by_peer, peer)
        _less(self.by_group, group)

    def clear(self) -> None:
        self.held = 0
        self.by_peer.clear()
        self.by_group.clear()


def _less(counts: dict[Any, int], who: Any) -> None:
    """One fewer for `who` (gone at none)."""
    left = counts.get(who, 1) - 1
    if left > 0:
        counts[who] = left
    else:
        counts.pop(who, None)
