"""The names inside vLLM that the plugin rebinds: a leaf, read by the
plugin and by ``python -m pinshm doctor`` (which checks that they exist in
the installed vLLM without loading the plugin)."""

from __future__ import annotations

#: Where vLLM 0.33's multimodal cache looks the storage classes up.
CACHE_MODULE = "vllm.multimodal.cache.shm"
#: The names rebound there.
REBOUND = ("SingleWriterShmRingBuffer", "SingleWriterShmObjectStorage", "MsgpackSerde")

#: Modules that look ``MessageQueue`` up: those that import it at module
#: level, and shm_broadcast itself (parallel_state imports it from there
#: inside its methods, so rebinding it there covers them). The first is
#: required; the others are optional parts of vLLM.
QUEUE_MODULES = (
    "vllm.distributed.device_communicators.shm_broadcast",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.executor.ray_executor_v2",
)
