"""Stand-ins for CI, which has neither SGLang nor torch: the pieces of
SGLang 0.5.23 the plugin touches, written from their contract
(docs/sglang.md), and a numpy-backed sliver of torch. ``install(dir)``
writes them as packages under `dir` (with a dist-info saying
``sglang 0.5.23``); a test runs the plugin in a subprocess with `dir`
first on its path. tests/python/test_sglang_plugin.py runs the same
contract against the real SGLang."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TORCH = """
import numpy as _np

class dtype:
    def __init__(self, name, np_dtype):
        self.name, self.np, self.itemsize = name, _np.dtype(np_dtype), _np.dtype(np_dtype).itemsize
    def __repr__(self):
        return "torch." + self.name
    __str__ = __repr__
    def __reduce__(self):
        return (_by_name, (self.name,))

def _by_name(name):
    return globals()[name]

uint8, float32, int64 = dtype("uint8", "u1"), dtype("float32", "<f4"), dtype("int64", "<i8")
_BY_NP = {d.np: d for d in (uint8, float32, int64)}

class Tensor:
    def __init__(self, a):
        self._a = a
    is_cpu = True
    shape = property(lambda self: tuple(self._a.shape))
    dtype = property(lambda self: _BY_NP[self._a.dtype])
    def cpu(self): return self
    def detach(self): return self
    def is_contiguous(self): return self._a.flags.c_contiguous
    def contiguous(self): return Tensor(_np.ascontiguousarray(self._a))
    def view(self, d): return Tensor(self._a.view(d.np))
    def reshape(self, *s): return Tensor(self._a.reshape(*s))
    def numpy(self): return self._a
    def clone(self): return Tensor(self._a.copy())
    def numel(self): return self._a.size
    def element_size(self): return self._a.itemsize
    def copy_(self, src):
        self._a[...] = src._a
        return self

def empty(shape, dtype): return Tensor(_np.empty(shape, dtype.np))
def equal(a, b): return a.shape == b.shape and bool((a._a == b._a).all())
def arange(n, dtype=float32): return Tensor(_np.arange(n, dtype=dtype.np))
def frombuffer(buf, dtype): return Tensor(_np.frombuffer(buf, dtype=dtype.np))
"""

MM_UTILS = '''
"""SGLang 0.5.23's mm_utils, the contract the plugin binds against."""
import os, uuid
from multiprocessing import shared_memory
import numpy as np
import torch

class ShmPointerMMData:
    """One segment per feature, as SGLang's: made by the tokenizer, mapped
    by each rank, unlinked by the first rank that materializes it."""
    def __init__(self, tensor, precomputed_hash=None):
        self._shm_handle, self.tensor, self._materialization_error = None, None, None
        tensor = tensor.contiguous()
        self.shape, self.dtype, self.precomputed_hash = tensor.shape, tensor.dtype, precomputed_hash
        n = tensor.numel() * tensor.element_size()
        shm = shared_memory.SharedMemory(create=True, size=n, name=f"sgl_shm_mm_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        np.frombuffer(shm.buf, dtype=np.uint8)[:] = tensor.view(torch.uint8).reshape(-1).numpy()
        self.shm_name = shm.name
        shm.close()
    def __getstate__(self):
        return {"shm_name": self.shm_name, "shape": self.shape, "dtype": self.dtype,
                "precomputed_hash": self.precomputed_hash}
    def __setstate__(self, state):
        self.shm_name, self.shape, self.dtype = state["shm_name"], state["shape"], state["dtype"]
        self.precomputed_hash = state.get("precomputed_hash")
        self._shm_handle, self.tensor, self._materialization_error = None, None, None
        try:
            self._shm_handle = shared_memory.SharedMemory(name=self.shm_name)
        except Exception as e:
            self._materialization_error = f"{type(e).__name__}: {e}"
    def materialize(self):
        try:
            if self._materialization_error is not None:
                raise RuntimeError(self._materialization_error)
            a = np.frombuffer(self._shm_handle.buf, dtype=self.dtype.np).reshape(self.shape).copy()
            return torch.Tensor(a)
        finally:
            self.close_and_unlink()
    def close_and_unlink(self):
        h, self._shm_handle = self._shm_handle, None
        try:
            h = h or shared_memory.SharedMemory(name=self.shm_name)
        except (FileNotFoundError, ValueError):
            return
        try:
            h.unlink()
        except FileNotFoundError:
            pass
        h.close()

def _get_is_default_transport():
    return False

class _Serving:
    skip_tokenizer_init = False

def get_serving():
    return _Serving()

def _wrap_shm_or_inline(tensor, precomputed_hash=None):
    try:
        return ShmPointerMMData(tensor, precomputed_hash=precomputed_hash)
    except OSError:
        return tensor

def wrap_shm_features(req):
    for item in req.mm_inputs.mm_items:
        item.feature = _wrap_shm_or_inline(item.feature, precomputed_hash=item.hash)
    return req

def has_shm_features(reqs):
    return any(isinstance(i.feature, ShmPointerMMData) for r in reqs for i in r.mm_inputs.mm_items)

def unwrap_shm_features(req):
    for item in req.mm_inputs.mm_items:
        if isinstance(item.feature, ShmPointerMMData):
            item.feature = item.feature.materialize()
    return req

def discard_shm_features(req):
    for item in req.mm_inputs.mm_items:
        if isinstance(item.feature, ShmPointerMMData):
            item.feature.close_and_unlink()

def is_shm_pointer_by_name(obj):
    """The msgpack hop's test (utils/msgpack_utils.py): by name, not class."""
    cls = type(obj)
    return cls.__name__ == "ShmPointerMMData" and cls.__module__.endswith(".managers.mm_utils")
'''

HOOKS = '''
import enum, importlib, sys

class HookType(enum.Enum):
    REPLACE = "replace"
    AROUND = "around"

class HookRegistry:
    """Class replacement as SGLang's: the name rebound in its module and
    in every module holding a `from X import Y` copy."""
    _hooks = []
    @classmethod
    def register(cls, target, hook, hook_type=HookType.REPLACE):
        cls._hooks.append((target, hook, hook_type))
    @classmethod
    def apply_hooks(cls):
        for target, hook, hook_type in cls._hooks:
            mod, _, name = target.rpartition(".")
            m = importlib.import_module(mod)
            old = getattr(m, name)
            if hook_type is HookType.AROUND:
                hook = (lambda h, o: lambda *a, **k: h(o, *a, **k))(hook, old)
            setattr(m, name, hook)
            for other in list(sys.modules.values()):
                for k, v in list(vars(other).items()) if other is not None else []:
                    if v is old:
                        setattr(other, k, hook)
        cls._hooks = []
'''


def install(root: Path) -> None:
    """Writes the stand-ins under `root`."""
    (root / "torch").mkdir()
    (root / "torch/__init__.py").write_text(textwrap.dedent(TORCH))
    pkg = root / "sglang/srt"
    for d in ("managers", "plugins"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    for d in (root / "sglang", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "managers/mm_utils.py").write_text(textwrap.dedent(MM_UTILS))
    (pkg / "plugins/hook_registry.py").write_text(textwrap.dedent(HOOKS))
    meta = root / "sglang-0.5.23.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n")


def run_plugin(root: Path, code: str, *args: str, prefix: tuple[str, ...] = (), **kw) -> subprocess.Popen:
    """`code` (dedented) in a fresh interpreter with the stand-ins under
    `root` first on its path, stdout and stderr piped (text); `prefix`
    goes before the interpreter (``unshare ...``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    env.update(kw.pop("env", {}))
    return subprocess.Popen(
        [*prefix, sys.executable, "-c", textwrap.dedent(code), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )
