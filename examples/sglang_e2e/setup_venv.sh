#!/usr/bin/env bash
# SGLang 0.5.23 on a CPU-only machine, from nothing (never in CI: ~7 GB).
#
#   bash examples/sglang_e2e/setup_venv.sh VENV            # the exact set used (requirements-frozen.txt)
#   bash examples/sglang_e2e/setup_venv.sh VENV resolve    # re-derive it from sglang's Requires-Dist
#   FRESH=1 bash examples/sglang_e2e/setup_venv.sh VENV    # delete VENV first
#
# Then the pinshm wheel (pip install --no-deps pinshm-*.whl) for the
# plugin's runs; the model is built into VENV/../tiny-qwen2vl unless
# MODEL=DIR says where.
#
# Only PyPI is needed. Everything is installed with --no-deps so that none of
# sglang's GPU-only requirements (flashinfer, sglang-kernel, cuda-python, ...)
# get pulled in. Downloads ~4 GB (torch 2.14.1 CUDA wheel + the nvidia-* wheels
# that `import torch` loads), venv ends up ~7 GB.
set -euo pipefail
V=${1:?usage: setup_venv.sh VENV [frozen|resolve]}
S=$(cd "$(dirname "$0")" && pwd)
MODE=${2:-frozen}
MODEL=${MODEL:-$(dirname "$V")/tiny-qwen2vl}
W=$(mktemp -d)
PIP="$V/bin/pip"
PY="$V/bin/python"

[ "${FRESH:-0}" = 1 ] && rm -rf "$V"
python3 -m venv "$V"                      # python 3.11 (3.11.7 was used)
"$PY" -m pip install -q -U pip            # pip 26.3 was used

if [ "$MODE" = frozen ]; then
  # exact set that worked (pip freeze of the working venv; sglang + torch included)
  "$PIP" install --no-cache-dir --no-deps -r "$S/requirements-frozen.txt"
else
  # 1. sglang + torch (the version sglang pins), no deps
  "$PIP" install --no-cache-dir --no-deps sglang==0.5.23 torch==2.14.1
  # 2. sglang's Requires-Dist (no extras) minus GPU-only packages, plus torch's non-CUDA deps
  W="$W" "$PY" - <<'PYEOF'
import re
from importlib.metadata import requires
drop = {'cuda-python','flash-attn-4','flashinfer-python','humming-kernels','nvidia-cutlass-dsl',
        'nvidia-mathdx','nvshmem4py-cu13','quack-kernels','sgl-deep-ep','sgl-deep-gemm',
        'sgl-flash-mla','sglang-kernel','tilelang','torch-memory-saver','torchaudio','torchcodec',
        'torch','torchvision','deepseek-recipe','tml-renderers','decord2','av'}
out = []
for r in requires('sglang'):
    if 'extra ==' in r:
        continue
    name = re.sub(r'[-_.]+', '-', re.split(r'[<>=;\[ !~]', r)[0].strip()).lower()
    if name not in drop:
        out.append(r.split(';')[0].strip())
for r in requires('torch'):
    if 'extra' not in r and 'platform_system' not in r:
        out.append(r)
import os; open(os.environ['W'] + '/reqs.txt', 'w').write('\n'.join(out) + '\n')
print(len(out), 'requirements')
PYEOF
  # 3. resolve them together with torch==2.14.1 + torchvision (no install) ...
  "$PIP" install --dry-run --ignore-installed --report $W/resolve.json \
      -r "$W/reqs.txt" torch==2.14.1 torchvision > $W/resolve.log
  # 4. ... and keep every resolved package except torch itself and the CUDA python
  #    bindings/meta-package. Kept: torch's own nvidia-* wheels (libtorch_cuda.so
  #    is loaded by `import torch` and links cudart/cublas/cudnn/cufft/cufile/curand/
  #    cusolver/cusparse/cusparseLt/nccl/nvrtc/nvshmem/nvjitlink), triton (imported
  #    unconditionally by sglang), torchvision (Qwen2-VL processors).
  #    apache-tvm-ffi is re-pinned to sglang's ==0.1.11 (resolver picks a newer one for xgrammar).
  W="$W" "$PY" - <<'PYEOF'
import json
import os; r = json.load(open(os.environ['W'] + '/resolve.json'))
skip = {'torch', 'cuda-toolkit', 'cuda-bindings', 'cuda-pathfinder', 'nvidia-nvtx'}  # nvtx: not loaded by import torch
pins = {'apache-tvm-ffi': '0.1.11'}
lines = []
for i in r['install']:
    n, v = i['metadata']['name'], i['metadata']['version']
    if n.lower() in skip:
        continue
    lines.append(f"{n}=={pins.get(n.lower(), v)}")
open(os.environ['W'] + '/pinned_nodeps.txt', 'w').write('\n'.join(lines) + '\n')
print(len(lines), 'pins')
PYEOF
  "$PIP" install --no-cache-dir --no-deps -r "$W/pinned_nodeps.txt"
fi

# 5. sgl_kernel import shim (sglang-kernel is CUDA-only; see shim/sgl_kernel/__init__.py)
SP=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$SP/sgl_kernel"
cp -r "$S/shim/sgl_kernel" "$SP/sgl_kernel"

# 6. checks
"$PY" -c 'import torch, torchvision, triton, transformers, sglang, sgl_kernel; print("torch", torch.__version__, "cuda?", torch.cuda.is_available(), "| transformers", transformers.__version__, "| sglang", sglang.__version__)'
SGLANG_USE_CPU_ENGINE=1 "$PY" -m sglang.launch_server --help > /dev/null && echo "launch_server --help OK"
"$PIP" check | grep -v "is not installed" || true   # only GPU-only packages are reported missing

# 7. tiny random-weight Qwen2-VL + test images (deterministic, seed 0)
"$PY" "$S/build_model.py" "$MODEL"
echo "setup done"
