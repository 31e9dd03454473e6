"""A reader of the store by its name, attached lazily and following the
name: the scheduler and the workers of an engine read whatever segment
``/dev/shm/<store>`` is now, so when a producer engine restarts (a new
segment under the old name) they move to it together. The reader of the
segment it moved from is kept (``keep_previous``) for the loads the
scheduler leased there: a lease keeps its object's bytes, and a reader
of a dead writer's segment still reads what was published."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Literal, Optional

from ..._pinshm import PinshmError, StoreHandle, StoreReader, UntrustedError
from .. import _status

logger = logging.getLogger("vllm.pinshm.ec")


class NamedReader:
    """A :class:`StoreReader` of store `name`, or None while there is none.

    Attaching is retried at most every `retry_s` seconds (a consumer may
    start before its producer: until then every lookup is a miss, for the
    price of a clock read). An attached reader is checked at the same pace
    against the name (the segment's nonce): a segment that is gone or was
    replaced is let go, and the next call attaches to the new one.
    """

    def __init__(
        self,
        name: str,
        retry_s: float = 1.0,
        pin: Literal["auto", "off", "require"] = "off",
        clock: Callable[[], float] = time.monotonic,
        keep_previous: bool = False,
    ) -> None:
        self.name = name
        self.retry_s = retry_s
        self._pin: Literal["auto", "off", "require"] = pin
        self._clock = clock
        self._reader: Optional[StoreReader] = None
        self._nonce: Optional[int] = None
        self._next: float = float("-inf")
        self._pid = os.getpid()
        self._said_missing = False
        self.attaches = 0
        #: Why the last attach failed ("" once attached).
        self.last_error = ""
        #: Whether it failed because every reader entry was taken.
        self.no_entry = False
        self._keep_previous = keep_previous
        self._previous: dict[int, StoreReader] = {}

    def get(self) -> Optional[StoreReader]:
        """The reader, attaching or re-checking it when `retry_s` has passed."""
        self._forget_if_forked()
        now = self._clock()
        if now < self._next:
            return self._reader
        self._next = now + self.retry_s
        if self._reader is not None and self._current_nonce() == self._nonce:
            return self._reader
        self._let_go()
        return self._attach()

    def for_epoch(self, epoch: int) -> Optional[StoreReader]:
        """A reader of the segment whose epoch is `epoch` (the one a handle
        was issued in): the attached one, or one attached now, whatever
        the pace; None if the named segment is another."""
        self._forget_if_forked()
        if self._reader is not None and self._reader.epoch == epoch:
            return self._reader
        if epoch in self._previous:
            return self._previous[epoch]
        if self._reader is not None and self._current_nonce() == self._nonce:
            return None  # the name still names the attached segment: not that epoch's
        self._let_go()
        self._next = self._clock() + self.retry_s
        reader = self._attach()
        return reader if reader is not None and reader.epoch == epoch else None

    def _current_nonce(self) -> Optional[int]:
        try:
            return StoreHandle.of(self.name).nonce
        except (OSError, PinshmError):
            return None

    def _attach(self) -> Optional[StoreReader]:
        try:
            nonce = StoreHandle.of(self.name).nonce
            reader = StoreReader.attach_by_name(self.name, pin=self._pin)
        except (OSError, PinshmError) as e:
            said_before, self.last_error = self.last_error, str(e)
            self.no_entry = "reader entries are taken" in self.last_error
            if isinstance(e, UntrustedError):
                # Another user's file under the name (a squatter, or a
                # store shared without PINSHM_TRUSTED_UIDS): never read.
                if self.last_error != said_before:
                    logger.warning("pinshm encoder cache: store %r is not read: %s", self.name, e)
            elif not self._said_missing:
                self._said_missing = True
                logger.info("pinshm encoder cache: store %r not readable yet (%s); retrying", self.name, e)
            return None
        self._reader, self._nonce = reader, nonce
        _status.pinned(f"encoder cache {self.name!r}", reader)
        self._said_missing = False
        self.last_error, self.no_entry = "", False
        self.attaches += 1
        return reader

    def _let_go(self) -> None:
        # Not closed: leases taken through it may still be out, and end when
        # they are released; the reader goes with the last reference.
        if self._keep_previous and self._reader is not None:
            self._previous[self._reader.epoch] = self._reader
        self._reader = None
        self._nonce = None

    @property
    def previous_epochs(self) -> list[int]:
        """Epochs of the segments moved from whose readers are kept."""
        return list(self._previous)

    def drop_previous(self, epoch: int) -> None:
        """Closes the kept reader of `epoch` (no load will need it)."""
        reader = self._previous.pop(epoch, None)
        if reader is not None:
            _close(reader, self.name)

    def _forget_if_forked(self) -> None:
        # A forked child's copy is its parent's reader: it must attach anew.
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._reader = None
            self._nonce = None
            self._previous = {}
            self._next = float("-inf")

    def close(self) -> None:
        """Detaches (the reader closes; leases still out end with it)."""
        reader, self._reader = self._reader, None
        previous, self._previous = list(self._previous.values()), {}
        if os.getpid() != self._pid:
            return
        for r in ([reader] if reader is not None else []) + previous:
            _close(r, self.name)


def _close(reader: StoreReader, name: str) -> None:
    try:
        reader.close()
    except PinshmError as e:  # never raised at shutdown
        logger.debug("pinshm encoder cache: closing the reader of %r: %s", name, e)
