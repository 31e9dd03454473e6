"""How the queue encodes an object: vLLM's pickle (protocol 5) with large
buffers out of band, CPU tensors included, and the inline channel message
that carries a pickle and its buffers in one slot.

An inline message is::

    kind (u8) | n (u16) | n lengths (u32 each) | pickle | buffer 1 | ...

all little-endian, gathered straight into the slot by the channel's
``send_parts`` (no join on the writer's side). A message larger than a
slot is the same bytes, put as one object of the overflow store; its
channel message (``STORED``) is::

    kind (u8) | m (u32) | the store's handle, pickled (m bytes) | address, id, epoch (u64 each)

the handle of the object last: no pickle to make or read per message.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import warnings
from pickle import PickleBuffer
from typing import Any

#: Out-of-band buffers below this size are pickled in band (as vLLM does).
OOB_MIN_BYTES = 1 << 20

# Message kinds (byte 0 of a channel message).
INLINE = 0  #: the pickle and its buffers, in the message
STORED = 1  #: the handle of an object of the queue's overflow store (STORED_HEAD)
READY = 2  #: wait_until_ready's probe
PIECE = 3  #: a piece of an inline message too large for a slot (PIECE_HEAD)
PIECE_HEAD = struct.Struct("<BQ")  # kind, the whole message's bytes
STORED_HEAD = struct.Struct("<BI")  # kind, the pickled store handle's bytes
STORED_REF = struct.Struct("<QQQ")  # the object's handle: address, id, epoch
#: Where a stored message's out-of-band buffers start (from its first
#: byte, itself at a multiple of this in the store): zero-copy arrays over
#: them are aligned, as each was when it was an object of its own.
STORED_ALIGN = 64

_U16 = struct.Struct("<H")


def _rebuild_tensor(buf: Any, shape: tuple[int, ...], dtype_str: str) -> Any:
    """Rebuilds a CPU tensor from an out-of-band buffer (a writable
    bytearray, or a read-only view of the store in zero-copy mode)."""
    import torch

    dtype = getattr(torch, dtype_str)
    mv = memoryview(buf)
    if mv.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if mv.readonly:
        with warnings.catch_warnings():
            # Zero-copy mode: the tensor is a read-only view of the store.
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(mv, dtype=torch.uint8).view(dtype).view(shape)
    return torch.frombuffer(mv, dtype=torch.uint8).view(dtype).view(shape)


class _Pickler(pickle.Pickler):
    """Pickles a CPU tensor as an out-of-band buffer (torch's own reducer
    copies its bytes into the pickle stream); anything else as pickle does.
    Built-in types never reach ``reducer_override``."""

    def __init__(self, file: Any, buffer_callback: Any, tensor_type: type) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        # Any: torch is not a dependency, and an `is` test on a `type`
        # would narrow `obj` to `object` for mypy.
        self._tensor_type: Any = tensor_type

    def reducer_override(self, obj: Any) -> Any:
        # The exact type, as a dispatch table would match it: subclasses
        # (nn.Parameter) keep their own reducers.
        if type(obj) is not self._tensor_type:
            return NotImplemented
        import torch

        if obj.device.type != "cpu" or obj.layout != torch.strided or obj.requires_grad:
            return NotImplemented
        try:
            raw = obj.contiguous().reshape(-1).view(torch.uint8).numpy()
        except RuntimeError:
            return NotImplemented
        dtype_str = str(obj.dtype).removeprefix("torch.")
        return _rebuild_tensor, (PickleBuffer(raw), tuple(obj.shape), dtype_str)


def dumps(obj: Any, oob_min: int = OOB_MIN_BYTES) -> list[Any]:
    """``[pickle, *out-of-band buffers]``: buffers of ``oob_min`` bytes and
    more travel out of band (no copy into the pickle)."""
    bufs: list[Any] = [b""]

    def oob(buf: PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < oob_min:
            return True
        bufs.append(raw)
        return False

    torch = sys.modules.get("torch")
    if torch is None:
        # No torch in this process: the object holds no tensor.
        bufs[0] = pickle.dumps(obj, protocol=5, buffer_callback=oob)
        return bufs
    with io.BytesIO() as bio:
        _Pickler(bio, oob, torch.Tensor).dump(obj)
        bufs[0] = bio.getvalue()
    return bufs


def _padding(off: int, align: int) -> int:
    return -off % align


def inline_size(bufs: list[Any], align: int = 1) -> int:
    """Bytes of the inline message of ``bufs`` (see :func:`inline_parts`
    for `align`)."""
    off = 3 + 4 * len(bufs)
    for i, b in enumerate(bufs):
        if i:
            off += _padding(off, align)
        off += memoryview(b).nbytes
    return off


def inline_parts(bufs: list[Any], align: int = 1) -> list[Any]:
    """The inline message of ``bufs`` as parts the channel gathers into
    its slot: the head (kind, count, lengths), then the buffers. With
    `align`, each out-of-band buffer starts at a multiple of it from the
    message's first byte (zero bytes between): what a reader that keeps
    views of them (:func:`loads_inline` with ``copy=False``) needs for
    aligned arrays. Reader and writer must agree on it."""
    head = struct.pack(f"<BH{len(bufs)}I", INLINE, len(bufs), *(memoryview(b).nbytes for b in bufs))
    if align == 1:
        return [head, *bufs]
    parts: list[Any] = [head]
    off = len(head)
    for i, b in enumerate(bufs):
        pad = _padding(off, align) if i else 0
        if pad:
            parts.append(bytes(pad))
        parts.append(b)
        off += pad + memoryview(b).nbytes
    return parts


def loads_inline(data: Any, copy: bool = True, align: int = 1) -> Any:
    """The object of an inline message (bytes, or a view of the slot or of
    a stored object: the pickle is read in place, each out-of-band buffer
    copied once into an owned bytearray; with ``copy=False``, a view of
    `data` instead, which keeps `data`'s export alive). `align`: as the
    message was made with (:func:`inline_parts`)."""
    (n,) = _U16.unpack_from(data, 1)
    lens = struct.unpack_from(f"<{n}I", data, 3)
    off = 3 + 4 * n
    oob: list[Any] = []
    with memoryview(data) as mv, mv[off : off + lens[0]] as main:
        off += lens[0]
        for length in lens[1:]:
            off += _padding(off, align)
            if copy:
                # Writable, and owned: the arrays may outlive the message.
                with mv[off : off + length] as part:
                    oob.append(bytearray(part))
            else:
                # A slice outlives `mv`'s release: it holds the export.
                oob.append(mv[off : off + length])
            off += length
        # Released on the way out, raise or not: an exception's frames
        # must not keep the slot.
        return pickle.loads(main, buffers=oob)
