"""The workers' half of the connector: TP rank 0 of a producer engine
writes the store (it creates it, sparse, in cache mode) and saves each new
encoder output into it, device to host straight into the slot; every rank
of a consumer engine loads what the scheduler leased, host to device from
the slot, into vLLM's encoder cache.

torch is imported only when a tensor is made here (a placeholder): vLLM's
workers have it, CI has numpy only, and the device copies
(:mod:`pinshm.device`) take either.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import MutableMapping, Sequence
from typing import Any, Callable, Optional

from ..._node.budget import shm_headroom
from ..._node.tracker import Tracked
from ..._pinshm import (
    NoSpaceError,
    ObjectHandle,
    ObjectStore,
    PendingSave,
    PinshmError,
    UntrustedError,
    cuda_status,
)
from ...device import copy_stream, get_tensor, put_tensor
from ._attach import NamedReader
from ._config import MIN_RESERVED, ECSettings, default_reserved, does_not_fit
from ._meta import FailedLoad, LoadReport, LoadSpec, RankState

logger = logging.getLogger("vllm.pinshm.ec")

#: Width of a placeholder for a request whose output could not be loaded,
#: by modality ("" for any): None when it cannot be known.
WidthOf = Callable[[str], Optional[int]]

#: Steps after a move to a new segment that the reader of the old one is
#: kept for loads leased there (the scheduler's leases end by then).
KEEP_PREVIOUS_STEPS = 64
#: Seconds a closing writer waits for saves still in flight.
CLOSE_FLUSH_S = 5.0


#: How often a worker retries attaching the store of fetched outputs.
REMOTE_RETRY_S = 0.01
#: How long, at most, a worker's thread tries to attach it before the
#: engine's first step (the step's own path takes over then).
EARLY_ATTACH_S = 600.0


class WorkerSide:
    """Saves (the writer, when this rank writes) and loads (every rank of
    a consumer) for one worker process."""

    def __init__(
        self,
        settings: ECSettings,
        producer: bool,
        consumer: bool,
        writes: bool,
        device: Optional[str] = None,
        dtype: Any = None,
        width_of: Optional[WidthOf] = None,
        rank: int = 0,
    ) -> None:
        self.settings = settings
        self.rank = rank
        self.producer = producer
        self.consumer = consumer
        self.device = device
        self.dtype = dtype
        self.width_of = width_of
        self.store: Optional[ObjectStore] = None
        self._tracked = Tracked()
        self.reader = NamedReader(settings.store, settings.retry_s, pin="auto", keep_previous=True)
        # Outputs fetched from other nodes (the remote tier), where peers are
        # set. Its store is made by the engine's scheduler, which vLLM
        # builds after the workers: retried at each step's report (at most
        # every REMOTE_RETRY_S) rather than every retry_s, so the scheduler
        # hears within a step that every rank reads it and fetches from the
        # first steps on. A failed attach is one shm_open.
        self.remote_reader = (
            NamedReader(settings.remote_store, min(settings.retry_s, REMOTE_RETRY_S), pin="auto")
            if settings.peers and consumer
            else None
        )
        self._report = LoadReport()
        self._state: Optional[RankState] = None
        self._state_told = False
        self._step = 0
        self._moved_at: dict[int, int] = {}
        self._placeholders: dict[str, Any] = {}
        self._pending: list[PendingSave] = []
        self._warned: set[str] = set()
        self.saved = 0
        self.already = 0
        self.unsaved = 0
        self.loaded = 0
        self.failed = 0
        if producer and writes:
            self.store = self._create()
        self._early: Optional[threading.Thread] = None
        self._early_stop = threading.Event()
        if consumer:
            # Every rank attaches at start (the scheduler says yes only once
            # every rank reads the store: its reports say so, or before the
            # first one, the segment's reader table).
            self._check_rank()
            if self.remote_reader is not None and self.remote_reader.get() is None:
                # The store of fetched outputs does not exist yet: vLLM
                # builds the scheduler, which makes it, after the workers.
                # A thread attaches as soon as it appears, so that the
                # scheduler sees this rank's entry before the first step.
                self._early = threading.Thread(target=self._attach_early, name="pinshm-ec-attach", daemon=True)
                self._early.start()

    # ---- the writer -------------------------------------------------

    def _create(self) -> Optional[ObjectStore]:
        s = self.settings
        size = s.size
        if s.reserve and not s.size_given:
            size = default_reserved(s.size)
            if size < MIN_RESERVED:
                # A default that no longer fits (others took /dev/shm since
                # the default was worked out): the engine goes on, saving nothing.
                logger.error("pinshm encoder cache: %s: nothing is saved", does_not_fit("size", s.size, s.store))
                return None
        capacity = size - size % ObjectStore.SLOT_ALIGN
        largest = ObjectStore.largest_object(capacity, s.n_readers)
        limit = largest if s.max_object_size is None else min(s.max_object_size, largest)
        try:
            store = ObjectStore(
                capacity,
                limit,
                s.n_readers,
                name=s.store,
                reserve=s.reserve,
                # Mapped in whole only where it is pinned (a CUDA driver):
                # vLLM's CPU workers count a mapped page as theirs, and a
                # prefaulted 760 MiB store left no room for the KV cache.
                prefault=s.reserve and bool(cuda_status().get("driver")),
                cache=True,
                key_index=s.key_index,
                shm_headroom=0 if s.reserve else shm_headroom() if s.shm_headroom is None else s.shm_headroom,
            )
        except NoSpaceError as e:
            if s.reserve and s.size_given:
                # A reserved store that cannot fit is the config's error:
                # the engine stops at start, told what size fits.
                raise ValueError(does_not_fit("size", s.size, s.store, 2 if s.peers else 1)) from e
            logger.error("pinshm encoder cache: cannot create store %r (%s): nothing is saved", s.store, e)
            return None
        except UntrustedError as e:
            # Someone else's file at the name (a squatter's): never mapped,
            # never replaced; the message names its owner and mode.
            logger.warning("pinshm encoder cache: store %r is not this engine's: saving is off (%s)", s.store, e)
            return None
        except (PinshmError, OSError, ValueError) as e:
            if os.path.exists(os.path.join("/dev/shm", s.store)):
                logger.warning(
                    "pinshm encoder cache: store %r has a live writer (another producer engine): "
                    "this engine reads it and saves nothing (%s)",
                    s.store,
                    e,
                )
            else:
                logger.error("pinshm encoder cache: cannot create store %r (%s): nothing is saved", s.store, e)
            return None
        # vLLM SIGKILLs its workers at shutdown: the reaper (_tracker)
        # unlinks the name then.
        self._tracked.add(s.store)
        return store

    def save(self, encoder_cache: MutableMapping[str, Any], mm_hash: str) -> None:
        """Saves the output of `mm_hash` unless it is saved already. A full
        store, an object too large, or anything else that fails is logged
        and skipped: the engine goes on."""
        store = self.store
        if store is None or mm_hash not in encoder_cache:
            return
        key = self.settings.key(mm_hash)
        self._settle()
        try:
            if store.is_cached(key) or store.is_pending(key):
                self.already += 1
                return
            # Queued, never waited for: a CUDA output's device-to-host copy
            # runs on pinshm's own stream of its device, after an event
            # recorded on the current stream (the engine's next kernels do
            # not queue behind it), and pinshm's poller publishes the slot
            # once the copy's event has completed (a lookup of the key is a
            # miss until then; a failed copy gives slot and key back).
            value = contiguous(encoder_cache[mm_hash])
            stream = copy_stream(value.device) if getattr(value, "is_cuda", False) else None
            pending = put_tensor(store, key, value, wait=False, stream=stream)
            if pending is not None and not pending.done:
                self._pending.append(pending)
            self.saved += 1
        except MemoryError as e:  # FullError, NoSpaceError: everything held
            self.unsaved += 1
            self._once("full", "pinshm encoder cache: store %r full, output not saved (%s)", self.settings.store, e)
        except Exception as e:  # noqa: BLE001 - a save never stops the engine
            self.unsaved += 1
            self._once(type(e).__name__, "pinshm encoder cache: output of %s not saved: %r", mm_hash, e)

    def _settle(self) -> None:
        """Forgets the saves that are over; counts those that failed."""
        if not self._pending:
            return
        still = []
        for p in self._pending:
            state = p.state
            if state == "pending":
                still.append(p)
            elif state != "published":
                self.saved -= 1
                self.unsaved += 1
                self._once("save-" + state, "pinshm encoder cache: a save of %s %s: %s", p.key, state, p.error)
        self._pending = still

    # ---- loads ------------------------------------------------------

    def load(self, step: int, loads: Sequence[LoadSpec], encoder_cache: MutableMapping[str, Any]) -> None:
        """Loads the step's outputs into `encoder_cache`. One that cannot be
        loaded is replaced by a placeholder of zeros (vLLM's model runner
        raises on a missing output) and its request is reported failed."""
        self._step = max(self._step, step)
        if self._placeholders:
            # Gone: vLLM evicted them (free_encoder_mm_hashes), or the
            # encoder wrote a real output over them.
            self._placeholders = {h: p for h, p in self._placeholders.items() if encoder_cache.get(h, None) is p}
        if not loads:
            return
        failed: set[FailedLoad] = set()
        for spec in loads:
            if spec.mm_hash in encoder_cache and spec.mm_hash not in self._placeholders:
                continue
            value = self._load_one(spec)
            if value is None:
                failed.add(FailedLoad(spec.request_id, spec.mm_hash, spec.epoch, spec.monotonic_id))
                self.failed += 1
                value = self._placeholder(spec)
                if value is None:
                    continue
                # Stands in for this step only: the scheduler fails every
                # request that uses it and has vLLM evict it.
                self._placeholders[spec.mm_hash] = value
            else:
                self.loaded += 1
                self._placeholders.pop(spec.mm_hash, None)
            encoder_cache[spec.mm_hash] = value
        self._report = self._report.merge(LoadReport(frozenset({step}), frozenset(failed)))

    def _load_one(self, spec: LoadSpec) -> Any:
        self._end_early()
        named = self.remote_reader if spec.remote else self.reader
        reader = None if named is None else named.for_epoch(spec.epoch)
        if reader is None:
            logger.warning(
                "pinshm encoder cache: output of %s not loaded: store %r is gone or was replaced",
                spec.mm_hash,
                self.settings.remote_store if spec.remote else self.settings.store,
            )
            return None
        handle = ObjectHandle(spec.address, spec.monotonic_id, spec.epoch)
        try:
            value = get_tensor(reader, handle, device=self.device)
        except Exception as e:  # noqa: BLE001 - StaleError and the like: reported, never raised
            logger.warning("pinshm encoder cache: output of %s not loaded: %r", spec.mm_hash, e)
            return None
        # The whole shape, and a float dtype: an output of another width
        # (another model's, a squatted store's, a lying peer's) would go
        # into vLLM's encoder cache and fail or mislead the model.
        shape = tuple(getattr(value, "shape", ()))
        width = self.width_of(spec.modality) if self.width_of is not None else None
        want = (spec.num_embeds, "?" if width is None else width)
        kind = str(getattr(value, "dtype", "?"))
        if (
            len(shape) != 2
            or shape[0] != spec.num_embeds
            or (width is not None and shape[1] != width)
            or "float" not in kind
        ):
            logger.warning(
                "pinshm encoder cache: output of %s is a %s tensor of shape %s, vLLM expects (%d, %s) "
                "floats: not loaded",
                spec.mm_hash,
                kind,
                shape,
                *want,
            )
            return None
        return convert(value, self.dtype)

    def _placeholder(self, spec: LoadSpec) -> Any:
        width = self.width_of(spec.modality) if self.width_of is not None else None
        if width is None:
            logger.error(
                "pinshm encoder cache: no placeholder width for %s: vLLM's runner will stop on the missing output",
                spec.mm_hash,
            )
            return None
        return zeros((spec.num_embeds, width), self.dtype, self.device)

    def _attach_early(self) -> None:
        """Tries to attach the store of fetched outputs every
        REMOTE_RETRY_S until it is attached, the first step begins
        (:meth:`_end_early`), or EARLY_ATTACH_S have passed."""
        remote = self.remote_reader
        deadline = time.monotonic() + EARLY_ATTACH_S
        while remote is not None and not self._early_stop.wait(REMOTE_RETRY_S):
            if remote.get() is not None or time.monotonic() > deadline:
                return

    def _end_early(self) -> None:
        """Stops the thread of :meth:`_attach_early` and waits for it (at
        most one attach), so that the remote reader has one user again."""
        t = self._early
        if t is not None:
            self._early = None
            self._early_stop.set()
            if t is not threading.current_thread() and t.ident is not None:
                t.join()

    def _check_rank(self) -> None:
        """Attaches (at the reader's pace) and notes this rank's state for
        the next report when it changed; lets go of readers of segments
        moved from once no load can need them."""
        self._end_early()
        reader = self.reader.get()
        remote = None if self.remote_reader is None else self.remote_reader.get()
        remote_epoch = None if remote is None else remote.epoch
        if reader is not None:
            state = RankState(self.rank, reader.epoch, remote_epoch=remote_epoch)
        else:
            why = self.reader.last_error or "no store yet"
            state = RankState(self.rank, None, why, self.reader.no_entry, remote_epoch)
        if state != self._state:
            if self._state is not None and self._state.epoch is not None:
                self._moved_at.setdefault(self._state.epoch, self._step)
            self._state, self._state_told = state, False
        for epoch in self.reader.previous_epochs:
            if self._step - self._moved_at.setdefault(epoch, self._step) > KEEP_PREVIOUS_STEPS:
                self.reader.drop_previous(epoch)
                del self._moved_at[epoch]

    @property
    def state(self) -> Optional[RankState]:
        """This rank's state as last checked (None: not a consumer)."""
        return self._state

    def take_report(self) -> LoadReport:
        """What this worker loaded and failed since the last call, and its
        rank's state if that changed since it was last told."""
        if self.consumer:
            self._check_rank()
        report, self._report = self._report, LoadReport()
        # Told when it changes, and again with every report there is (a
        # report that never arrives is made up for by the next one).
        if self._state is not None and (report or not self._state_told):
            self._state_told = True
            report = report.merge(LoadReport(ranks=frozenset({self._state})))
        return report

    def _once(self, what: str, msg: str, *args: object) -> None:
        if what in self._warned:
            logger.debug(msg, *args)
        else:
            self._warned.add(what)
            logger.warning(msg, *args)

    def close(self) -> None:
        """Detaches the reader; the writer removes the store. Twice is fine."""
        self._end_early()
        self.reader.close()
        if self.remote_reader is not None:
            self.remote_reader.close()
        store, self.store = self.store, None
        if store is not None:
            try:
                # Saves still in flight get a moment; what is left is
                # discarded by close, never published.
                store.flush_pending(timeout=CLOSE_FLUSH_S)
                self._settle()
                store.close()
            except (PinshmError, OSError) as e:
                if getattr(e, "errno", None) != errno.ENOENT:
                    logger.debug("pinshm encoder cache: closing store %r: %s", self.settings.store, e)
        self._tracked.clear()


def contiguous(value: Any) -> Any:
    """`value` (a torch tensor or a numpy array) laid out contiguously."""
    is_contiguous = getattr(value, "is_contiguous", None)
    if callable(is_contiguous):
        return value if is_contiguous() else value.contiguous()
    flags = getattr(value, "flags", None)
    if flags is not None and not flags.c_contiguous:
        import numpy as np

        return np.ascontiguousarray(value)
    return value


def convert(value: Any, dtype: Any) -> Any:
    """A torch tensor in `dtype` (the model's); anything else as it is."""
    if dtype is None or not hasattr(value, "to") or getattr(value, "dtype", dtype) == dtype:
        return value
    return value.to(dtype)


def zeros(shape: tuple[int, int], dtype: Any, device: Optional[str]) -> Any:
    """Zeros of `shape`: a torch tensor where torch is, else numpy float32."""
    try:
        import torch
    except ImportError:
        import numpy as np

        return np.zeros(shape, dtype=np.float32)
    return torch.zeros(shape, dtype=dtype if isinstance(dtype, torch.dtype) else None, device=device)
