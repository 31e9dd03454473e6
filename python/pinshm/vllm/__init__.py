"""Drop-in replacements for vLLM 0.33's shared-memory classes, backed by
pinshm, by concern:

- :mod:`pinshm.vllm.cache`: ``SingleWriterShmRingBuffer``,
  ``SingleWriterShmObjectStorage``, ``ShmObjectStorageHandle`` and
  ``MsgpackSerde`` (the multimodal processor cache,
  ``--mm-processor-cache-type shm``).
- :mod:`pinshm.vllm.queue`: ``MessageQueue`` and ``Handle`` (the device
  communicators' broadcast queue).
- :mod:`pinshm.vllm.plugin`: the ``vllm.general_plugins`` entry point that
  rebinds those names inside vLLM. Nothing in the package imports it.
- :mod:`pinshm.vllm._status` (the "in use" line and the warnings) and
  :mod:`pinshm._node.tracker` (the reaper that removes what a SIGKILLed process made), shared by both.

Nothing here imports vLLM or torch at import time; both are optional.
"""
