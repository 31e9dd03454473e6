"""Drop-in replacements for vLLM 0.33's shared-memory classes, backed by
pinshm.

- ``pinshm.vllm.storage``: ``SingleWriterShmRingBuffer``,
  ``SingleWriterShmObjectStorage``, ``ShmObjectStorageHandle`` and
  ``MsgpackSerde`` (the multimodal processor cache,
  ``--mm-processor-cache-type shm``).
- ``pinshm.vllm.message_queue``: ``MessageQueue`` (the device
  communicators' broadcast queue).
- ``pinshm.vllm.plugin``: the ``vllm.general_plugins`` entry point that
  rebinds those names inside vLLM.

Nothing here imports vLLM or torch at import time; both are optional.
"""
