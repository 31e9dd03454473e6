"""The scheduler's half of the connector (it runs in vLLM's engine core,
which is not the store's writer): answers ``has_cache_item`` from the
store's shared key index, leases what it tells the workers to load, and
ends each lease when the workers report the step that loaded it.

Leases are taken when the answer is given, not later: once
``has_cache_item`` says yes, vLLM's scheduler counts on the output (it
schedules no encoder run for it), so the answer and the lease are one step.
An output that is gone by then is a plain miss, and the encoder runs.
"""

from __future__ import annotations

import logging
from typing import Optional

from ..._pinshm import Lease, PinshmError
from ._attach import NamedReader
from ._config import ECSettings
from ._meta import LoadReport, LoadSpec

logger = logging.getLogger("vllm.pinshm.ec")

#: Steps a lease waits for its report before it ends anyway. vLLM has a
#: few steps in flight at most (async scheduling: 2, pipeline parallel: one
#: per stage); a report that never comes (a path of the model runner that
#: skips the connector's output) must not keep an output forever.
MAX_STEPS_IN_FLIGHT = 64


class SchedulerSide:
    """Lookups, leases and their ends, for one engine's scheduler.

    The life of a lease: :meth:`has` takes it (a probe); :meth:`allocated`
    (vLLM's ``update_state_after_alloc``) makes the probe a load of this
    step; :meth:`build` hands the step's loads to the workers and ends the
    probes that were not allocated (their requests were not scheduled);
    :meth:`reported` ends a step's leases when a worker report names it
    (every step before it has completed too, so theirs end as well).
    """

    def __init__(self, settings: ECSettings, consumer: bool, reader: Optional[NamedReader] = None) -> None:
        self.settings = settings
        self.consumer = consumer
        self.reader = reader if reader is not None else NamedReader(settings.store, settings.retry_s, pin="off")
        self._probes: dict[str, Lease] = {}
        self._loads: list[tuple[LoadSpec, Lease]] = []
        self._in_flight: dict[int, list[Lease]] = {}
        self._unavailable: set[str] = set()
        self._step = 0
        self.hits = 0
        self.misses = 0
        self.failed_loads = 0

    def has(self, mm_hash: str) -> bool:
        """Whether the output of `mm_hash` is in the store, leased if so."""
        if not self.consumer:
            return False
        if mm_hash in self._probes:
            return True
        reader = self.reader.get()
        if reader is None:
            self.misses += 1
            return False
        try:
            # The lookup and the lease in one step: None if the key is not
            # there, or its object was reclaimed as it was found.
            lease = reader.lease_key(self.settings.key(mm_hash))
        except PinshmError as e:
            logger.debug("pinshm encoder cache: %s: no lease (%s)", mm_hash, e)
            lease = None
        if lease is None:
            self.misses += 1
            return False
        self._probes[mm_hash] = lease
        return True

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
        """A worker report: the leases of its steps (and of every earlier
        one) end; its failed requests are to be failed by vLLM."""
        if report.steps:
            last = max(report.steps)
            for step in [s for s in self._in_flight if s <= last]:
                for lease in self._in_flight.pop(step):
                    _release(lease)
        if report.failed:
            self.failed_loads += len(report.failed)
            logger.warning(
                "pinshm encoder cache: %d request(s) could not load their encoder output; "
                "vLLM fails them (sent again, they run the encoder): %s",
                len(report.failed),
                sorted(report.failed),
            )
            self._unavailable |= report.failed

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


def _release(lease: Lease) -> None:
    try:
        lease.release()
    except PinshmError as e:  # a reader gone with its leases: nothing held
        logger.debug("pinshm encoder cache: releasing a lease: %s", e)
