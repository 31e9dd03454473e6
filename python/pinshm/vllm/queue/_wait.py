"""A blocking wait taken in steps, logging vLLM's long-wait line while it
lasts: the queue's writer waiting for a slot or for store room, and its
readers waiting for a message, share it."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable, Optional

# A child of vLLM's "vllm" logger, so vLLM's logging configuration shows it.
logger = logging.getLogger("vllm.pinshm.message_queue")

# vLLM's text, kept word for word up to "weight/kv cache quantization)."
# because users grep for it; what follows names who blocks.
LONG_WAIT_TIME_LOG_MSG = (
    "No available shared memory broadcast block found "
    "in %d seconds. This typically happens "
    "when some processes are hanging or doing some "
    "time-consuming work (e.g. compilation, "
    "weight/kv cache quantization). Waiting for %s."
)


def _warning_interval() -> float:
    """vLLM's VLLM_RINGBUFFER_WARNING_INTERVAL (seconds, default 60): the
    value vLLM's queue module uses where it is imported (it reads the
    variable once, into a module constant that vLLM's own tests patch),
    else the environment's."""
    vllm_queue = sys.modules.get("vllm.distributed.device_communicators.shm_broadcast")
    value = getattr(vllm_queue, "VLLM_RINGBUFFER_WARNING_INTERVAL", None)
    if value is None:
        value = os.environ.get("VLLM_RINGBUFFER_WARNING_INTERVAL", "60")
    try:
        return float(value)
    except (TypeError, ValueError):
        return 60.0


def remote_poll_wait_ms() -> float:
    """vLLM 0.34's ``REMOTE_POLL_WAIT_MS`` (how long a remote reader's
    ``spin_until_readable`` sleeps in its socket's poll), as vLLM's queue
    module has it where it is imported; 1 ms where the constant is missing
    (vLLM 0.33 and older) or not a positive number."""
    vllm_queue = sys.modules.get("vllm.distributed.device_communicators.shm_broadcast")
    value = getattr(vllm_queue, "REMOTE_POLL_WAIT_MS", 1)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else 1


def deadline_after(timeout: Optional[float]) -> Optional[float]:
    """The time.monotonic() at which `timeout` seconds from now end (None:
    never)."""
    return None if timeout is None else time.monotonic() + timeout


class Wait:
    """Until `deadline` (time.monotonic(); None: none), logging the
    long-wait line every VLLM_RINGBUFFER_WARNING_INTERVAL seconds unless
    `quiet`."""

    def __init__(self, deadline: Optional[float], quiet: bool = False) -> None:
        self.started = time.monotonic()
        self.deadline = deadline
        self.interval = None if quiet else _warning_interval()
        self.n_warning = 1

    def step(self) -> Optional[float]:
        """How long the next wait may last (None: as long as it takes):
        until the next warning or the deadline."""
        now = time.monotonic()
        step = None if self.interval is None else self.started + self.interval * self.n_warning - now
        if self.deadline is not None:
            left = self.deadline - now
            step = left if step is None else min(step, left)
        return None if step is None else max(step, 0.0)

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def warn_if_due(self, waiting_for: Callable[[], Any]) -> None:
        """Logs the long-wait line naming `waiting_for()` once per interval."""
        if self.interval is not None and time.monotonic() - self.started >= self.interval * self.n_warning:
            logger.info(LONG_WAIT_TIME_LOG_MSG, self.interval, waiting_for())
            self.n_warning += 1
