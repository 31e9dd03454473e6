"""What the vLLM adapter tells the rest of pinshm about itself (``pinshm
doctor`` reads it here, never the adapter's private modules): the names
the plugin rebinds inside vLLM, whether pinshm's classes fit the
installed vLLM's, and the arithmetic of vLLM's queues that pinshm's
``auto`` queue choice uses. Importing it imports no vLLM."""

from __future__ import annotations

from ._fit import (
    CACHE_MODULE,
    QUEUE_MODULES,
    REBOUND,
    TESTED,
    Fit,
    cache_fits,
    connector_fit,
    not_fit_line,
    queue_fit,
)
from .queue._auto import queue_mode, vllm_fits, vllm_queue_bytes

__all__ = [
    "CACHE_MODULE",
    "QUEUE_MODULES",
    "REBOUND",
    "TESTED",
    "Fit",
    "cache_fits",
    "connector_fit",
    "not_fit_line",
    "queue_fit",
    "queue_mode",
    "vllm_fits",
    "vllm_queue_bytes",
]
