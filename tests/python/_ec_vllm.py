"""A stand-in for the few vLLM modules the encoder-cache connector imports
(CI has no vLLM), and an engine that calls the connector as vLLM 0.32's V1
scheduler and model runner do, with its workers in real processes.

The stand-in's base class keeps the shape of vLLM's ``ECConnectorBase``
(``vllm/distributed/ec_transfer/ec_connector/base.py``): the constructor
reads the roles from ``ec_transfer_config``, the metadata is bound before
the model runs and cleared after, and the abstract methods are the same.
The engine keeps vLLM's order of calls: ``has_cache_item`` for an input
not in the engine's own encoder cache, ``update_state_after_alloc`` for
every input given space, ``build_connector_meta`` once a step; in each
worker ``start_load_caches`` (consumers) before the encoder runs,
``save_caches`` after each output, ``build_connector_worker_meta`` last;
then ``take_unavailable_requests`` BEFORE ``update_connector_output``
(vllm/v1/core/sched/scheduler.py, update_from_output).
"""

import hashlib
import os
import pickle
import sys
import time
import types
from functools import reduce

import numpy as np

from _ec_stand_in import STAND_IN

MODEL = "stand-in/tiny-llava"
WIDTH = 64
ROWS = 64  # an output is ROWS x WIDTH float32: 16 KiB


def install(root, on_path=True):
    """Writes the stand-in under `root` and (`on_path`) puts it first on
    sys.path (so spawned children, which take the parent's sys.path, import
    it too)."""
    for rel, text in STAND_IN.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    if on_path and root not in sys.path:
        sys.path.insert(0, str(root))


def config(role, extra, model=MODEL, tp=1):
    """The parts of a VllmConfig the connector reads."""
    ec = types.SimpleNamespace(
        ec_connector="PinshmECConnector",
        ec_connector_module_path="pinshm.vllm.ec_connector",
        ec_role=role,
        is_ec_producer=role in ("ec_producer", "ec_both"),
        is_ec_consumer=role in ("ec_consumer", "ec_both"),
        ec_connector_extra_config=dict(extra),
        mm_encoder_output_widths={},
    )
    model_config = types.SimpleNamespace(model=model, revision=None, dtype=None, get_inputs_embeds_size=lambda: WIDTH)
    parallel_config = types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1)
    return types.SimpleNamespace(ec_transfer_config=ec, model_config=model_config, parallel_config=parallel_config)


def encode(mm_hash, rows=ROWS):
    """The stand-in encoder: an output that only `mm_hash` gives."""
    seed = int(hashlib.sha256(mm_hash.encode()).hexdigest()[:8], 16)
    return np.random.default_rng(seed).standard_normal((rows, WIDTH), dtype=np.float32)


def digest(value):
    return hashlib.sha256(np.ascontiguousarray(np.asarray(value)).tobytes()).hexdigest()


class Feature:
    def __init__(self, mm_hash, rows):
        self.identifier = mm_hash
        self.modality = "image"
        # Where its tokens lie in the prompt (vLLM's PlaceholderRange).
        self.mm_position = types.SimpleNamespace(offset=0, length=rows, get_num_embeds=lambda: rows)


class Request:
    """A request with one image per hash, as vLLM's Request shows them."""

    def __init__(self, request_id, hashes, rows=ROWS):
        self.request_id = request_id
        self.mm_features = [Feature(h, rows) for h in hashes]

    def get_num_encoder_embeds(self, index):
        return self.mm_features[index].mm_position.get_num_embeds()


# ---- a worker process -------------------------------------------------


def worker_main(conn, role, extra, rank, model=MODEL, tp=1):
    """A vLLM worker: its connector (WORKER role), its encoder cache, and
    the model runner's calls, one step per message."""
    # Dies with the test's process, as vLLM's workers do with their
    # engine: a test process that crashes leaves no worker blocked on its
    # pipe (holding the output of whatever ran the tests).
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        os._exit(1)  # the test process died before the line above
    os.environ["STAND_IN_TP_RANK"] = str(rank)
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from pinshm.vllm.ec_connector import PinshmECConnector

    c = PinshmECConnector(config(role, extra, model, tp), ECConnectorRole.WORKER)
    cache = {}
    encoded = 0
    conn.send(("ready", c._worker.store is not None))
    while True:
        msg = conn.recv()
        op = msg[0]
        if op == "step":
            _, meta_bytes, compute, wanted, freed = msg
            # vLLM's _update_states: the scheduler's evictions first.
            for h in freed:
                cache.pop(h, None)
            c.bind_connector_metadata(pickle.loads(meta_bytes))
            if c.is_consumer:
                c.start_load_caches(cache)
            for h, rows in compute:
                cache[h] = encode(h, rows)
                encoded += 1
                c.save_caches(encoder_cache=cache, mm_hash=h)
            # The model runner's gather: a missing output stops it.
            missing = [h for h in wanted if h not in cache]
            got = {h: digest(cache[h]) for h in wanted if h in cache}
            meta = c.build_connector_worker_meta()
            c.clear_connector_metadata()
            conn.send(("done", pickle.dumps(meta), got, missing))
        elif op == "save":  # the writer saves outputs nobody scheduled
            for h in msg[1]:
                cache[h] = encode(h)
                c.save_caches(encoder_cache=cache, mm_hash=h)
                del cache[h]
            conn.send(("saved",))
        elif op == "forget":  # vLLM's own encoder cache let them go
            cache.clear()
            conn.send(("forgot",))
        elif op == "stats":
            w = c._worker
            conn.send(("stats", dict(saved=w.saved, already=w.already, unsaved=w.unsaved,
                                     loaded=w.loaded, failed=w.failed, encoded=encoded)))
        elif op == "stop":
            c.shutdown()
            conn.send(("bye",))
            return


class EncoderCacheManager:
    """vLLM's scheduler-side encoder cache bookkeeping
    (vllm/v1/core/encoder_cache_manager.py), the parts the engine and the
    connector's eviction use, with vLLM's attribute names: `cached` maps a
    hash to the requests that reference it (empty: freeable, evicted when
    room is needed), `freed` lists what the workers must drop."""

    def __init__(self, cache_size=1 << 30):
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.num_freeable_slots = cache_size
        self.cached = {}
        self.num_embeds_by_hash = {}
        self.request_cached_ids = {}
        self.freeable = {}
        self.freed = []

    def check_and_update_cache(self, request, input_id):
        h = request.mm_features[input_id].identifier
        if h not in self.cached:
            return False
        if not self.cached[h]:
            self.num_freeable_slots -= self.freeable.pop(h)
        self.cached[h].add(request.request_id)
        self.request_cached_ids.setdefault(request.request_id, set()).add(input_id)
        return True

    def allocate(self, request, input_id):
        h = request.mm_features[input_id].identifier
        n = request.get_num_encoder_embeds(input_id)
        self.cached.setdefault(h, set()).add(request.request_id)
        self.num_embeds_by_hash.setdefault(h, n)
        self.request_cached_ids.setdefault(request.request_id, set()).add(input_id)
        self.num_free_slots -= n
        self.num_freeable_slots -= n
        assert self.num_free_slots >= 0 and self.num_freeable_slots >= 0

    def free(self, request):
        for input_id in list(self.request_cached_ids.pop(request.request_id, ())):
            h = request.mm_features[input_id].identifier
            if not self.cached.get(h):
                continue
            self.cached[h].discard(request.request_id)
            if not self.cached[h]:
                n = self.num_embeds_by_hash[h]
                self.freeable[h] = n
                self.num_freeable_slots += n

    def evict_all(self):
        """What can_allocate does when it needs the room of every freeable entry."""
        for h in list(self.freeable):
            self.num_free_slots += self.freeable.pop(h)
            del self.cached[h]
            del self.num_embeds_by_hash[h]
            self.freed.append(h)

    def get_freed_mm_hashes(self):
        freed = [h for h in self.freed if h not in self.cached]
        self.freed = []
        return freed


class Engine:
    """One engine: worker processes (started first, as vLLM's executor
    starts them before the scheduler exists) and this process's scheduler
    connector, made in this constructor as vLLM's Scheduler makes it (and
    held, like vLLM's, as `ec_connector` beside `encoder_cache_manager`).
    `images` of a step: one request per image. As in vLLM, a request's
    encoder inputs are freed once its prefill step has run (the connector
    is told, `update_state_after_free`), and it finishes DECODE_STEPS steps
    later, before the step's failed requests are taken: a request failed
    after that has completed all the same (`wrong_answers` counts it). A
    plan may be scheduled ahead of the step that runs it (`schedule`, then
    `execute` later), as vLLM's async scheduling does."""

    DECODE_STEPS = 2

    WAIT_S = 60

    def __init__(self, ctx, role, extra, tp=1, model=MODEL):
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

        from pinshm.vllm.ec_connector import PinshmECConnector

        self.procs, self.conns = [], []
        try:
            for rank in range(tp):
                a, b = ctx.Pipe()
                p = ctx.Process(target=worker_main, args=(b, role, extra, rank, model, tp))
                p.start()
                self.procs.append(p)
                self.conns.append(a)
            self.writes = [self._recv(a)[1] for a in self.conns]
            self.ec_connector = PinshmECConnector(config(role, extra, model, tp), ECConnectorRole.SCHEDULER)
            self.encoder_cache_manager = EncoderCacheManager()
        except BaseException:
            self.kill()
            raise
        self.scheduler = self.ec_connector
        self.closed = False
        self.failed = set()
        self.running = {}  # request id -> (hash, rows, digests on every rank, the step it finishes in)
        self.completed = {}  # request id -> (hash, rows, digests on every rank): finished, whatever came later
        self._n = 0
        self._steps = 0
        self.waiting = []  # requests deferred by ensure_cache_available
        self.deferrals = 0

    @property
    def cached(self):
        return self.encoder_cache_manager.cached

    def _recv(self, conn):
        if not conn.poll(self.WAIT_S):
            raise AssertionError("a worker did not answer")
        return conn.recv()

    def _all(self, *msg):
        for a in self.conns:
            a.send(msg)
        return [self._recv(a) for a in self.conns]

    def schedule(self, images, rows=ROWS):
        """The scheduler's half of a step: the step's plan (metadata built).
        As vLLM's waiting queue: each new request (one per image) is asked
        `ensure_cache_available` first, and one it says False for waits
        for a later step (`waiting`), while the others are scheduled."""
        s, m = self.scheduler, self.encoder_cache_manager
        compute, wanted, loads, requests = [], [], [], []
        for h in images:
            self._n += 1
            self.waiting.append(Request(f"req-{self._n}", [h], rows))
        waiting, self.waiting = self.waiting, []
        for req in waiting:
            if not s.ensure_cache_available(req, 0):
                self.waiting.append(req)
                self.deferrals += 1
                continue
            h = req.mm_features[0].identifier
            requests.append(req)
            wanted.append(h)
            if m.check_and_update_cache(req, 0):
                continue
            if s.has_cache_item(h):
                loads.append(h)
            else:
                compute.append((h, req.get_num_encoder_embeds(0)))
            m.allocate(req, 0)
            s.update_state_after_alloc(req, 0)
        freed = m.get_freed_mm_hashes()
        # vLLM's SchedulerOutput: a step with every request deferred and
        # none running schedules no token (and runs no model).
        tokens = len(requests) + len(self.running)
        meta = s.build_connector_meta(types.SimpleNamespace(total_num_scheduled_tokens=tokens))
        return types.SimpleNamespace(
            meta=meta, compute=compute, wanted=wanted, loads=loads, requests=requests, freed=freed
        )

    def execute(self, plan, meta=None):
        """The workers' half, then the scheduler's update from the output,
        in vLLM's order: the step's requests finish (their encoder inputs
        freed), take_unavailable_requests, then update_connector_output.
        Returns the step's result."""
        msg = ("step", pickle.dumps(meta if meta is not None else plan.meta), plan.compute, plan.wanted, plan.freed)
        replies = self._all(*msg)
        self._steps += 1
        # vLLM's update_from_output: the requests first (prefill done: their
        # encoder inputs freed; the finished ones out), then the failed
        # requests taken, then the connector's output.
        for req in plan.requests:
            h = req.mm_features[0].identifier
            rows = req.get_num_encoder_embeds(0)
            self.running[req.request_id] = (h, rows, [r[2].get(h) for r in replies], self._steps + self.DECODE_STEPS)
            self.encoder_cache_manager.free(req)
            self.scheduler.update_state_after_free(req, 0)
        for rid, (h, rows, digests, last) in list(self.running.items()):
            if last <= self._steps:
                self.completed[rid] = (h, rows, digests)
                del self.running[rid]
        metas = [pickle.loads(r[1]) for r in replies]
        metas = [m for m in metas if m is not None]
        self._take_unavailable()
        if metas:
            agg = reduce(lambda x, y: x.aggregate(y), metas)
            self.scheduler.update_connector_output(types.SimpleNamespace(ec_connector_worker_meta=agg))
        return types.SimpleNamespace(
            loads=plan.loads,
            computed=[h for h, _ in plan.compute],
            digests=[r[2] for r in replies],
            missing=[r[3] for r in replies],
            requests=[req.request_id for req in plan.requests],
            steps=1,
        )

    def _take_unavailable(self):
        failed = self.scheduler.take_unavailable_requests()
        self.failed |= failed
        for rid in failed:
            self.running.pop(rid, None)  # a finished request stays finished

    def step(self, images, rows=ROWS):
        """One engine step with `images`' requests, then more (with nothing
        new) until no request waits: the result of them all. Each step
        runs the requests that are not deferred, as vLLM's do."""
        r = self.execute(self.schedule(images, rows))
        deadline = time.monotonic() + self.WAIT_S
        while self.waiting:
            assert time.monotonic() < deadline, "a request was deferred past every budget"
            time.sleep(0.002)
            more = self.execute(self.schedule([], rows))
            r.loads += more.loads
            r.computed += more.computed
            r.requests += more.requests
            for mine, theirs in zip(r.digests, more.digests):
                mine.update(theirs)
            for mine, theirs in zip(r.missing, more.missing):
                mine.extend(theirs)
            r.steps += 1
        # In the order of the images (deferred requests ran later).
        order = {h: i for i, h in reversed(list(enumerate(images)))}
        r.loads.sort(key=lambda h: order.get(h, len(order)))
        r.computed.sort(key=lambda h: order.get(h, len(order)))
        return r

    def wrong_answers(self):
        """Requests that completed with an output other than the encoder's,
        on any rank (the engine first runs until every request is done)."""
        while self.running:
            self.step([])
        return {
            rid: h
            for rid, (h, rows, digests) in self.completed.items()
            if any(d is not None and d != digest(encode(h, rows)) for d in digests)
        }

    def forget(self):
        """vLLM's own encoder cache evicts everything it may, and a step
        (with nothing to run) tells the workers to drop it, as vLLM's next
        scheduler output does."""
        self.encoder_cache_manager.evict_all()
        self.step([])

    def save(self, images):
        """Rank 0's connector saves outputs no request scheduled (a lap of puts)."""
        self.conns[0].send(("save", list(images)))
        self._recv(self.conns[0])

    def stats(self):
        return [r[1] for r in self._all("stats")]

    def close(self):
        if self.closed:
            return
        self.closed = True
        try:
            self.scheduler.shutdown()
            self._all("stop")
            for p in self.procs:
                p.join(self.WAIT_S)
        finally:
            self.kill()

    def kill(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()


def consumer_engine_main(conn, extra, tp, images, start_method):
    """A whole consumer engine in this (spawned) process: its scheduler
    here, its workers in processes of their own. Reports each image's
    digests on every rank and the workers' counters."""
    import multiprocessing as mp

    e = Engine(mp.get_context(start_method), "ec_consumer", extra, tp=tp)
    try:
        e.step([])  # the ranks report that they read the store
        r = e.step(images)
        conn.send(("result", r.loads, r.computed, r.digests, r.missing, e.stats()))
    finally:
        e.close()
