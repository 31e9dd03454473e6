"""The multimodal cache's drop-ins: vLLM 0.33's ``SingleWriterShmRingBuffer``,
``SingleWriterShmObjectStorage``, ``ShmObjectStorageHandle`` and
``MsgpackSerde`` (``--mm-processor-cache-type shm``) over a pinshm store.

- :mod:`.storage`: the classes (the ring, the storage, the handle);
- :mod:`._serde`: the serdes (``MsgpackSerde``, the zero-copy decoder);
- :mod:`._wire`: vLLM's ``(address, monotonic_id)`` handles and the key
  index over a store.
"""

from .storage import (
    MsgpackSerde,
    ObjectSerde,
    ShmObjectStorageHandle,
    SingleWriterShmObjectStorage,
    SingleWriterShmRingBuffer,
)

__all__ = [
    "MsgpackSerde",
    "ObjectSerde",
    "ShmObjectStorageHandle",
    "SingleWriterShmObjectStorage",
    "SingleWriterShmRingBuffer",
]
