"""Fixtures: every test gets segment names of its own, and every store,
reader, channel and queue a test opens is closed when it ends, failed or
not. A test module sizes the `store` and `channel` fixtures with
module-level STORE_SHAPE and CHANNEL_SHAPE."""

import itertools
import multiprocessing as mp
import os
import re

import pytest

import pinshm

_counter = itertools.count()


@pytest.fixture
def unique_name(request):
    """Returns a function giving a new segment name, unique to this process
    and test, on each call."""
    test = re.sub(r"[^A-Za-z0-9_]", "_", request.node.name)[:80]

    def make(tag="seg"):
        return f"pinshm-py-{os.getpid()}-{test}-{tag}-{next(_counter)}"

    return make


@pytest.fixture
def closing():
    """Registers objects with a close() method, closed at teardown (readers
    before writers: last registered, first closed)."""
    opened = []

    def register(obj):
        opened.append(obj)
        return obj

    yield register
    errors = []
    for obj in reversed(opened):
        try:
            obj.close()
        except Exception as e:  # noqa: BLE001 - close the rest, then raise
            errors.append(e)
    if errors:
        raise errors[0]


@pytest.fixture
def ctx():
    """The spawn context: children start clean (no inherited mappings)."""
    return mp.get_context("spawn")


@pytest.fixture
def store(request, unique_name, closing):
    """A store of the module's STORE_SHAPE, (capacity, max_object_size,
    n_readers); default 4 MiB for objects up to 1 MiB, one reader."""
    capacity, max_object, n_readers = getattr(request.module, "STORE_SHAPE", (4 << 20, 1 << 20, 1))
    return closing(pinshm.ObjectStore(capacity, max_object, n_readers, name=unique_name()))


@pytest.fixture
def reader(store, closing):
    """Reader 0 of `store`."""
    return closing(pinshm.StoreReader.attach(store.handle(), 0))


@pytest.fixture
def channel(request, unique_name, closing):
    """A writer and reader 0 of a channel of the module's CHANNEL_SHAPE,
    (n_readers, slots, slot_size); default one reader, 2 slots of 64 B."""
    n_readers, slots, slot_size = getattr(request.module, "CHANNEL_SHAPE", (1, 2, 64))
    tx = closing(pinshm.Broadcast(n_readers, slots, slot_size, name=unique_name()))
    rx = closing(pinshm.BroadcastReader.attach(tx.handle(), 0))
    return tx, rx
