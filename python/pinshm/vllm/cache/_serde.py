"""vLLM's serde interface for the storage, and ``MsgpackSerde``: vLLM's own
when vLLM is importable, else a msgpack serde for numpy arrays and plain
data, so the storage works without vLLM."""

from __future__ import annotations

import os
import struct
import warnings
from typing import Any


def zero_copy() -> bool:
    """Whether decoded tensors view the slot (``PINSHM_VLLM_ZERO_COPY=1``)."""
    return os.environ.get("PINSHM_VLLM_ZERO_COPY", "0") == "1"


class ObjectSerde:
    """vLLM's serde interface: ``serialize(value)`` returns ``(data,
    data_bytes, metadata, metadata_bytes)`` where ``data`` is bytes or a
    list of buffers; ``deserialize(view)`` gets the metadata followed by the
    data."""

    def serialize(self, value: Any) -> tuple[Any, int, bytes, int]:
        raise NotImplementedError

    def deserialize(self, data: memoryview) -> Any:
        raise NotImplementedError


class _NumpyMsgpackSerde(ObjectSerde):
    """The serde without vLLM: msgpack for the structure (bytes, str,
    numbers, None, lists, dicts), numpy arrays out of band, so each array's
    bytes are copied once into the slot and once out. Tuples come back as
    lists. Needs the ``msgpack`` package."""

    _EXT_ARRAY = 1

    def __init__(self) -> None:
        try:
            import msgpack  # type: ignore[import-untyped]  # ships no type information
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError(
                "pinshm.vllm.cache.MsgpackSerde needs vLLM or the msgpack package (pip install msgpack)"
            ) from e
        self._msgpack = msgpack

    def serialize(self, value: Any) -> tuple[list[Any], int, bytes, int]:
        import numpy as np

        buffers: list[memoryview] = []
        offset = 0

        def default(obj: Any) -> Any:
            nonlocal offset
            if isinstance(obj, np.ndarray):
                if obj.dtype.hasobject:
                    raise TypeError("arrays of Python objects cannot be stored")
                arr = np.ascontiguousarray(obj)
                view = memoryview(arr).cast("B") if arr.nbytes else memoryview(b"")
                buffers.append(view)
                spec = [arr.dtype.str, list(arr.shape), offset, arr.nbytes]
                offset += arr.nbytes
                return self._msgpack.ExtType(self._EXT_ARRAY, self._msgpack.packb(spec))
            raise TypeError(f"cannot serialize {type(obj).__name__}")

        packed = self._msgpack.packb(value, default=default, use_bin_type=True)
        metadata = struct.pack("<Q", len(packed)) + packed
        return buffers, offset, metadata, len(metadata)

    def deserialize(self, data: memoryview) -> Any:
        import numpy as np

        (length,) = struct.unpack_from("<Q", data)
        base = 8 + length

        def ext_hook(code: int, payload: bytes) -> Any:
            if code != self._EXT_ARRAY:
                return self._msgpack.ExtType(code, payload)
            dtype, shape, offset, nbytes = self._msgpack.unpackb(payload)
            start = base + offset
            if start + nbytes > len(data):
                raise ValueError("array runs past the object's end")
            flat = np.frombuffer(data[start : start + nbytes], dtype=np.dtype(dtype))
            # A copy: the caller's object outlives the read.
            return flat.reshape(shape).copy()

        return self._msgpack.unpackb(data[8:base], ext_hook=ext_hook, raw=False, strict_map_key=False)


class MsgpackSerde(ObjectSerde):
    """vLLM's ``MsgpackSerde`` (tensors and ``MultiModalKwargsItem`` by
    msgpack with out-of-band buffers, anything else by pickle) when vLLM is
    importable; otherwise a msgpack serde for bytes, str, numbers, numpy
    arrays and dicts and lists of them."""

    def __init__(self) -> None:
        try:
            from vllm.distributed.device_communicators.shm_object_storage import (
                MsgpackSerde as _VllmSerde,
            )
        except ImportError:
            self._inner: ObjectSerde = _NumpyMsgpackSerde()
        else:
            inner: Any = _VllmSerde()
            self._inner = inner
            if zero_copy():
                # Tensors that view the slot (no clone); the reader maps it
                # read-only for them (see the module doc).
                import torch
                from vllm.multimodal.inputs import MultiModalKwargsItem
                from vllm.v1.serial_utils import MsgpackDecoder

                inner.tensor_decoder = MsgpackDecoder(torch.Tensor, share_mem=True)
                inner.mm_decoder = MsgpackDecoder(MultiModalKwargsItem, share_mem=True)
            # vLLM's decoder calls torch.frombuffer on the slot, which
            # pinshm exports read-only; the tensors are cloned at once (or,
            # zero-copy, live in read-only memory), so torch's warning about
            # non-writable buffers says nothing here.
            warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

    def serialize(self, value: Any) -> tuple[Any, int, bytes, int]:
        return self._inner.serialize(value)

    def deserialize(self, data: memoryview) -> Any:
        return self._inner.deserialize(data)
