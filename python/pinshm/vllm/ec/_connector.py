"""``PinshmECConnector``: vLLM's encoder-cache connector over a pinshm store.

vLLM loads it with no line of vLLM changed::

    ec_transfer_config={
        "ec_connector": "PinshmECConnector",
        "ec_connector_module_path": "pinshm.vllm.ec_connector",
        "ec_role": "ec_both",  # or ec_producer, ec_consumer
        "ec_connector_extra_config": {"store": "pinshm_ec", "size": "1g"},
    }

This module imports vLLM (its connector base classes): only vLLM's
connector factory imports it. The work is done by
:class:`._scheduler.SchedulerSide` (engine core: lookups in the shared key
index, leases) and :class:`._worker.WorkerSide` (workers: saves, loads),
which import neither vLLM nor torch.

What vLLM calls, and what happens:

- ``has_cache_item`` (scheduler): the key is looked up in the store's
  shared index and, if found, leased at once; vLLM then schedules no
  encoder run for it. A miss (or a store not there yet) runs the encoder.
- ``ensure_cache_available`` (scheduler, with ``peers``): the inputs a
  request has yet to compute that are not in this node's memory are
  fetched from the peers by a thread of the remote tier; the request is
  deferred (False) while any is in flight, for at most
  ``remote_timeout_s``. ``has_cache_item`` reads this node's memory
  only: the scheduler's step never waits on the network.
- ``update_state_after_alloc``: a leased hit becomes a load of this step;
  ``build_connector_meta`` sends the step's loads (handles, not data) to
  the workers and ends the leases of hits whose request was not scheduled.
- ``start_load_caches`` (every rank of a consumer): each output is copied
  from its slot to the model's device into vLLM's encoder cache.
- ``save_caches`` (TP rank 0 of a producer): each new encoder output is put
  into the store (device to host into the slot), unless it is there.
- ``build_connector_worker_meta`` → ``update_connector_output``: the step's
  report; the scheduler ends the step's leases.
- Every worker attaches at start and reports the segment it reads; the
  scheduler says yes only for objects of a segment every rank reads. An
  engine that cannot get its reader entries says so once and runs its
  encoder.
- A load that fails all the same puts zeros in the output's place, since
  vLLM's model runner stops on a missing output, and the report names it:
  the scheduler has vLLM's encoder cache manager evict the placeholder,
  makes the key a miss until it is saved again, and
  ``take_unavailable_requests`` hands vLLM every request that used the
  placeholder, which it fails (sent again, they run the encoder). See
  docs/vllm.md.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

from ._config import ECSettings, model_fingerprint, unknown_keys
from ._evict import evict, manager_of, owner_candidates
from ._meta import LoadReport, LoadSpec
from ._scheduler import SchedulerSide
from ._worker import WidthOf, WorkerSide

logger = logging.getLogger("vllm.pinshm.ec")

__all__ = ["PinshmECConnector", "PinshmECConnectorMetadata", "PinshmECWorkerMetadata"]


class PinshmECConnectorMetadata(ECConnectorMetadata):  # type: ignore[misc]
    """Scheduler → workers, once per step: the step's number and loads."""

    def __init__(self, step: int = 0, loads: Optional[list[LoadSpec]] = None) -> None:
        self.step = step
        self.loads: list[LoadSpec] = list(loads or [])

    def __repr__(self) -> str:
        return f"PinshmECConnectorMetadata(step={self.step}, loads={len(self.loads)})"


class PinshmECWorkerMetadata(ECConnectorWorkerMetadata):  # type: ignore[misc]
    """Workers → scheduler: the steps loaded and the requests that failed,
    merged over the ranks by vLLM's output aggregator."""

    def __init__(self, report: LoadReport) -> None:
        self.report = report

    def aggregate(self, other: Any) -> PinshmECWorkerMetadata:
        if isinstance(other, PinshmECWorkerMetadata):
            return PinshmECWorkerMetadata(self.report.merge(other.report))
        return self

    def __repr__(self) -> str:
        return f"PinshmECWorkerMetadata({self.report})"


class PinshmECConnector(ECConnectorBase):  # type: ignore[misc]
    """The encoder cache of every engine of a node, in one pinshm store."""

    def __init__(self, vllm_config: Any, role: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec = vllm_config.ec_transfer_config
        extra = getattr(ec, "ec_connector_extra_config", None) or {}
        model = getattr(vllm_config, "model_config", None)
        fingerprint = model_fingerprint(getattr(model, "model", None), getattr(model, "revision", None))
        self.settings = ECSettings.from_extra(extra, fingerprint)
        for key in unknown_keys(extra):
            logger.warning("pinshm encoder cache: ec_connector_extra_config key %r is not one it reads", key)
        self._scheduler: Optional[SchedulerSide] = None
        self._worker: Optional[WorkerSide] = None
        self._server: Any = None
        ec_role = getattr(ec, "ec_role", "?")
        if role == ECConnectorRole.SCHEDULER:
            # vLLM's Scheduler is making this connector: found later, when a
            # failed load's placeholder must leave its encoder cache.
            self._owners = owner_candidates(self)
            self._found: Any = None
            self._said_no_manager = False
            self._scheduler = SchedulerSide(
                self.settings,
                consumer=self.is_consumer,
                ranks=_loading_ranks(vllm_config),
                evict=self._evict,
                refs=self._refs,
                widths=_widths(vllm_config),
            )
            where = "scheduler, reads" if self.is_consumer else "scheduler"
            if self.settings.serve is not None:
                # Serves the node's store to other nodes (NIXL, imported
                # now: without it, an error at start that says so).
                from .remote.producer import Server

                self._server = Server(self.settings)
                where += ", serves"
        else:
            self._worker = WorkerSide(
                self.settings,
                producer=self.is_producer,
                # Only the first pipeline stage runs the encoder's part of
                # the model: the other stages never load (nor attach).
                consumer=self.is_consumer and _first_stage(),
                writes=_saving_rank(),
                device=_device(),
                dtype=getattr(model, "dtype", None),
                width_of=_width_of(vllm_config),
                rank=_tp_rank(),
            )
            where = "worker, writes the store" if self._worker.store is not None else "worker"
        logger.info("pinshm encoder cache connector in use (%s, %s): %s", ec_role, where, self.settings.describe())

    # ---- scheduler side -----------------------------------------------

    def _manager(self) -> Any:
        """vLLM's encoder cache manager, found once (None until it is)."""
        if self._found is None:
            self._found = manager_of(self, self._owners)
        return self._found

    def _refs(self, mm_hash: str) -> set[str]:
        manager = self._manager()
        return set(manager.cached.get(mm_hash, ())) if manager is not None else set()

    def _evict(self, mm_hash: str) -> set[str]:
        manager = self._manager()
        if manager is None:
            if not self._said_no_manager:
                self._said_no_manager = True
                logger.error(
                    "pinshm encoder cache: vLLM's encoder cache manager was not found: a placeholder for a "
                    "failed load stays in vLLM's encoder cache until vLLM evicts it"
                )
            return set()
        return evict(manager, mm_hash)

    def has_cache_item(self, identifier: str) -> bool:
        return self._scheduler is not None and self._scheduler.has(identifier)

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        """vLLM asks before it schedules a request with multimodal inputs:
        False defers it (every other request goes on). The inputs it has
        yet to compute, and vLLM's own encoder cache does not hold, are
        fetched from the peers in the background; the answer comes from
        this node's memory at once."""
        s = self._scheduler
        if s is None or s.remote is None:
            return True
        try:
            manager = self._manager()
            cached = getattr(manager, "cached", None) or {}
            hashes = [
                f.identifier
                for f in request.mm_features
                if f.mm_position.offset + f.mm_position.length > num_computed_tokens and f.identifier not in cached
            ]
            return s.ensure(str(request.request_id), hashes)
        except Exception as e:  # noqa: BLE001 - never into vLLM's scheduler: the request runs
            logger.debug("pinshm encoder cache: ensure_cache_available: %r", e)
            return True

    def request_finished(self, request: Any) -> tuple[bool, Optional[dict[str, Any]]]:
        """A request finished or was aborted (a deferred one too): its
        deferral is forgotten. Nothing of it is freed later."""
        if self._scheduler is not None:
            self._scheduler.deferrals.forget(str(request.request_id))
        return False, None

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        if self._scheduler is None:
            return
        feature = request.mm_features[index]
        if hasattr(request, "get_num_encoder_embeds"):
            num_embeds = int(request.get_num_encoder_embeds(index))
        else:
            num_embeds = int(feature.mm_position.get_num_embeds())
        self._scheduler.allocated(
            feature.identifier, request.request_id, index, num_embeds, str(getattr(feature, "modality", ""))
        )

    def update_state_after_free(self, request: Any, index: int) -> None:
        if self._scheduler is not None:
            self._scheduler.freed(request.mm_features[index].identifier, request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> PinshmECConnectorMetadata:
        if self._scheduler is None:
            return PinshmECConnectorMetadata()
        runs = getattr(scheduler_output, "total_num_scheduled_tokens", 1) != 0
        step, loads = self._scheduler.build(runs)
        return PinshmECConnectorMetadata(step, loads)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if self._scheduler is not None and isinstance(meta, PinshmECWorkerMetadata):
            self._scheduler.reported(meta.report)

    def take_unavailable_requests(self) -> set[str]:
        return self._scheduler.take_unavailable() if self._scheduler is not None else set()

    # ---- worker side --------------------------------------------------

    def start_load_caches(self, encoder_cache: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self._worker is not None and self.is_consumer and isinstance(meta, PinshmECConnectorMetadata):
            self._worker.load(meta.step, meta.loads, encoder_cache)

    def save_caches(self, encoder_cache: Any, mm_hash: str, **kwargs: Any) -> None:
        if self._worker is not None and self.is_producer:
            self._worker.save(encoder_cache, mm_hash)

    def build_connector_worker_meta(self) -> Optional[PinshmECWorkerMetadata]:
        if self._worker is None:
            return None
        report = self._worker.take_report()
        return PinshmECWorkerMetadata(report) if report else None

    # ---- both -----------------------------------------------------------

    def shutdown(self) -> None:
        s, w = self._scheduler, self._worker
        server, self._server = self._server, None
        if server is not None:
            logger.info(
                "pinshm encoder cache: served %d lookups, %d found, %d READs stable, %d not",
                server.lookups,
                server.found,
                server.stable,
                server.unstable,
            )
            server.close()
        if s is not None and s.remote is not None:
            r = s.remote
            logger.info(
                "pinshm encoder cache: %d fetched from peers (%d remote hits), %d not found there, "
                "%d not as their digest said, %d peer failures (%d slow answers), %d requests ran before "
                "their fetches ended",
                r.fetched,
                s.remote_hits,
                r.not_found,
                r.corrupt,
                r.peer_failures,
                r.slow_answers,
                s.deferrals.expired,
            )
        if s is not None:
            logger.info(
                "pinshm encoder cache: %d hits, %d misses (%d before every rank read the store), "
                "%d failed loads (store %r)",
                s.hits,
                s.misses,
                s.not_ready,
                s.failed_loads,
                self.settings.store,
            )
            s.close()
        if w is not None:
            if w.store is not None or w.loaded or w.failed:
                logger.info(
                    "pinshm encoder cache: %d saved, %d already there, %d not saved, %d loaded, %d failed",
                    w.saved,
                    w.already,
                    w.unsaved,
                    w.loaded,
                    w.failed,
                )
            w.close()


def _loading_ranks(vllm_config: Any) -> int:
    """Workers that load encoder outputs: those of the first pipeline stage
    (only it runs the encoder's part of the model), TP ranks times prefill
    context parallel ranks."""
    parallel = getattr(vllm_config, "parallel_config", None)
    try:
        tp = int(getattr(parallel, "tensor_parallel_size", 1))
        pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
        return max(1, tp * max(1, pcp))
    except (TypeError, ValueError):
        return 1


def _tp_rank() -> int:
    """This worker's place among the loading workers: its TP rank, and its
    prefill context parallel rank above that (0 without parallel state:
    one process)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = int(get_tensor_model_parallel_rank())
    except Exception as e:  # noqa: BLE001 - no groups (one process)
        logger.debug("pinshm encoder cache: no parallel state (%r): rank 0", e)
        return 0
    try:
        from vllm.distributed.parallel_state import get_pcp_group, get_tp_group

        pcp = get_pcp_group()
        return int(pcp.rank_in_group) * int(get_tp_group().world_size) + rank
    except Exception:  # noqa: BLE001 - no prefill context parallel group
        return rank


def _first_stage() -> bool:
    """Whether this worker is in the first pipeline stage (True without
    parallel state: one process)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return bool(get_pp_group().is_first_rank)
    except Exception as e:  # noqa: BLE001 - no groups (one process)
        logger.debug("pinshm encoder cache: no parallel state (%r): first stage", e)
        return True


def _saving_rank() -> bool:
    """Whether this worker saves: TP rank 0 of the first pipeline stage
    (the other TP ranks hold the same outputs; only the first stage runs
    the encoder)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return bool(get_tensor_model_parallel_rank() == 0 and get_pp_group().is_first_rank)
    except Exception as e:  # noqa: BLE001 - no groups (one process): it saves
        logger.debug("pinshm encoder cache: no parallel state (%r): this worker saves", e)
        return True


def _device() -> Optional[str]:
    """The device vLLM's encoder cache lives on in this worker."""
    try:
        from vllm.platforms import current_platform

        device = str(current_platform.device_type)
        if current_platform.is_cuda_alike():
            device = f"{device}:{current_platform.current_device()}"
        return device
    except Exception:  # noqa: BLE001 - no platform (a stand-in): the host
        return None


def _widths(vllm_config: Any) -> Callable[[], frozenset[int]]:
    """Every width an encoder output of this model may have (what producers
    measured, per modality, and the model's input embedding width)."""
    width = _width_of(vllm_config)

    def widths() -> frozenset[int]:
        measured = getattr(vllm_config.ec_transfer_config, "mm_encoder_output_widths", None) or {}
        known = {int(w) for w in measured.values()}
        default = width("")
        return frozenset(known | ({default} if default is not None else set()))

    return widths


def _width_of(vllm_config: Any) -> WidthOf:
    """The width of an encoder output of a modality: what an ec producer
    measured at start (vLLM 0.32+), else the model's input embedding width."""

    def width(modality: str) -> Optional[int]:
        widths = getattr(vllm_config.ec_transfer_config, "mm_encoder_output_widths", None) or {}
        if modality in widths:
            return int(widths[modality])
        try:
            return int(vllm_config.model_config.get_inputs_embeds_size())
        except Exception:  # noqa: BLE001 - a config without it
            return None

    return width
