"""The producer's lease budget (pinshm.vllm.ec.remote.budget): no set of
addresses one peer can hold (an IPv6 /64, a handful or a thousand IPv4
addresses, arriving at once or one after another) takes the pool; a
newcomer is always admitted, taking a lease back from the group most over
its share where the pool is full. Pure bookkeeping here; the real serving
process with 16 loopback addresses: test_ec_security.py."""

import ipaddress

import pytest

from pinshm.vllm.ec.remote.budget import GROUP_LEASES, MAX_LEASES, PEER_LEASES, Budget, group_of


def take(b, peer, group):
    """One lease for `peer` of `group` if admitted (ending one of the
    victim group's, as the producer does); whether it got one."""
    ok, victim = b.admit(peer, group)
    if ok:
        if victim is not None:
            b.remove(next(p for p in b.by_peer if b.groups[p] == victim), victim)
        b.add(peer, group)
        b.groups[peer] = group
    return ok


def budget():
    b = Budget()
    b.groups = {}  # each connection's group, for take's victims
    return b


def greedy(b, addrs, conns_per_addr=64):
    """Leases taken by the connections of `addrs`, round robin, until none
    is admitted."""
    while True:
        progress = False
        for a in addrs:
            g = group_of(a)
            progress |= any(take(b, f"{a}/{c}".encode(), g) for c in range(conns_per_addr))
        if not progress:
            return


def newcomer_gets(b, addr="198.51.100.7", want=PEER_LEASES):
    """How many of `want` leases a newcomer gets."""
    g = group_of(addr)
    return sum(1 for _ in range(want) if take(b, b"newcomer", g))


def test_an_ipv6_slash_64_is_one_group():
    net = ipaddress.IPv6Network("2001:db8:1:2::/64")
    addrs = [str(net[i * 7919 + 1]) for i in range(64)]
    assert len({group_of(a) for a in addrs}) == 1
    assert group_of("::ffff:192.0.2.1") == "192.0.2.1"
    b = budget()
    greedy(b, addrs)
    assert b.by_group[group_of(addrs[0])] == GROUP_LEASES, "64 addresses of one /64: one group's leases"
    assert newcomer_gets(b) == PEER_LEASES


@pytest.mark.parametrize("n", [16, 64, 1000])
def test_many_ipv4_addresses_never_shut_a_newcomer_out(n):
    addrs = [str(ipaddress.IPv4Address("10.0.0.1") + i) for i in range(n)]
    b = budget()
    greedy(b, addrs, conns_per_addr=8)
    assert b.held <= MAX_LEASES
    assert newcomer_gets(b) == min(PEER_LEASES, MAX_LEASES // (n + 1)), "a newcomer's share"


def test_groups_arriving_one_after_another_cannot_fill_the_pool_for_good():
    # Each group takes its share when it arrives (larger when few hold):
    # eight of them fill the pool; the ninth is still admitted.
    b = budget()
    for i in range(8):
        greedy(b, [f"10.1.0.{i + 1}"], conns_per_addr=16)
    assert b.held == MAX_LEASES
    assert newcomer_gets(b) == PEER_LEASES
    assert max(b.by_group.values()) <= GROUP_LEASES


def test_a_connection_and_a_group_keep_their_own_caps():
    b = budget()
    for _ in range(PEER_LEASES):
        assert b.admit(b"one", "192.0.2.1") == (True, None)
        b.add(b"one", "192.0.2.1")
    assert b.admit(b"one", "192.0.2.1") == (False, None)
    for i in range(GROUP_LEASES - PEER_LEASES):
        peer = f"c{i // PEER_LEASES}".encode()
        assert b.admit(peer, "192.0.2.1")[0]
        b.add(peer, "192.0.2.1")
    assert b.admit(b"fresh", "192.0.2.1") == (False, None), "the group's cap"
    b.remove(b"one", "192.0.2.1")
    assert b.admit(b"one", "192.0.2.1") == (True, None)
