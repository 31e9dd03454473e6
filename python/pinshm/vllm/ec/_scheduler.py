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
and a hit is an object of a segment that all of them read. Before a
rank's first report (the first step's output), the segment's own reader
table answers for it: a live reader entry held by a worker process of
this engine (a child of the engine core, under vLLM's multiprocessing
executor) is that rank's attachment, so an engine's first step hits too. An engine
whose ranks cannot all attach (every reader entry taken) says so once and
runs its encoder. A load that fails all the same (a rank's copy raising)
makes its key a miss until it is saved again, and the placeholder that
stood in for it is evicted from vLLM's own encoder cache (``evict``),
with every request that used it failed: none completes from it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Optional

from ..._pinshm import Lease, PinshmError, StoreReader
from ._attach import NamedReader
from ._config import MAX_READERS, ECSettings
from ._meta import LoadReport, LoadSpec, RankState
from ._table import entries, holds, workers_holding

if TYPE_CHECKING:
    from .remote.consumer import RemoteTier

logger = logging.getLogger("vllm.pinshm.ec")

#: Steps a lease waits for its report before it ends anyway. vLLM has a
#: few steps in flight at most (async scheduling: 2, pipeline parallel: one
#: per stage); a report that never comes (a path of the model runner that
#: skips the connector's output) must not keep an output forever.
MAX_STEPS_IN_FLIGHT = 64
#: Failed keys remembered (a key is a miss while it names the object whose
#: load failed); the oldest are forgotten past this.
MAX_FAILED_KEYS = 4096

#: How often, at most, the scheduler reads a segment's reader table while
#: a rank has not reported yet.
TABLE_RETRY_S = 0.01

#: Evicts an mm_hash from vLLM's own encoder cache; returns the requests
#: that referenced it (they read the placeholder, so they are failed).
Evict = Callable[[str], set[str]]
#: The requests that reference an mm_hash in vLLM's own encoder cache now.
Refs = Callable[[str], set[str]]


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
        refs: Optional[Refs] = None,
        remote: Optional[RemoteTier] = None,
        widths: Optional[Callable[[], frozenset[int]]] = None,
    ) -> None:
        self.settings = settings
        #: The widths an output of this model may have (empty: unknown).
        self._widths = widths
        self.consumer = consumer
        self.ranks = max(1, ranks)
        self.evict = evict
        self.refs = refs
        self.reader = reader if reader is not None else NamedReader(settings.store, settings.retry_s, pin="off")
        self._probes: dict[str, Lease] = {}
        self._remote_probes: set[str] = set()
        self._loads: list[tuple[LoadSpec, Lease]] = []
        self._in_flight: dict[int, list[Lease]] = {}
        self._unavailable: set[str] = set()
        self._rank_states: dict[int, RankState] = {}
        self._failed: OrderedDict[str, tuple[int, int]] = OrderedDict()
        # While a load is unreported: every request that used its output
        # (the one that loaded it, and any that vLLM's own cache served it
        # to meanwhile), and the steps that loaded each hash.
        self._users: dict[str, set[str]] = {}
        self._load_steps: dict[int, set[str]] = {}
        self._steps_unheard = 0
        # Steps that scheduled tokens, and that count at each step built.
        self._runs = 0
        self._ran_at: dict[int, int] = {}
        # Segments (name, epoch) whose reader table showed every rank's
        # entry, and when each table may be read again.
        self._tables_seen: set[tuple[str, int]] = set()
        self._table_next: dict[str, float] = {}
        self._said: set[str] = set()
        self._step = 0
        self.hits = 0
        self.misses = 0
        self.not_ready = 0
        self.failed_loads = 0
        self.wrong_shape = 0
        self.remote_hits = 0
        self.remote = remote
        if consumer:
            self.reader.get()  # attach at start, as the workers do
            if remote is None and settings.peers:
                from .remote.consumer import RemoteTier

                self.remote = RemoteTier(settings)
        from .remote.deferral import Deferrals

        self.deferrals = Deferrals(settings.remote_timeout_s)

    # ---- whether every rank reads the segment --------------------------

    def ready(self, epoch: int) -> bool:
        """Whether every loading rank reads segment `epoch` of the store."""
        return self._ready(epoch, "epoch", self.settings.store, self.reader)

    def ready_remote(self, epoch: Optional[int]) -> bool:
        """Whether every loading rank reads the store of fetched outputs
        of epoch `epoch`."""
        remote = self.remote
        return (
            epoch is not None
            and remote is not None
            and self._ready(epoch, "remote_epoch", self.settings.remote_store, remote.reader)
        )

    def _ready(self, epoch: int, field: str, store: str, reader: NamedReader) -> bool:
        """Every rank's report says it reads `epoch` of `store`; or no
        report contradicts that and the segment's reader table shows an
        entry for every rank that has not reported yet."""
        states = self._rank_states
        told = [getattr(states[r], field) for r in range(self.ranks) if r in states]
        if any(e != epoch for e in told):
            return False
        return len(told) == self.ranks or self._workers_attached(store, epoch, reader)

    def _workers_attached(self, store: str, epoch: int, reader: NamedReader) -> bool:
        """Whether segment `epoch` of `store` has a live reader entry for
        each of this engine's ranks, held by its worker processes (children
        of this one: vLLM's multiprocessing executor). The table is read at
        most every TABLE_RETRY_S; a yes is kept for the segment (a rank
        that lets go reports it, and its report then decides)."""
        if (store, epoch) in self._tables_seen:
            return True
        now = time.monotonic()
        if now < self._table_next.get(store, float("-inf")):
            return False
        self._table_next[store] = now + TABLE_RETRY_S
        if workers_holding(reader.get(), epoch) >= self.ranks:
            self._tables_seen.add((store, epoch))
            logger.debug("pinshm encoder cache: %d worker entries in %r before any report", self.ranks, store)
            return True
        return False

    def has(self, mm_hash: str) -> bool:
        """Whether the output of `mm_hash` is in this node's memory (the
        store, or with peers the store of fetched outputs) and every rank
        can load it, leased if so. Never waits on the network: with peers,
        a miss starts a fetch in the background (for a later request),
        and vLLM's ``ensure_cache_available`` (:meth:`ensure`) has already
        deferred this request until its fetches ended."""
        if not self.consumer:
            return False
        if mm_hash in self._probes or self._has_local(mm_hash):
            return True
        remote = self.remote
        key = self.settings.key(mm_hash)
        lease = None
        if remote is not None and self.ready_remote(remote.epoch):
            lease = self._fits(self._not_failed(key, remote.lease_local(key)), remote.reader.get(), mm_hash)
            if lease is None:
                remote.want([key])
        if lease is None:
            self.misses += 1
            return False
        self.remote_hits += 1
        self._probes[mm_hash] = lease
        self._remote_probes.add(mm_hash)
        return True

    def ensure(self, request_id: str, mm_hashes: list[str]) -> bool:
        """vLLM's ``ensure_cache_available``: starts fetching those of a
        request's outputs (`mm_hashes`, the inputs it has yet to compute)
        that are not in this node's memory, and says False (vLLM defers the
        request) while any is in flight, for at most ``remote_timeout_s``
        from the first deferral; past it, True (what did not arrive is a
        miss, and the encoder runs). Never waits."""
        remote = self.remote
        if not self.consumer or remote is None or not mm_hashes:
            return True
        reader = self.reader.get()
        keys = [self.settings.key(h) for h in mm_hashes]
        keys = [k for k in keys if not holds(reader, k) and not remote.has_local(k)]
        remote.want(keys)
        return self.deferrals.ready(request_id, [k for k in keys if remote.pending(k)])

    def _has_local(self, mm_hash: str) -> bool:
        """Whether the node's store has it for every rank, leased if so (no
        count of misses: the remote tier may still have it)."""
        reader = self.reader.get()
        if reader is None:
            self._say_unattached()
            return False
        if "scheduler" in self._said:
            self._said.discard("scheduler")
            logger.info("pinshm encoder cache: this engine's scheduler reads store %r now", self.settings.store)
        if not self.ready(reader.epoch):
            self.not_ready += 1
            return False
        key = self.settings.key(mm_hash)
        try:
            # The lookup and the lease in one step: None if the key is not
            # there, or its object was reclaimed as it was found.
            lease = reader.lease_key(key)
        except PinshmError as e:
            logger.debug("pinshm encoder cache: %s: no lease (%s)", mm_hash, e)
            lease = None
        lease = self._fits(self._not_failed(key, lease), reader, mm_hash)
        if lease is None:
            return False
        self._probes[mm_hash] = lease
        return True

    def _fits(self, lease: Optional[Lease], reader: Optional[StoreReader], mm_hash: str) -> Optional[Lease]:
        """`lease`, or None (released, with a WARNING) if its object is not
        an output this model's encoder gives: a 2-D float tensor whose
        width is the model's. Another model's, a squatted store's or a lying
        peer's output is a miss, never loaded into vLLM's cache. (Its rows
        vLLM says only at allocation: the workers check those.)"""
        if lease is None or reader is None:
            return lease
        widths = self._widths() if self._widths is not None else frozenset()
        try:
            guard = reader.get(lease.handle)
            try:
                dtype, shape, _ = guard.tensor_meta()
            finally:
                guard.release()
        except (PinshmError, ValueError) as e:
            dtype, shape = f"not a tensor ({e})", ()
        if len(shape) == 2 and "float" in dtype and (not widths or shape[1] in widths):
            return lease
        _release(lease)
        self.wrong_shape += 1
        logger.warning(
            "pinshm encoder cache: the output of %s in store %r is a %s tensor of shape %s, not this model's "
            "(width %s): a miss",
            mm_hash,
            reader.name,
            dtype,
            tuple(shape),
            "/".join(map(str, sorted(widths))) or "unknown",
        )
        return None

    def _not_failed(self, key: str, lease: Optional[Lease]) -> Optional[Lease]:
        """`lease`, or None (released) if it is on the object whose load
        failed."""
        if lease is not None and key in self._failed:
            h = lease.handle
            if self._failed[key] == (h.epoch, h.monotonic_id):
                _release(lease)  # the object whose load failed: a miss
                return None
            del self._failed[key]  # saved again
        return lease

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
        free, total = entries(self.settings.store)
        if total is not None and total >= MAX_READERS:
            what = "Run fewer engines that read the store, or give them stores of their own"
        else:
            what = f"Raise n_readers in the producer's ec_connector_extra_config (at most {MAX_READERS})"
        return (
            f"This engine needs {need} reader entries (its scheduler and {self.ranks} worker(s)); "
            f"{'unknown' if free is None else free} are free now. {what}. "
            "Until then this engine runs its encoder for every input."
        )

    def allocated(self, mm_hash: str, request_id: str, input_index: int, num_embeds: int, modality: str = "") -> None:
        """vLLM allocated encoder cache space for this input: if it was a
        hit, the workers load it this step."""
        lease = self._probes.pop(mm_hash, None)
        if lease is None:
            return  # computed by the encoder
        h = lease.handle
        remote = mm_hash in self._remote_probes
        self._remote_probes.discard(mm_hash)
        spec = LoadSpec(
            mm_hash, h.address, h.monotonic_id, h.epoch, num_embeds, request_id, input_index, modality, remote
        )
        self._loads.append((spec, lease))
        self.hits += 1

    def build(self, runs: bool = True) -> tuple[int, list[LoadSpec]]:
        """The step's number and loads, for the workers; the step's leases
        wait for its report. Probes never allocated end here. `runs`: the
        step schedules tokens (an empty one, every request waiting, runs no
        model and so brings no report)."""
        self._step += 1
        self._runs += runs
        self._ran_at[self._step] = self._runs
        for lease in self._probes.values():
            _release(lease)
        self._probes.clear()
        self._remote_probes.clear()
        # Counted in steps that ran: empty ones (every request deferred)
        # come fast and report nothing.
        for step in [s for s in self._in_flight if self._runs - self._ran_at[s] >= MAX_STEPS_IN_FLIGHT]:
            logger.debug("pinshm encoder cache: step %d never reported: its leases end", step)
            for lease in self._in_flight.pop(step):
                _release(lease)
            self._forget_step(step)
        loads = [spec for spec, _ in self._loads]
        if self._loads:
            self._in_flight[self._step] = [lease for _, lease in self._loads]
            self._loads = []
            hashes = self._load_steps.setdefault(self._step, set())
            for spec in loads:
                hashes.add(spec.mm_hash)
                users = self._users.setdefault(spec.mm_hash, set())
                users.add(spec.request_id)
                # vLLM's cache serves the output to requests of this pass too.
                users |= self._refs(spec.mm_hash)
        for step in [s for s in self._ran_at if s not in self._in_flight]:
            del self._ran_at[step]
        if runs:
            self._say_if_unheard()
        return self._step, loads

    def freed(self, mm_hash: str, request_id: str) -> None:
        """vLLM's ``update_state_after_free``: a request is done with an
        input (its tokens are computed). If that input's load is not
        reported yet, the request read it: it is failed with the load."""
        users = self._users.get(mm_hash)
        if users is not None:
            users.add(request_id)

    def _refs(self, mm_hash: str) -> set[str]:
        if self.refs is None:
            return set()
        try:
            return set(self.refs(mm_hash))
        except Exception as e:  # noqa: BLE001 - never into vLLM's engine core
            logger.debug("pinshm encoder cache: references of %s: %r", mm_hash, e)
            return set()

    def _forget_step(self, step: int) -> None:
        for h in self._load_steps.pop(step, set()):
            if not any(h in hashes for hashes in self._load_steps.values()):
                self._users.pop(h, None)

    def _say_if_unheard(self) -> None:
        if not self.consumer or self._rank_states:
            return
        self._steps_unheard += 1
        if self._steps_unheard == MAX_STEPS_IN_FLIGHT:
            logger.warning(
                "pinshm encoder cache: no worker of this engine has said which store it reads after %d steps, "
                "so every lookup is a miss. vLLM passes the connector's output on from the first pipeline "
                "stage only where that stage is the last (vLLM's V1 model runner with pipeline parallel drops it)",
                MAX_STEPS_IN_FLIGHT,
            )

    def reported(self, report: LoadReport) -> None:
        """A worker report: the ranks' states; the leases of its steps (and
        of every earlier one) end; its failed loads make their keys misses,
        and every request that read their placeholders is to be failed."""
        for state in report.ranks:
            self._rank_state(state)
        # Failures first: the users of a failed load are known until its
        # step is forgotten below.
        if report.failed:
            self.failed_loads += len(report.failed)
            failed = set(report.failed_requests)
            for f in report.failed:
                key = self.settings.key(f.mm_hash)
                # (A failed load of a fetched output: its key is a miss in
                # the node's store too until saved again: harmless.)
                self._failed[key] = (f.epoch, f.monotonic_id)
                self._failed.move_to_end(key)
                while len(self._failed) > MAX_FAILED_KEYS:
                    self._failed.popitem(last=False)
                failed |= self._users.pop(f.mm_hash, set())
                if self.evict is not None:
                    try:
                        failed |= self.evict(f.mm_hash)
                    except Exception as e:  # noqa: BLE001 - never into vLLM's engine core
                        logger.error("pinshm encoder cache: evicting %s from vLLM's encoder cache: %r", f.mm_hash, e)
            logger.warning(
                "pinshm encoder cache: %d encoder output(s) could not be loaded; vLLM fails the "
                "request(s) that used them (sent again, they run the encoder): %s",
                len(report.failed),
                sorted(failed),
            )
            self._unavailable |= failed
        if report.steps:
            last = max(report.steps)
            for step in [s for s in self._in_flight if s <= last]:
                for lease in self._in_flight.pop(step):
                    _release(lease)
            for step in [s for s in self._load_steps if s <= last]:
                self._forget_step(step)

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
        if self.remote is not None:
            self.remote.close()


def _release(lease: Lease) -> None:
    try:
        lease.release()
    except PinshmError as e:  # a reader gone with its leases: nothing held
        logger.debug("pinshm encoder cache: releasing a lease: %s", e)
