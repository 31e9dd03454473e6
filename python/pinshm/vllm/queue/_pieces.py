"""The other way for a message that /dev/shm cannot take at that moment.

A message larger than a slot goes through the overflow store, whose pages
are backed as it grows. When /dev/shm (the node's budget,
:mod:`pinshm._node.budget`) cannot back them, the message is not failed:
its inline encoding goes through the channel's own slots, backed when the
queue was made, as consecutive ``PIECE`` messages, and each reader puts it
together in its own memory. Slower (every piece waits for every reader),
bounded in time (readers free slots as they read), and it needs no new
page of /dev/shm. A rate-limited status line says when it happens.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from ._encoding import PIECE, PIECE_HEAD
from ._wait import logger

#: Seconds between two status lines (the first is said at once).
STATUS_INTERVAL_S = 30.0


class Detours:
    """The writer's count of messages sent in pieces, and its status line."""

    def __init__(self) -> None:
        self.messages = 0
        self.bytes = 0
        self._since_said = 0
        self._said_at: Optional[float] = None

    def sent(self, nbytes: int, why: BaseException) -> None:
        self.messages += 1
        self.bytes += nbytes
        self._since_said += 1
        now = time.monotonic()
        if self._said_at is not None and now - self._said_at < STATUS_INTERVAL_S:
            return
        logger.warning(
            "pinshm MessageQueue: %d message(s) went through the queue's slots in pieces (%d in all, "
            "%.1f MiB; this one %.1f MiB): /dev/shm could not take them in the overflow store (%s). "
            "Slower, nothing lost; more /dev/shm (docker --shm-size) avoids it",
            self._since_said,
            self.messages,
            self.bytes / (1 << 20),
            nbytes / (1 << 20),
            why,
        )
        self._since_said = 0
        self._said_at = now


def send_in_pieces(parts: list[Any], slot_bytes: int, send_parts: Callable[[list[Any]], None]) -> int:
    """Sends the inline message of `parts` as PIECE messages of at most
    `slot_bytes` each; returns the message's bytes."""
    whole = memoryview(b"".join(parts))
    total = whole.nbytes
    step = slot_bytes - PIECE_HEAD.size
    if step <= 0:
        raise ValueError(f"a slot of {slot_bytes} bytes cannot carry pieces")
    head = PIECE_HEAD.pack(PIECE, total)
    for off in range(0, total, step):
        send_parts([head, whole[off : off + step]])
    return total


def assemble(first: memoryview, next_view: Callable[[], Any]) -> bytearray:
    """The inline message whose first PIECE is `first` (a view, copied
    here); `next_view()` gives the next channel message's view, released
    here once copied."""
    _, total = PIECE_HEAD.unpack_from(first, 0)
    out = bytearray(total)
    got = first.nbytes - PIECE_HEAD.size
    out[:got] = first[PIECE_HEAD.size :]
    while got < total:
        view = next_view()
        try:
            with memoryview(view) as mv:
                kind, whole = PIECE_HEAD.unpack_from(mv, 0)
                if kind != PIECE or whole != total:
                    raise RuntimeError(
                        f"pinshm MessageQueue: expected a piece of a {total}-byte message, got kind {kind}"
                    )
                n = mv.nbytes - PIECE_HEAD.size
                out[got : got + n] = mv[PIECE_HEAD.size :]
                got += n
        finally:
            view.release()
    return out
