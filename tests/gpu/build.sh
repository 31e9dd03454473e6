#!/usr/bin/env bash
# Builds the GPU kit on a CPU machine (no GPU, no CUDA toolkit needed):
# the GPU test binaries (tests/gpu.rs, tests/device.rs) and the bench
# (examples/bench.rs), release, --features cuda, without debug info; the
# pinshm wheel users get (tools/build_wheel.sh: manylinux_2_17, abi3,
# --features cuda: the same file ./test.sh tests and .ci/run checks, not a
# build of its own) and tests/gpu/py_pinned.py, which run.sh runs with the
# machine's own torch; plus run.sh, gathered in target/gpu-kit/ (ignored by
# git, at most 60 MiB).
# Carry that folder to a machine with an NVIDIA driver and run
# `bash target/gpu-kit/run.sh`: it needs no toolchain and no network.
set -euo pipefail
cd "$(dirname "$0")/../.."
kit=target/gpu-kit
limit=$((60 * 1024 * 1024))
export CARGO_TERM_COLOR=never
# No debug info: the kit must stay small enough to travel with the tree.
export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=debuginfo

# The executables cargo reports for a build (one path per line).
executables() {
  python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])
'
}

echo "building the GPU tests and the bench (release, --features cuda)..." >&2
tests=$(cargo test --release --features cuda --test gpu --test device --no-run \
  --message-format=json-render-diagnostics | executables)
bench=$(cargo build --release --features cuda --example bench \
  --message-format=json-render-diagnostics | executables)

echo "building the pinshm wheel (tools/build_wheel.sh: the one users get)..." >&2
kitenv=target/kit-pyenv
[ -x "$kitenv/bin/python" ] || python3 -m venv "$kitenv"
"$kitenv/bin/python" -m pip install --quiet --disable-pip-version-check "maturin==1.16.0" "ziglang==0.14.1"
wheel=$(tools/build_wheel.sh "$kitenv/bin/python")

rm -rf "$kit"
mkdir -p "$kit"
while read -r name exe; do
  case "$name" in gpu | device | bench) cp "$exe" "$kit/$name" ;; esac
done <<<"$tests
$bench"
for want in gpu device bench; do
  [ -x "$kit/$want" ] || { echo "build.sh: cargo built no '$want' executable" >&2; exit 1; }
done
cp tests/gpu/run.sh "$kit/run.sh"
cp tests/gpu/py_pinned.py "$kit/py_pinned.py"
cp tests/gpu/py_encoder_cache.py "$kit/py_encoder_cache.py"
cp tests/gpu/py_chunked_pin.py "$kit/py_chunked_pin.py"
# The wheel itself (to pip install on the GPU machine), and unpacked (a
# wheel is a zip): run.sh puts that on PYTHONPATH.
cp "$wheel" "$kit/"
python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$wheel" "$kit/py"
chmod +x "$kit/run.sh"
git rev-parse --short HEAD >"$kit/COMMIT" 2>/dev/null || true
size=$(du -sb "$kit" | cut -f1)
if [ "$size" -gt "$limit" ]; then
  echo "build.sh: $kit is $size bytes, over the 60 MiB a kit may weigh" >&2
  exit 1
fi
echo "$(cd "$kit" && pwd) $(du -sh "$kit" | cut -f1) ($size bytes)"
