"""Fixtures: every test gets segment names of its own, and every store,
reader and channel a test opens is closed when it ends, failed or not."""

import itertools
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
    for obj in reversed(opened):
        obj.close()


@pytest.fixture
def store(unique_name, closing):
    """A 4 MiB store for objects up to 1 MiB, one reader (tests needing
    another shape define their own `store`)."""
    return closing(pinshm.ObjectStore(4 << 20, 1 << 20, 1, name=unique_name()))


@pytest.fixture
def reader(store, closing):
    """Reader 0 of `store`."""
    return closing(pinshm.StoreReader.attach(store.handle(), 0))
