"""Which interface an address is on, or is reached through: UCX's listeners
are told to listen there alone (``UCX_NET_DEVICES``), on both sides of the
remote tier. A leaf."""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
from typing import Any, Optional


def devices_for(host: str) -> Optional[str]:
    """``UCX_NET_DEVICES`` for a serving process bound to `host`: the
    interface that holds that address (and the host's RDMA ports, which
    UCX names apart), so that UCX's TCP listener listens there alone.
    None for a wildcard address, or where no interface holds it."""
    addr = _resolve(host)
    if addr is None or addr.is_unspecified:
        return None
    return _devices([addr])


def devices_towards(hosts: list[str]) -> Optional[str]:
    """``UCX_NET_DEVICES`` for a process that reaches `hosts` (a consumer's
    peers): the interfaces this host sends from to reach each (the route's
    source address, as the kernel picks it), and the RDMA ports, so that
    the fetch process's UCX listens there alone (loopback peers: loopback).
    Hosts that do not resolve are left out; None where none does."""
    sources = []
    for host in hosts:
        addr = _resolve(host)
        if addr is None:
            continue
        family = socket.AF_INET if addr.version == 4 else socket.AF_INET6
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((str(addr), 9))  # a route lookup: nothing is sent
                sources.append(ipaddress.ip_address(str(probe.getsockname()[0]).split("%")[0]))
        except OSError:
            continue
    return _devices(sources) if sources else None


def _resolve(host: str) -> Any:
    try:
        return ipaddress.ip_address(str(socket.getaddrinfo(host, None)[0][4][0]).split("%")[0])
    except (OSError, ValueError, IndexError):
        return None


def _devices(addrs: list[Any]) -> Optional[str]:
    """The interfaces holding `addrs` (in order, once each), then the RDMA
    ports; None where no interface holds any."""
    held = _interface_addresses()
    names: list[str] = []
    for addr in addrs:
        for name, a in held:
            if a == addr and name not in names:
                names.append(name)
                break
    if not names:
        return None
    ib = "/sys/class/infiniband"
    rdma = []
    if os.path.isdir(ib):
        for dev in sorted(os.listdir(ib)):
            ports = os.path.join(ib, dev, "ports")
            rdma += [f"{dev}:{p}" for p in sorted(os.listdir(ports))] if os.path.isdir(ports) else []
    return ",".join([*names, *rdma])


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [
    ("next", ctypes.POINTER(_Ifaddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.c_void_p),
    ("netmask", ctypes.c_void_p),
    ("ifu", ctypes.c_void_p),
    ("data", ctypes.c_void_p),
]


def _interface_addresses() -> list[tuple[str, Any]]:
    """(interface, address) of every IPv4 and IPv6 address (getifaddrs(3))."""
    libc = ctypes.CDLL(None, use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        return []
    out: list[tuple[str, Any]] = []
    try:
        node = head
        while node:
            entry = node.contents
            if entry.addr:
                family = ctypes.c_ushort.from_address(entry.addr).value
                if family == socket.AF_INET:
                    raw = ctypes.string_at(entry.addr + 4, 4)
                    out.append((entry.name.decode(), ipaddress.IPv4Address(raw)))
                elif family == socket.AF_INET6:
                    raw = ctypes.string_at(entry.addr + 8, 16)
                    out.append((entry.name.decode(), ipaddress.IPv6Address(raw)))
            node = entry.next
    finally:
        libc.freeifaddrs(head)
    return out
