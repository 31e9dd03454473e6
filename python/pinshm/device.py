"""Tensors into and out of slots on any device.

`put_tensor` stores a torch tensor (on any device) or a numpy array (or
anything numpy takes through DLPack or the buffer protocol) as a tensor
object, copied once, straight into the slot: the writer reserves the slot
(`ObjectStore.reserve_tensor`), the copy writes it in place, and the
object is published once the copy is complete. For a CUDA tensor the copy
is torch's device-to-host copy into the slot, queued on the current stream
and completed on a CUDA event; where the store's mapping is pinned (a
reserved store in a process with a CUDA driver), that copy is a DMA into
the slot with no staging buffer (the GPU kit's py_encoder_cache.py: 44
GB/s for 32 MiB on an H200, docs/gpu.md).

`put_tensor(..., wait=False)` is the save that never stalls a step: the
copy is queued, the call returns a `PendingSave`, and pinshm's poller
thread publishes the slot once the copy's event has completed
(`ObjectStore.publish_after`). Until then the key is pending
(`ObjectStore.is_pending`): lookups miss it, and a second save of it is a
no-op that returns None. `ObjectStore.flush_pending()` waits for them all.
Where the slot is not pinned memory (a sparse store), the copy goes to a
pinned staging tensor instead (CUDA copies into pageable memory
synchronously), which pinshm copies into the slot once the event has
completed. With `stream=copy_stream(device)` the copy runs on pinshm's own
stream, ordered after the current stream's work by an event, so the
engine's next kernels do not queue behind it (the encoder-cache
connector's saves do this).

`get_tensor` copies an object out to a device: a host-to-device copy
queued from the slot itself (pinned where the reader's mapping is), the
read released once the copy has completed. With a release gate installed
(`pinshm.cuda_release.install()`), the release waits for the copy's
event without blocking anyone; without one, `get_tensor` waits for the
copy's event itself before it releases the read.

Neither needs torch: without it, numpy arrays go in and come out.

Not the methods of the same names: `ObjectStore.put_tensor` stores a
numpy array and waits for nothing, and `StoreReader.get_tensor` returns a
zero-copy numpy view over the slot that holds the read. The object format
is the same, so either side reads what the other stores; the contracts
(devices, copies, waiting) differ, which is why these are module
functions taking the store or reader first.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Any, Literal, Optional, Union, overload

from ._pinshm import (
    ObjectHandle,
    ObjectStore,
    PendingSave,
    StoreReader,
    TensorReservation,
    has_release_gate,
)

__all__ = ["copy_stream", "get_tensor", "put_tensor"]


def _is_torch(t: Any) -> bool:
    return type(t).__module__.split(".")[0] == "torch"


def _torch() -> Any:
    """torch, imported only when asked for (pinshm does not need it)."""
    import importlib

    return sys.modules.get("torch") or importlib.import_module("torch")


def _torch_view(torch: Any, buffer: Any, dtype: Any, shape: tuple[int, ...]) -> Any:
    """A tensor over `buffer` (no copy). torch.frombuffer warns on a
    read-only buffer (a reader's slot): nothing writes through it here."""
    numel = 1
    for n in shape:
        numel *= n
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


@overload
def put_tensor(
    store: ObjectStore, key: str, tensor: Any, *, wait: Literal[True] = ..., stream: Any = ...
) -> ObjectHandle: ...
@overload
def put_tensor(
    store: ObjectStore, key: str, tensor: Any, *, wait: Literal[False], stream: Any = ...
) -> Optional[PendingSave]: ...
@overload
def put_tensor(
    store: ObjectStore, key: str, tensor: Any, *, wait: bool, stream: Any = ...
) -> Union[ObjectHandle, PendingSave, None]: ...


def put_tensor(
    store: ObjectStore, key: str, tensor: Any, *, wait: bool = True, stream: Any = None
) -> Union[ObjectHandle, PendingSave, None]:
    """Stores `tensor` under `key`, copied once, straight into the slot.

    A torch tensor on any device (any strides), or a numpy array (anything
    `numpy.asarray` takes). Errors as `ObjectStore.put`: InvalidArgumentError
    for a duplicate key or an object too large, FullError or NoSpaceError
    (MemoryErrors) when there is no room. Nothing is published on error,
    and the key and slot are free again at once.

    `wait=True` (default) returns the handle once the object is published
    (for a CUDA tensor, after waiting for the copy). `wait=False` never
    waits for a device copy: it returns a `PendingSave`, published by
    pinshm's poller once the copy's CUDA event has completed (a host
    tensor's copy is done in the call: its save is published already), or
    None, copying nothing, if a save of `key` is pending already. A CUDA
    tensor saved so is kept alive until its copy completes; it must not be
    written meanwhile from another stream than the current one.

    `stream` (a `torch.cuda.Stream` of the tensor's device, `wait=False`
    only): the copy runs there instead of on the current stream, after an
    event recorded on the current stream (so after whatever produced the
    tensor), and the current stream's later work never waits behind it;
    `copy_stream(device)` gives pinshm's own stream per device. The tensor
    is kept alive (a reference the poller drops once the copy's event has
    completed), so the caching allocator cannot hand its memory to a new
    tensor before the copy has read it.
    """
    if not wait and store.is_pending(key):
        return None
    if _is_torch(tensor):
        torch = _torch()
        name = str(tensor.dtype).removeprefix("torch.")
        shape = tuple(int(n) for n in tensor.shape)
        r = store.reserve_tensor(key, name, list(shape))
        if not wait and tensor.is_cuda:
            try:
                done, staged = _queue_d2h(torch, r, tensor, shape, stream)
            except BaseException:
                store.abort(r)
                raise
            return store.publish_after(r, done, staged)
        try:
            _fill_torch(torch, r, tensor, shape)
        except BaseException:
            store.abort(r)
            raise
        return store.publish(r) if wait else store.publish_after(r, None)
    import numpy as np

    array = np.asarray(tensor)
    r = store.reserve_tensor(key, array.dtype.name, list(array.shape))
    try:
        _fill_numpy(np, r, array)
    except BaseException:
        store.abort(r)
        raise
    return store.publish(r) if wait else store.publish_after(r, None)


class _CopyDone:
    """A queued copy's event, and its source kept alive until the event
    has completed (pinshm drops this once `query()` is true)."""

    def __init__(self, event: Any, source: Any) -> None:
        self._event = event
        self._source = source

    def query(self) -> bool:
        return bool(self._event.query())

    def synchronize(self) -> None:
        self._event.synchronize()


def _queue_d2h(
    torch: Any, r: TensorReservation, tensor: Any, shape: tuple[int, ...], stream: Any = None
) -> tuple[_CopyDone, Any]:
    """Queues the copy of CUDA `tensor` on `stream` (None: the current
    stream of its device; a side stream first waits for an event recorded
    on the current one) and returns the event recorded after it (not
    waited for), and what the copy writes if not the slot: where the slot
    is not pinned memory (a sparse store, or no registration), a copy into
    it would not be asynchronous (CUDA waits for a copy into pageable
    memory), so the copy goes to a pinned staging tensor, which pinshm
    copies into the slot once the event has completed. If queueing raises,
    waits for whatever was queued, then raises (the slot is given back only
    once nothing can write it)."""
    dst = _torch_view(torch, r, tensor.dtype, shape)
    try:
        with torch.cuda.device(tensor.device):
            src = tensor.detach()
            staging = None if _is_pinned(dst) else _pinned_empty(torch, shape, tensor.dtype)
            side = contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)
            if stream is not None:
                produced = torch.cuda.Event()
                produced.record(torch.cuda.current_stream())
            with side:
                if stream is not None:
                    stream.wait_event(produced)
                try:
                    (dst if staging is None else staging).copy_(src, non_blocking=True)
                except BaseException:
                    failed = torch.cuda.Event()
                    failed.record()
                    failed.synchronize()
                    raise
                done = torch.cuda.Event()
                done.record()
            staged = None if staging is None else staging.reshape(-1).view(torch.uint8).numpy()
            return _CopyDone(done, src), staged
    finally:
        # The view goes before the reservation is handed on.
        del dst


_COPY_STREAMS: dict[tuple[int, int], Any] = {}


def copy_stream(device: Any) -> Any:
    """pinshm's own CUDA stream for device-to-host saves on `device` (a
    torch device or index), made once per process and device (a forked
    child, which cannot use its parent's CUDA, makes its own): pass it as
    `put_tensor(..., wait=False, stream=...)` so that saves never queue
    behind, nor ahead of, the engine's own work."""
    torch = _torch()
    index = torch.device(device).index if not isinstance(device, int) else device
    if index is None:
        index = torch.cuda.current_device()
    key = (os.getpid(), index)
    s = _COPY_STREAMS.get(key)
    if s is None:
        s = _COPY_STREAMS[key] = torch.cuda.Stream(device=index)
    return s


def _is_pinned(t: Any) -> bool:
    """Whether host tensor `t` is page-locked memory a CUDA copy can write
    asynchronously (an empty one needs no copy)."""
    return t.numel() == 0 or bool(t.is_pinned())


def _pinned_empty(torch: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """A pinned host tensor from torch's caching host allocator (which
    reuses the block only once the copies recorded on it are done)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def _fill_numpy(np: Any, r: TensorReservation, array: Any) -> None:
    if not array.size:
        return
    dst = np.frombuffer(r, dtype=array.dtype.newbyteorder("<")).reshape(array.shape)
    try:
        dst[...] = array
    finally:
        # The view goes with this frame, even when a traceback keeps it.
        del dst


def _fill_torch(torch: Any, r: TensorReservation, tensor: Any, shape: tuple[int, ...]) -> None:
    dst = _torch_view(torch, r, tensor.dtype, shape)
    try:
        if tensor.is_cuda:
            # Device to host, straight into the slot, on the current stream
            # of the tensor's device (where torch queues the copy); the slot
            # is published, or given back, only once that stream has
            # finished the copy, error or not.
            with torch.cuda.device(tensor.device):
                try:
                    dst.copy_(tensor.detach(), non_blocking=True)
                finally:
                    done = torch.cuda.Event()
                    done.record()
                    done.synchronize()
        else:
            dst.copy_(tensor.detach())
    finally:
        del dst


def get_tensor(reader: StoreReader, handle: ObjectHandle, device: Optional[Any] = None) -> Any:
    """A copy of the tensor object `handle` names, on `device`.

    With torch (imported, or `device` given): a torch tensor on `device`
    (default: the CPU), copied from the slot (host to device for a CUDA
    device). Without: a numpy array (bfloat16 needs torch). StaleError if
    the object is gone; WrongKindError if it is not a tensor.
    """
    guard = reader.get(handle)
    try:
        dtype, shape, offset = guard.tensor_meta()
        if device is not None or "torch" in sys.modules:
            return _get_torch(_torch(), guard, dtype, tuple(shape), offset, device)
        import numpy as np

        if dtype == "bfloat16":
            raise TypeError("a bfloat16 tensor needs torch to come out (numpy has no bfloat16)")
        np_dtype = np.dtype(dtype).newbyteorder("<")
        count = 1
        for n in shape:
            count *= n
        return np.frombuffer(guard, dtype=np_dtype, count=count, offset=offset).reshape(shape).copy()
    finally:
        _release(guard)


def _get_torch(torch: Any, guard: Any, dtype: str, shape: tuple[int, ...], offset: int, device: Any) -> Any:
    view = memoryview(guard)[offset:]
    src = _torch_view(torch, view, getattr(torch, dtype), shape)
    target = torch.device(device) if device is not None else torch.device("cpu")
    if target.type == "cuda":
        # Queued on the current stream of the target device; the read ends
        # (below, or through the release gate, which records its event on
        # the current device) only after that stream has read the slot.
        with torch.cuda.device(target):
            out = src.to(target, non_blocking=True)
            if not has_release_gate():
                done = torch.cuda.Event()
                done.record()
                done.synchronize()
            del src
            view.release()
            _release(guard)
        return out
    out = src.to(target, copy=True)
    del src
    view.release()
    return out


def _release(guard: Any) -> None:
    """Ends the read now if nothing still views it (else when that goes)."""
    try:
        guard.release()
    except BufferError:
        pass
