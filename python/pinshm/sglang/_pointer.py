"""The class bound in place of SGLang's ``ShmPointerMMData``.

It subclasses SGLang's own, under SGLang's own name and module, so every
``isinstance`` check in ``mm_utils``, pickle's lookup by name and the
msgpack hop's test by name (``ShmPointerMMData`` in a module ending
``.managers.mm_utils``) treat it as SGLang's. Its state is SGLang's four
keys; the pinshm reference rides in ``shm_name``, so a process without
the plugin that passes the object on (it unpickles and pickles again)
keeps it whole. A name that is not pinshm's (SGLang's Rust server builds
stubs of its own segments) goes to SGLang's code unchanged.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any, Optional

from .._pinshm import PinshmError
from . import _store

logger = logging.getLogger("pinshm.sglang")


def make(base: type) -> type:
    """The subclass of SGLang's `base` (``ShmPointerMMData``) that puts
    features into the tokenizer's pinshm store."""
    import torch

    class ShmPointerMMData(base):  # type: ignore[misc]
        #: Marks pinshm's class (the plugin binds it once per process).
        _pinshm_bound = True

        def __init__(self, tensor: Any, precomputed_hash: Optional[int] = None) -> None:
            w = _store.writer()
            if w is None:
                super().__init__(tensor, precomputed_hash=precomputed_hash)
                return
            self._shm_handle = None
            self.tensor = None
            self._materialization_error = None
            self._pinshm: Optional[_store.Ref] = None
            if not tensor.is_cpu:
                tensor = tensor.cpu()
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()
            self.shape = tensor.shape
            self.dtype = tensor.dtype
            self.precomputed_hash = precomputed_hash
            try:
                key = None
                if isinstance(precomputed_hash, int):
                    dims = "x".join(str(d) for d in tensor.shape)
                    key = f"h:{precomputed_hash:x}:{str(tensor.dtype).removeprefix('torch.')}:{dims}"
                ref = w.put(tensor.detach().reshape(-1).view(torch.uint8), key)
            except OSError:
                raise  # it does not fit: SGLang sends the tensor inline
            except Exception as e:
                # Whatever else fails here, SGLang's inline path still
                # carries the tensor (it catches OSError only).
                raise OSError(errno.EIO, f"pinshm store: {type(e).__name__}: {e}") from e
            self._pinshm = ref
            self.shm_name = ref.name()

        def __setstate__(self, state: dict[str, Any]) -> None:
            ref = _store.Ref.parse(str(state.get("shm_name", "")))
            if ref is None:
                super().__setstate__(state)
                self._pinshm = None
                return
            # Infallible, as SGLang's: every rank must finish the broadcast.
            self.shm_name = state["shm_name"]
            self.shape = state["shape"]
            self.dtype = state["dtype"]
            self.precomputed_hash = state.get("precomputed_hash")
            self._shm_handle = None
            self.tensor = None
            self._materialization_error = None
            self._pinshm = ref

        def materialize(self) -> Any:
            """The feature as a tensor over the slot itself: a private
            copy-on-write view of its pages (``StoreReader.get_private``),
            so no byte is copied unless this rank writes into it, and a
            write reaches no other rank. The slot is held for as long as
            the tensor (or anything made from its storage) lives."""
            ref = getattr(self, "_pinshm", None)
            if ref is None:
                return super().materialize()
            try:
                nbytes = self.dtype.itemsize
                for d in self.shape:
                    if int(d) < 0:
                        raise PinshmError(f"shape {tuple(self.shape)}")
                    nbytes *= int(d)
                view = _store.reader(ref.store).get_private(ref.handle)
                if len(view) != nbytes:  # a shape that lies reads nothing
                    raise PinshmError(f"{len(view)} bytes where {nbytes} were sent")
                if nbytes == 0:  # torch.frombuffer refuses an empty buffer
                    return torch.empty(tuple(self.shape), dtype=self.dtype)
                # The tensor's storage keeps `view` (and so the hold).
                return torch.frombuffer(view, dtype=self.dtype).reshape(tuple(self.shape))
            except Exception as e:
                raise RuntimeError(f"pinshm feature {self.shm_name}: {type(e).__name__}: {e}") from e

        def close_and_unlink(self) -> None:
            if getattr(self, "_pinshm", None) is None:
                super().close_and_unlink()
            # pinshm's: nothing held between reads, nothing to unlink.

        def __del__(self) -> None:
            if getattr(self, "_pinshm", None) is None and getattr(self, "_shm_handle", None) is not None:
                stock = getattr(super(), "__del__", None)
                if stock is not None:
                    stock()

    ShmPointerMMData.__module__ = base.__module__
    ShmPointerMMData.__qualname__ = base.__qualname__
    ShmPointerMMData.__doc__ = (base.__doc__ or "") + "\n    (pinshm: the feature lives in a pinshm store.)"
    return ShmPointerMMData


def hash_first(original: Any, obj: Any) -> Any:
    """Around SGLang's ``wrap_shm_features``: items still without a hash
    get SGLang's own (``MultimodalDataItem.set_pad_value``, which each
    scheduler rank would run anyway) before their features are wrapped,
    so a feature is keyed by its hash and a repeat is served from the
    store. With ``SGLANG_MM_PRECOMPUTE_HASH=1`` (the plugin's default)
    SGLang has hashed them already, once per prompt, in its own thread
    pool off the event loop, and this finds nothing to do; it catches
    what that pool leaves (and everything where the variable is 0), on
    the loop. ``PINSHM_SGLANG_HASH=0`` leaves hashing to the ranks (no
    reuse of features without a hash)."""
    from sglang.srt.managers import mm_utils

    try:
        mm = getattr(obj, "mm_inputs", None)
        if (
            mm is not None
            and os.environ.get("PINSHM_SGLANG_HASH", "1") != "0"
            and not mm_utils._get_is_default_transport()
            and not mm_utils.get_serving().skip_tokenizer_init
        ):
            for item in getattr(mm, "mm_items", None) or ():
                if getattr(item, "hash", None) is None and getattr(item, "pad_value", None) is None:
                    item.set_pad_value()
    except Exception as e:  # noqa: BLE001 - the ranks hash it, as without the plugin
        logger.debug("pinshm sglang: no hash for an item here: %s", e)
    try:
        return original(obj)
    finally:
        # What that put was sent for: its leases end when the request does.
        w = _store.current()
        if w is not None:
            w.claim(getattr(obj, "rid", None))
            _watch_finishes()


#: The tokenizer's method that takes each batch of outputs (a request's
#: last carries its finish reason).
OUTPUTS = "sglang.srt.managers.tokenizer_manager.TokenizerManager._handle_batch_output"
_WATCHING = False


def _watch_finishes() -> None:
    """Binds :func:`note_finished` before SGLang's tokenizer takes a batch
    of outputs, once, in the process that made a store (a tokenizer's),
    through SGLang's ``HookRegistry``. Where it cannot, leases end with
    their grace period only (as before)."""
    global _WATCHING
    if _WATCHING:
        return
    import sys

    module, _, _ = OUTPUTS.rpartition(".TokenizerManager.")
    if module not in sys.modules:  # not SGLang's tokenizer (yet: a test, another caller)
        return
    _WATCHING = True
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(OUTPUTS, note_finished, HookType.BEFORE)
        HookRegistry.apply_hooks()
        logger.info("pinshm sglang: a feature's lease ends when the requests that sent it finish")
    except Exception as e:  # noqa: BLE001 - the grace period still ends leases
        logger.info("pinshm sglang: leases end with their grace period only: %s: %s", type(e).__name__, e)


def note_finished(manager: Any, outputs: Any, *args: Any, **kwargs: Any) -> None:
    """Before SGLang's tokenizer takes a batch of outputs: each request
    whose output is its last (a finish reason: done, stopped, aborted) is
    done with its features on every rank, so the writer ends their leases
    (those no unfinished request sent). Never raises."""
    try:
        w = _store.current()
        rids = getattr(outputs, "rids", None)
        reasons = getattr(outputs, "finished_reasons", None)
        if w is None or not rids or not reasons:
            return None
        for rid, why in zip(rids, reasons):
            if why is not None:
                w.finished(rid)
    except Exception as e:  # noqa: BLE001 - SGLang's outputs go on
        logger.debug("pinshm sglang: a batch of outputs not looked at: %s", e)
    return None
