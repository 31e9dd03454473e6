"""The scheduler's half of the connector (it runs in vLLM's engine core,
which is not the store's writer): answers ``has_cache_item`` from the
store's shared key index, leases what it tells the workers to load, and
ends each lease when the workers report the step that loaded it.

Leases are taken when the answer is given, not later: once
``has_cache_item`` says yes, vLLM's scheduler counts on the output (it
schedules no encoder run for it), so the answer and the lease are one step.
An output that is gone by then is a plain miss, and the encoder runs.

It says yes only where no rank can fail the load for want of the store:
every worker of the engine (each TP rank) reports the segment it reads,
and a hit is an object of a segment that all of them read. An engine
whose ranks cannot all attach (every reader entry taken) says so once and
runs its encoder. A load that fails all the same (a rank's copy raising)
makes its key a miss until it is saved again, and the placeholder that
stood in for it is evicted from vLLM's own encoder cache (``evict``),
with every request that used it failed: none completes from it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, Optional

from ..._pinshm import Lease, PinshmError
from ._attach import NamedReader
from ._config import ECSettings
from ._meta import LoadReport, LoadSpec, RankState

logger = logging.getLogger("vllm.pinshm.ec")

#: Steps a lease waits for its report before it ends anyway. vLLM has a
#: few steps in flight at most (async scheduling: 2, pipeline parallel: one
#: per stage); a report that never comes (a path of the model runner that
#: skips the connector's output) must not keep an output forever.
MAX_STEPS_IN_FLIGHT = 64
#: Failed keys remembered (a key is a miss while it names the object whose
#: load failed); the oldest are forgotten past this.
MAX_FAILED_KEYS = 4096

#: Evicts an mm_hash from vLLM's own encoder cache; returns the requests
#: that referenced it (they read the placeholder, so they are failed).
Evict = Callable[[str], set[str]]


class SchedulerSide:
    """Lookups, leases and their ends, for one engine's scheduler.

    The life of a lease: :meth:`has` takes it (a probe); :meth:`allocated`
    (vLLM's ``update_state_after_alloc``) makes the probe a load of this
    step; :meth:`build` hands the step's loads to the workers and ends the
    probes that were not allocated (their requests were not scheduled);
    :meth:`reported` ends a step's leases when a worker report names it
    (every step before it has completed too, so theirs end as well).
    `ranks` is the number of workers that load (the TP ranks of the first
    pipeline stage).
    """

    def __init__(
        self,
        settings: ECSettings,
        consumer: bool,
        reader: Optional[NamedReader] = None,
        ranks: int = 1,
        evict: Optional[Evict] = None,
    ) -> None:
        self.settings = settings
        self.consumer = consumer
        self.ranks = max(1, ranks)
        self.evict = evict
        self.reader = reader if reader is not None else NamedReader(settings.store, settings.retry_s, pin="off")
        self._probes: dict[str, Lease] = {}
        self._loads: list[tuple[LoadSpec, Lease]] = []
        self._in_flight: dict[int, list[Lease]] = {}
        self._unavailable: set[str] = set()
        self._rank_states: dict[int, RankState] = {}
        self._failed: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._said: set[str] = set()
        self._step = 0
        self.hits = 0
        self.misses = 0
        self.not_ready = 0
        self.failed_loads = 0
        if consumer:
            self.reader.get()  # attach at start, as the workers do

    # ---- whether every rank reads the segment --------------------------

    def ready(self, epoch: int) -> bool:
        """Whether every loading rank reported that it reads segment `epoch`."""
        states = self._rank_states
        return len(states) >= self.ranks and all(
            states.get(r) is not None and states[r].epoch == epoch for r in range(self.ranks)
        )

    def has(self, mm_hash: str) -> bool:
        """Whether the output of `mm_hash` is in the store and every rank
        can load it, leased if so."""
        if not self.consumer:
            return False
        if mm_hash in self._probes:
            return True
        reader = self.reader.get()
        if reader is None:
            self._say_unattached()
            self.misses += 1
            return False
        if "scheduler" in self._said:
            self._said.discard("scheduler")
            logger.info("pinshm encoder cache: this engine's scheduler reads store %r now", self.settings.store)
        if not self.ready(reader.epoch):
            self.not_ready += 1
            self.misses += 1
            return False
        key = self.settings.key(mm_hash)
        try:
            # The lookup and the lease in one step: None if the key is not
            # there, or its object was reclaimed as it was found.
            lease = reader.lease_key(key)
        except PinshmError as e:
            logger.debug("pinshm encoder cache: %s: no lease (%s)", mm_hash, e)
            lease = None
        if lease is not None and key in self._failed:
            h = lease.handle
            if self._failed[key] == (h.epoch, h.monotonic_id):
                _release(lease)  # the object whose load failed: a miss
                lease = None
            else:
                del self._failed[key]  # saved again
        if lease is None:
            self.misses += 1
            return False
        self._probes[mm_hash] = lease
        return True

    def _say_unattached(self) -> None:
        r = self.reader
        if r.no_entry and "scheduler" not in self._said:
            self._said.add("scheduler")
            logger.warning(
                "pinshm encoder cache: this engine's scheduler cannot read store %r: %s. %s",
                self.settings.store,
                r.last_error,
                self._advice(),
            )

    def _advice(self) -> str:
        need = 1 + self.ranks
        free = free_entries(self.settings.store)
        return (
            f"This engine needs {need} reader entries (its scheduler and {self.ranks} worker(s)); "
            f"{'unknown' if free is None else free} are free now. Raise n_readers in the producer's "
            "ec_connector_extra_config (at most 64). Until then this engine runs its encoder for every input."
        )

    def allocated(self, mm_hash: str, request_id: str, input_index: int, num_embeds: int, modality: str = "") -> None:
        """vLLM allocated encoder cache space for this input: if it was a
        hit, the workers load it this step."""
        lease = self._probes.pop(mm_hash, None)
        if lease is None:
            return  # computed by the encoder
        h = lease.handle
        spec = LoadSpec(mm_hash, h.address, h.monotonic_id, h.epoch, num_embeds, request_id, input_index, modality)
        self._loads.append((spec, lease))
        self.hits += 1

    def build(self) -> tuple[int, list[LoadSpec]]:
        """The step's number and loads, for the workers; the step's leases
        wait for its report. Probes never allocated end here."""
        self._step += 1
        for lease in self._probes.values():
            _release(lease)
        self._probes.clear()
        for step in [s for s in self._in_flight if s <= self._step - MAX_STEPS_IN_FLIGHT]:
            logger.debug("pinshm encoder cache: step %d never reported: its leases end", step)
            for lease in self._in_flight.pop(step):
                _release(lease)
        loads = [spec for spec, _ in self._loads]
        if self._loads:
            self._in_flight[self._step] = [lease for _, lease in self._loads]
            self._loads = []
        return self._step, loads

    def reported(self, report: LoadReport) -> None:
        """A worker report: the ranks' states; the leases of its steps (and
        of every earlier one) end; its failed loads make their keys misses,
        and every request that read their placeholders is to be failed."""
        for state in report.ranks:
            self._rank_state(state)
        if report.steps:
            last = max(report.steps)
            for step in [s for s in self._in_flight if s <= last]:
                for lease in self._in_flight.pop(step):
                    _release(lease)
        if report.failed:
            self.failed_loads += len(report.failed)
            failed = set(report.failed_requests)
            for f in report.failed:
                key = self.settings.key(f.mm_hash)
                self._failed[key] = (f.epoch, f.monotonic_id)
                self._failed.move_to_end(key)
                while len(self._failed) > MAX_FAILED_KEYS:
                    self._failed.popitem(last=False)
                if self.evict is not None:
                    failed |= self.evict(f.mm_hash)
            logger.warning(
                "pinshm encoder cache: %d encoder output(s) could not be loaded; vLLM fails the "
                "request(s) that used them (sent again, they run the encoder): %s",
                len(report.failed),
                sorted(failed),
            )
            self._unavailable |= failed

    def _rank_state(self, state: RankState) -> None:
        before = self._rank_states.get(state.rank)
        self._rank_states[state.rank] = state
        if state == before:
            return
        if state.epoch is None and state.no_entry:
            if f"rank{state.rank}" not in self._said:
                self._said.add(f"rank{state.rank}")
                logger.warning(
                    "pinshm encoder cache: worker %d of this engine cannot read store %r: %s. %s",
                    state.rank,
                    self.settings.store,
                    state.why,
                    self._advice(),
                )
        elif state.epoch is not None and f"rank{state.rank}" in self._said:
            self._said.discard(f"rank{state.rank}")
            logger.info(
                "pinshm encoder cache: worker %d of this engine reads store %r now", state.rank, self.settings.store
            )

    def take_unavailable(self) -> set[str]:
        """Requests whose encoder output the workers could not load, once."""
        out, self._unavailable = self._unavailable, set()
        return out

    @property
    def leases_out(self) -> int:
        return len(self._probes) + len(self._loads) + sum(len(v) for v in self._in_flight.values())

    def close(self) -> None:
        """Ends every lease and detaches. Twice is fine."""
        for lease in list(self._probes.values()) + [lease for _, lease in self._loads]:
            _release(lease)
        for leases in self._in_flight.values():
            for lease in leases:
                _release(lease)
        self._probes.clear()
        self._loads = []
        self._in_flight.clear()
        self.reader.close()


def free_entries(store: str) -> Optional[int]:
    """Reader entries of `store` free for an attach now (None: unknown)."""
    try:
        from ..._pinshm import inspect_segment

        return int(inspect_segment(store)["entries_free"])
    except Exception:  # noqa: BLE001 - advice only
        return None


def _release(lease: Lease) -> None:
    try:
        lease.release()
    except PinshmError as e:  # a reader gone with its leases: nothing held
        logger.debug("pinshm encoder cache: releasing a lease: %s", e)
