"""The harness's in-process probe: which classes each process really runs.

Put on PYTHONPATH by run.py (with PINSHM_E2E_PROBE naming a file), it is
imported at the start of every Python process of the run: the API server
or LLM process, the engine core, every worker. It hooks two vLLM modules as
they are imported and appends one JSON line to the probe file

- each time a multimodal cache storage is built (``SingleWriterShmObjectStorage``,
  vLLM's or pinshm's): its class, writer or reader;
- each time a MessageQueue is built (either class, as writer or from a
  handle);
- with the sender cache's hit count after every item;
- each time the model's encoder runs (``embed_multimodal``), with the
  number of items it encoded and the seconds it took;
- for an encoder-cache connector (any: vLLM's or pinshm's), each
  ``has_cache_item`` answer (scheduler), each load (items that
  ``start_load_caches`` put into the encoder cache) and each
  ``save_caches`` call (workers).

The lines come from the constructors themselves, so they say what ran,
whatever was logged. Nothing here changes behaviour.
"""

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

_PATH = os.environ.get("PINSHM_E2E_PROBE")


def _record(**kw):
    kw.update(pid=os.getpid(), ppid=os.getppid())
    line = json.dumps(kw, default=str) + "\n"
    # One write of a short line with O_APPEND: lines from many processes
    # do not interleave.
    fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _name(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def _wrap_storage(cls):
    if getattr(cls, "_e2e_probed", False):
        return
    init = cls.__init__

    def __init__(self, *a, **kw):
        init(self, *a, **kw)
        _record(what="storage", cls=_name(type(self)), writer=bool(self.is_writer))

    cls.__init__ = __init__
    cls._e2e_probed = True


def _wrap_queue(cls):
    if getattr(cls, "_e2e_probed", False):
        return
    init = cls.__init__
    from_handle = cls.create_from_handle

    def __init__(self, *a, **kw):
        init(self, *a, **kw)
        _record(what="queue", cls=_name(type(self)), writer=True)

    def create_from_handle(handle, rank):
        q = from_handle(handle, rank)
        _record(what="queue", cls=_name(type(q)), writer=False, rank=rank)
        return q

    cls.__init__ = __init__
    cls.create_from_handle = staticmethod(create_from_handle)
    cls._e2e_probed = True


def _after_cache_shm(mod):
    sender = mod.ShmObjectStoreSenderCache
    get_and_update = sender.get_and_update_item

    def get_and_update_item(self, mm_item, mm_hash):
        out = get_and_update(self, mm_item, mm_hash)
        _record(what="cache_stat", hits=self._hits, total=self._total)
        return out

    sender.get_and_update_item = get_and_update_item
    # Whatever class the names point to when a cache is built: wrap both
    # vLLM's (now) and pinshm's (imported here, before the plugin runs).
    _wrap_storage(mod.SingleWriterShmObjectStorage)
    try:
        from pinshm.vllm.cache import SingleWriterShmObjectStorage
    except Exception:  # noqa: BLE001 - pinshm not installed: stock only
        pass
    else:
        _wrap_storage(SingleWriterShmObjectStorage)


def _after_shm_broadcast(mod):
    _wrap_queue(mod.MessageQueue)
    try:
        from pinshm.vllm.queue import MessageQueue
    except Exception:  # noqa: BLE001
        pass
    else:
        _wrap_queue(MessageQueue)
        _count_detours(MessageQueue)


def _count_detours(cls):
    """Records each message pinshm's queue sent the other way (in pieces)."""
    if getattr(cls, "_e2e_detours", False):
        return
    enqueue = cls.enqueue

    def counted(self, *a, **kw):
        try:
            return enqueue(self, *a, **kw)
        finally:
            d = getattr(self, "detours", None)
            if d is not None and d.messages > getattr(self, "_e2e_detours_seen", 0):
                self._e2e_detours_seen = d.messages
                _record(what="detour", queue=id(self), messages=d.messages, bytes=d.bytes)

    cls.enqueue = counted
    cls._e2e_detours = True


def _after_llava(mod):
    cls = mod.LlavaForConditionalGeneration
    embed = cls.embed_multimodal

    def embed_multimodal(self, **kwargs):
        t0 = time.monotonic()
        out = embed(self, **kwargs)
        s = time.monotonic() - t0  # the encoder's own time (CPU: synchronous)
        _record(what="encode", items=len(out) if out is not None else 0, s=s, t=time.time())
        return out

    cls.embed_multimodal = embed_multimodal


def _probe_connector(c):
    """Wraps one connector instance's methods (vLLM calls them on it)."""
    has, load, save = c.has_cache_item, c.start_load_caches, c.save_caches

    def fetches():  # pinshm's scheduler side: outputs fetched from peers so far
        return getattr(getattr(c, "_scheduler", None), "remote_hits", 0)

    def has_cache_item(identifier):
        before = fetches()
        hit = has(identifier)
        _record(what="ec_lookup", hit=bool(hit), fetched=fetches() > before, t=time.time())
        return hit

    def start_load_caches(encoder_cache, **kwargs):
        n = len(encoder_cache)
        load(encoder_cache, **kwargs)
        if len(encoder_cache) > n:
            _record(what="ec_load", items=len(encoder_cache) - n, t=time.time())

    def save_caches(encoder_cache, mm_hash, **kwargs):
        save(encoder_cache=encoder_cache, mm_hash=mm_hash, **kwargs)
        _record(what="ec_save", t=time.time())

    c.has_cache_item = has_cache_item
    c.start_load_caches = start_load_caches
    c.save_caches = save_caches


def _after_ec_factory(mod):
    factory = mod.ECConnectorFactory
    create = factory.create_connector.__func__

    def create_connector(cls, config, role):
        c = create(cls, config, role)
        _probe_connector(c)
        _record(what="ec_connector", cls=_name(type(c)), role=str(role))
        return c

    factory.create_connector = classmethod(create_connector)


_HOOKS = {
    "vllm.multimodal.cache.shm": _after_cache_shm,
    "vllm.distributed.device_communicators.shm_broadcast": _after_shm_broadcast,
    "vllm.model_executor.models.llava": _after_llava,
    "vllm.distributed.ec_transfer.ec_connector.factory": _after_ec_factory,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, hook):
        self.inner, self.hook = inner, hook

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        try:
            self.hook(module)
        except Exception as e:  # noqa: BLE001 - a probe never breaks the run
            _record(what="probe_error", module=module.__name__, error=repr(e))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        hook = _HOOKS.get(fullname)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, hook)
        return spec


if _PATH:
    sys.meta_path.insert(0, _Finder())
    _record(what="process", argv=sys.argv[:3])
