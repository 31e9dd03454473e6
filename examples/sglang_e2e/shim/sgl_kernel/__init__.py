"""Import shim for the GPU-only `sgl_kernel` package (sglang-kernel wheel).

SGLang 0.5.23 with SGLANG_USE_CPU_ENGINE=1 imports a few `*_cpu` names from
sgl_kernel at module import time (they come from the CPU build of sgl-kernel,
which is not on PyPI). Here:
  * names in _RAISING exist only so the import succeeds; calling one raises.
  * assign_req_to_token_pool_cpu is called on every prefill/decode allocation
    (sglang/srt/mem_cache/allocation.py, unconditionally when is_cpu()), so it
    is implemented in plain torch (same semantics as the triton kernel
    `assign_req_to_token_pool` in that file).
  * names in _RAISING_OPS are registered as torch.ops.sgl_kernel.<name> ops
    (schema "(Tensor[] args) -> ()") that raise when called: SGLang looks
    them up at module import time under is_cpu() (e.g. models/qwen3_5.py,
    pulled in by the multimodal processor registry), not guarded by the AMX
    check. None of them is reached by Qwen2-VL on the native path.
Any other `from sgl_kernel import X` still fails with ImportError, so SGLang's
feature probes keep seeing "not available". No torch.ops.sgl_kernel.* op is
registered, so sglang.srt.utils.common._is_intel_amx_backend_available() is
False and every layer takes its forward_native path.
"""
import torch

__version__ = "0.0.0+cpu-shim"

_RAISING = [
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "verify_tree_greedy_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",  # sglang/kernels/ops/kvcache/cache_move.py
]


def _make_stub(name):
    def _stub(*args, **kwargs):
        raise RuntimeError(
            f"sgl_kernel.{name} was called, but sgl_kernel is a CPU import shim "
            f"(the sgl-kernel package is not installed)"
        )

    _stub.__name__ = name
    _stub.__qualname__ = name
    return _stub


for _n in _RAISING:
    globals()[_n] = _make_stub(_n)
del _n

_RAISING_OPS = [
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_sigmoid_mul_cpu",
]

_lib = torch.library.Library("sgl_kernel", "FRAGMENT")


def _register_ops():
    for name in _RAISING_OPS:
        _lib.define(f"{name}(Tensor[] args) -> ()")
        _lib.impl(name, _make_stub(name), "CompositeExplicitAutograd")


_register_ops()


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = next (end-start) of out_cache_loc."""
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    off = 0
    for r, s, e in zip(rows, starts, ends):
        n = e - s
        if n > 0:
            req_to_token[r, s:e] = out_cache_loc[off : off + n].to(req_to_token.dtype)
        off += n
