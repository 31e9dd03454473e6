"""How long vLLM's scheduler defers a request whose outputs are being
fetched (``ensure_cache_available`` answering False): while any is in
flight, and never longer than the budget (``remote_timeout_s``) from the
request's first deferral. A leaf."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

#: Deferred requests remembered at most (a request aborted while deferred
#: is never asked about again: the oldest are forgotten past this).
MAX_DEFERRED = 4096
#: The deadline of a request whose budget is spent.
EXPIRED = float("-inf")


class Deferrals:
    """The deadlines of the requests deferred now."""

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget_s = budget_s
        self._clock = clock
        self._until: OrderedDict[str, float] = OrderedDict()
        #: Requests that ran with fetches still in flight (budget spent).
        self.expired = 0

    def ready(self, request_id: str, in_flight: list[str]) -> bool:
        """Whether request `request_id` may run now, with `in_flight` its
        keys still being fetched: yes when there are none, or when its
        budget is spent; no (deferred) otherwise."""
        if not in_flight:
            self._until.pop(request_id, None)
            return True
        now = self._clock()
        until = self._until.get(request_id)
        if until is None:
            until = self._until[request_id] = now + self.budget_s
            while len(self._until) > MAX_DEFERRED:
                self._until.popitem(last=False)
        if now < until:
            return False
        if until != EXPIRED:
            # Spent: it runs from now on, whatever is still in flight, until
            # vLLM says it finished (a request that waits on for other
            # reasons is never given a second budget).
            self._until[request_id] = EXPIRED
            self.expired += 1
        return True

    def forget(self, request_id: str) -> None:
        """Request `request_id` is done (finished or aborted)."""
        self._until.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._until)
