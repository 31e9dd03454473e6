#!/usr/bin/env bash
# pinshm GPU kit, made by tests/gpu/build.sh on a CPU machine. Runs on a
# machine with an NVIDIA driver and nothing else (no toolchain, no network):
#   1. preflight: GPU, driver, /dev/shm, NVRTC, which kernel binary is used;
#   2. every GPU test binary (--include-ignored --test-threads=1 --nocapture);
#   3. the bandwidth table (pinned vs pageable, registration, pack/unpack);
#   4. the bench (examples/bench.rs, --quick);
#   5. the Python side with the machine's torch (py_pinned.py): vLLM's path
#      to the GPU against the pinned slot's, and the event-gated release
#      (a copy on the current stream, and one on a side stream);
#      py_encoder_cache.py: an encoder output (bf16 [4096, 4096]) saved D2H
#      straight into a slot against .cpu() plus a put, and loaded H2D from
#      the slot against pageable memory; and a step timed alone, after a
#      blocking save, and with a non-blocking save (wait=False) in flight
#      (on the current stream, on a side stream, and the connector's own:
#      put_tensor(stream=copy_stream(device)), with the save call's host
#      time); py_chunked_pin.py: a registration in several 64 MiB chunks.
# Under 5 minutes (every step has a timeout); ends on one summary line.
# Exit: 0 all passed, 1 something failed, 2 no GPU here (one line, at once).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
start=$SECONDS

# No GPU: one line and exit 2, within seconds.
driver_lib() {
  ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1' && return 0
  local d
  for d in ${LD_LIBRARY_PATH:+${LD_LIBRARY_PATH//:/ }} /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/nvidia/lib64 /usr/lib/wsl/lib; do
    [ -e "$d/libcuda.so.1" ] && return 0
  done
  return 1
}
# PINSHM_KIT_FORCE=1 skips these two checks (to try the steps and the
# summary on a machine without a GPU: the preflight then fails).
if [ "${PINSHM_KIT_FORCE:-0}" = 1 ]; then
  :
elif ! driver_lib; then
  echo "pinshm GPU kit: NO GPU: no CUDA driver (libcuda.so.1) on this machine; nothing run"
  exit 2
elif ! ls /dev/nvidia[0-9]* >/dev/null 2>&1 && ! ls /dev/dxg >/dev/null 2>&1; then
  echo "pinshm GPU kit: NO GPU: a CUDA driver but no GPU device node (/dev/nvidia0); nothing run"
  exit 2
fi

failed=()
passed=0
# step NAME SECONDS CMD...: runs CMD under a timeout, records the outcome.
step() {
  local name=$1 limit=$2
  shift 2
  echo
  echo "=== $name (limit ${limit}s)"
  local t0=$SECONDS rc=0
  timeout --kill-after=5 "$limit" "$@" || rc=$?
  if [ "$rc" -eq 0 ]; then
    passed=$((passed + 1))
    echo "=== $name: ok ($((SECONDS - t0))s)"
  else
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && name="$name (timed out)"
    failed+=("$name")
    echo "=== $name: FAILED, exit $rc ($((SECONDS - t0))s)"
  fi
}

echo "=== preflight"
echo "kit: $here (commit $(cat "$here/COMMIT" 2>/dev/null || echo '?'))"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,driver_version,compute_cap,memory.total --format=csv || true
else
  echo "nvidia-smi: not installed (the preflight test below names the device)"
fi
df -h /dev/shm || true
shm_free=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 { print $4 }')
if [ -n "$shm_free" ] && [ "$shm_free" -lt $((2 * 1024 * 1024)) ]; then
  echo "WARNING: under 2 GiB free in /dev/shm: the 256 MiB and 1 GiB figures will fail with NoSpace"
  echo "         (in a container: --shm-size=4g or a larger /dev/shm mount)"
fi
if ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so'; then
  echo "libnvrtc: loadable ($(ldconfig -p | grep -m1 'libnvrtc\.so' | sed 's/.*=> //'))"
else
  echo "libnvrtc: not in the linker cache (kernels come from the embedded cubins/PTX; the preflight test checks)"
fi
# The driver's view: device, compute capability, SMs, driver version,
# NVRTC, and which kernel binary (cubin / PTX / NVRTC) the engine loads.
step "preflight (CUDA driver and device)" 20 "$here/gpu" --exact preflight_reports_the_device_and_the_kernel_binary --include-ignored --nocapture --test-threads=1

if [ "${#failed[@]}" -eq 0 ]; then
  step "tests/gpu.rs" 90 "$here/gpu" --include-ignored --test-threads=1 --nocapture --skip bandwidth_table --skip preflight_reports
  step "tests/device.rs" 40 "$here/device" --include-ignored --test-threads=1 --nocapture
  step "bandwidth table" 70 "$here/gpu" --exact bandwidth_table --include-ignored --test-threads=1 --nocapture
  step "bench --quick" 30 env PINSHM_COMMIT="$(cat "$here/COMMIT" 2>/dev/null)" "$here/bench" --quick
  if python3 -c 'import torch, numpy' 2>/dev/null; then
    step "python: pinned slot vs vLLM's path, gated release" 40 env PYTHONPATH="$here/py" python3 "$here/py_pinned.py"
    step "python: encoder cache save (D2H into the slot) and load" 40 env PYTHONPATH="$here/py" python3 "$here/py_encoder_cache.py"
    step "python: registration in 64 MiB chunks, copies across a boundary" 40 env PYTHONPATH="$here/py" python3 "$here/py_chunked_pin.py"
    # What a user with a GPU runs from the wheel (python -m pinshm doctor --gpu).
    step "python: doctor --gpu from the wheel" 40 env PYTHONPATH="$here/py" python3 -m pinshm doctor --gpu
  else
    echo "=== python: skipped (python3 has no torch or numpy)"
  fi
fi

echo
if [ "${#failed[@]}" -eq 0 ]; then
  echo "pinshm GPU kit: PASS, $passed steps in $((SECONDS - start))s"
  exit 0
fi
msg=$(printf '%s; ' "${failed[@]}")
echo "pinshm GPU kit: FAIL, ${#failed[@]} failed (${msg%; }), $passed passed, in $((SECONDS - start))s"
exit 1
