"""Functions run in spawned processes (importable by name from the
children, which get the parent's sys.path)."""

import hashlib
import pickle
import time

import pinshm


def read_objects(store_handle, index, handles, results):
    """Attaches as reader `index`, reads every handle zero-copy and as a
    copy, and reports (index, [sha256 of each object])."""
    with pinshm.StoreReader.attach(store_handle, index) as reader:
        digests = []
        for h in handles:
            with reader.get(h) as guard:
                zero_copy = hashlib.sha256(memoryview(guard)).hexdigest()
            copy = hashlib.sha256(reader.get_copy(h)).hexdigest()
            assert zero_copy == copy
            digests.append(zero_copy)
    results.put((index, digests))


def receive_messages(channel_handle, results):
    """Receives messages until b"eos" and reports them all."""
    with pinshm.BroadcastReader.attach(channel_handle, 0) as rx:
        got = []
        while True:
            m = rx.recv_bytes()
            if m == b"eos":
                break
            got.append(m)
    results.put(got)


def serve_objects(channel_handle, store_handle, results):
    """The main job's worker: handles arrive over the channel, objects are
    read from the store; reports the sha256 of each until b"eos"."""
    with pinshm.BroadcastReader.attach(channel_handle, 0) as rx, pinshm.StoreReader.attach(
        store_handle, 0
    ) as reader:
        digests = []
        while True:
            m = rx.recv_bytes()
            if m == b"eos":
                break
            if not m:  # a nudge from a writer waiting for room
                continue
            h = pickle.loads(m)
            with reader.get(h) as guard:
                digests.append(hashlib.sha256(memoryview(guard)).hexdigest())
    results.put(digests)


def attach_hold_and_wait(store_handle, index, handle, ready):
    """Attaches as reader `index`, holds a guard on `handle`, says so on
    `ready`, then waits to be killed (the inspect test's dead reader)."""
    import time

    reader = pinshm.StoreReader.attach(store_handle, index)
    guard = reader.get(handle)
    ready.put(len(guard))
    while True:
        time.sleep(60)


def create_and_wait(name, ready):
    """Creates store `name`, puts an object, says `created`, then waits to
    be killed (the gc test's dead writer: reap=False, so what it leaves is
    gc's to find, not its reaper's to remove)."""
    store = pinshm.ObjectStore(1 << 20, 4096, 1, name=name, reap=False)
    store.put("a", b"x" * 3000)
    ready.put("created")
    time.sleep(120)  # SIGKILLed long before
