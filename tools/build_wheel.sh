#!/usr/bin/env bash
# tools/build_wheel.sh PYTHON [TARGET]: builds the pinshm wheel users get
# and prints its path (build output goes to stderr).
#
# The wheel: release, stripped, `--features cuda` (the driver is loaded at
# run time; without one pinshm runs unpinned), abi3 for CPython >= 3.11,
# linked by zig (PyPI's `ziglang`, which PYTHON's environment must have,
# with maturin) against glibc 2.17's symbols, so that it is tagged
# manylinux_2_17 (manylinux2014) and maturin's compliance check of that
# tag passes, on a build machine of any newer glibc. PYTHON older than
# 3.11 gets a wheel for its own version (no abi3: see python/Cargo.toml).
#
# TARGET (default: this machine's) is a Rust target triple, for a cross
# build: aarch64-unknown-linux-gnu needs a rustc with that target's std
# (RUSTC=/usr/bin/rustc, Debian's rustc-web with libstd-rust-web-dev:arm64:
# see docs/python.md). One build dir per target under target/, kept
# between runs.
# Used by ./test.sh, .ci/run and tests/gpu/build.sh: one wheel, one recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:?usage: tools/build_wheel.sh PYTHON [TARGET]}
target=${2:-}
out="$PWD/target/wheels"
# maturin finds zig as PYTHON's environment's `python -m ziglang`.
case "$py" in */*) export PATH="$(cd "$(dirname "$py")" && pwd):$PATH" ;; esac
# Stripped, and no debug info: the wheel is what users download.
export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=debuginfo
args=(--release --strip --zig --compatibility manylinux_2_17 --out "$out" --interpreter "$py")
if "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  args+=(--features cuda)
else
  args+=(--no-default-features --features cuda)
fi
if [ -n "$target" ]; then
  args+=(--target "$target")
  export CARGO_TARGET_DIR="$PWD/target/python-$target"
else
  export CARGO_TARGET_DIR="$PWD/target/python"
fi
arch=${target%%-*}
arch=${arch:-$(uname -m)}
mkdir -p "$out"
rm -f "$out"/pinshm-*"$arch".whl
"$py" -m maturin build "${args[@]}" >&2
ls -t "$out"/pinshm-*"$arch".whl 2>/dev/null | head -1 | grep . ||
  { echo "build_wheel.sh: maturin wrote no wheel to $out" >&2; exit 1; }
