#!/usr/bin/env bash
# The GPU checks, for a machine with a CUDA driver and GPU (under 5 minutes):
# build with --features cuda, run the GPU tests (registration in two
# processes, device->slot->device across processes, pack/unpack against the
# CPU reference), print pinned vs pageable bandwidth at 1, 16, 256 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so'; then
  echo "SKIPPED: no CUDA driver (libcuda.so) on this machine"
  exit 0
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
cargo build --release --features cuda --tests
timeout 280 cargo test --release --features cuda --test gpu -- --ignored --nocapture --test-threads=1
