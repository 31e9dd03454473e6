"""The status line: pinshm's "in use" line and its warnings, sent where
vLLM's logging shows them. A leaf module: the plugin, the cache and the
queue import it, and it imports none of them.

vLLM loads plugins before it configures its logging (in the API server and
the ``LLM`` process), and an INFO record sent then is lost. So a warning
(something was *not* rebound) goes through :mod:`warnings` while vLLM's
logging is not configured (always printed, with a ``pinshm:`` text that
says what), and the "in use" line is held (:func:`hold`) until the process
first builds one of pinshm's stores or queues (:func:`announce`), when
logging is configured.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .._pinshm import StoreReader

_lock = threading.Lock()
#: The "in use" line, until it is logged.
_pending: Optional[str] = None
_announced = False


def _logger() -> logging.Logger:
    try:
        from vllm.logger import init_logger
    except Exception:  # noqa: BLE001 - any vLLM import may fail
        return logging.getLogger("vllm.plugins.pinshm")
    # Under "vllm", so vLLM's own logging configuration shows it.
    logger: logging.Logger = init_logger("vllm.plugins.pinshm")
    return logger


def _logging_ready() -> bool:
    """Whether a record sent to the "vllm" logger now reaches a handler
    (vLLM configured its logging, or the application did)."""
    log: Optional[logging.Logger] = logging.getLogger("vllm.plugins.pinshm")
    while log is not None:
        if log.handlers:
            return True
        if not log.propagate:
            return False
        log = log.parent
    return False


def warn(msg: str, *args: object) -> None:
    """A warning: logged if logging is ready, else through :mod:`warnings`."""
    text = msg % args if args else msg
    if _logging_ready():
        _logger().warning("%s", text)
    else:
        warnings.warn(text, RuntimeWarning, stacklevel=3)


def hold(line: str) -> None:
    """Holds the "in use" `line` until :func:`announce` (at once if logging
    is ready). Once one line was logged, or while the same one is held,
    nothing changes."""
    global _pending
    with _lock:
        if _announced or line == _pending:
            return
        _pending = line
    if _logging_ready():
        announce()


def pending() -> Optional[str]:
    """The line held back, if any."""
    return _pending


def announce() -> None:
    """Logs the held "in use" line once per process. Called when logging is
    ready, and by pinshm's store and queue writers when they are built
    (vLLM's logging is configured by then)."""
    global _pending, _announced
    with _lock:
        line, _pending = _pending, None
        if line is None or _announced:
            return
        _announced = True
    _logger().info("%s", line)


#: A reader that pinned at least this much says how long it took.
LARGE_PIN = 1 << 30


def pinned(what: str, reader: StoreReader) -> None:
    """Says, at INFO, how long pinning a large store took in this process
    (``cuMemHostRegister`` locks every page, about 0.1 s per GiB, in every
    worker that attaches): a slow first attach is then explained."""
    p = reader.pinning
    if p is not None and p["bytes"] >= LARGE_PIN:
        logging.getLogger("pinshm").info(
            "pinshm: %s pinned %.1f GiB in %.2f s (%d registration call%s)",
            what,
            p["bytes"] / (1 << 30),
            p["seconds"],
            p["chunks"],
            "" if p["chunks"] == 1 else "s",
        )
