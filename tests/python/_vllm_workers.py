"""Functions run in spawned processes by the vLLM drop-in tests."""

import hashlib

from pinshm.vllm.cache import storage


def digest(value):
    """sha256 over a {name: array or str} dict, in key order."""
    h = hashlib.sha256()
    for k in sorted(value):
        v = value[k]
        h.update(k.encode())
        h.update(v.encode() if isinstance(v, str) else v.tobytes())
    return h.hexdigest()


def read_storage(handle, sent, results):
    """A vLLM worker's receiver: opens the storage from its handle, gets
    every (key, address, id, signature) and reports the digests."""
    s = storage.SingleWriterShmObjectStorage.create_from_handle(handle)
    try:
        results.put([digest(s.get(a, i, sig, key)) for key, a, i, sig in sent])
    finally:
        s.close()
