"""doctor --gpu's NUMA and registration lines, on CPU: the page query is
the real syscall on a real mapping; the GPUs' nodes are given."""

import ctypes
import mmap
from collections import Counter

import pytest

from pinshm.doctor import gpu as _gpu_check
from pinshm._node import numa as _numa
from pinshm.doctor import INFO, OK, WARN


def test_the_nodes_of_a_mappings_touched_pages_are_counted_and_untouched_ones_left_out():
    m = mmap.mmap(-1, 64 * mmap.PAGESIZE)
    try:
        m[: 32 * mmap.PAGESIZE] = b"x" * (32 * mmap.PAGESIZE)  # half of it allocated
        buf = (ctypes.c_char * len(m)).from_buffer(m)
        try:
            nodes = _numa.page_nodes(ctypes.addressof(buf), len(m))
        except OSError as e:
            pytest.skip(f"this kernel answers no move_pages query: {e}")
        finally:
            del buf
        assert sum(nodes.values()) == 32 and all(n >= 0 for n in nodes)
    finally:
        m.close()


def test_a_pci_device_sysfs_does_not_know_has_no_node():
    assert _numa.gpu_node(0xFFFF, 0xFF, 0x1F) is None


def test_a_gpu_on_another_node_than_the_stores_pages_is_a_warning():
    assert _gpu_check.numa_check({0: 0, 1: 1}, Counter({0: 256})).status == WARN
    assert "GPU 1" in _gpu_check.numa_check({0: 0, 1: 1}, Counter({0: 256})).text
    assert _gpu_check.numa_check({0: 0}, Counter({0: 256})).status == OK
    assert _gpu_check.numa_check({0: None}, Counter({0: 256})).status == INFO
    assert _gpu_check.numa_check({0: 0}, None).status == INFO


def test_the_registration_line_gives_size_calls_and_time_per_gib():
    c = _gpu_check.pinning_check({"bytes": 130 << 30, "chunks": 3, "seconds": 13.0})
    assert "3 calls" in c.text and "0.10 s per GiB" in c.text and "133120 MiB" in c.text
    assert "not registered" in _gpu_check.pinning_check(None).text
