"""The broadcast queue's drop-in: vLLM 0.33's ``MessageQueue`` (and its
``Handle``), the device communicators' queue, over a pinshm channel.

- :mod:`.message_queue`: ``MessageQueue`` and ``Handle``;
- :mod:`._encoding`: a message as a pickle and its out-of-band buffers;
- :mod:`._overflow`: the store that carries messages larger than a chunk;
- :mod:`._wait`: the readers' and writer's waits and their warnings;
- :mod:`._groups`: which ranks share this machine (torch.distributed);
- :mod:`._remote`: vLLM's ZMQ transport for readers on other machines;
- :mod:`._auto`: the chooser of ``PINSHM_VLLM_MESSAGE_QUEUE=auto``.
"""

from .message_queue import LONG_WAIT_TIME_LOG_MSG, Handle, MessageQueue

__all__ = ["Handle", "LONG_WAIT_TIME_LOG_MSG", "MessageQueue"]
