#!/usr/bin/env bash
# The test command: the Rust tests, then the Python package built as the
# wheel users get (tools/build_wheel.sh: manylinux, abi3, --features cuda),
# installed into a throw-away virtualenv, and its pytest suite run against
# that installed copy (from target/, so the source tree's python/ is never
# imported). Needs the Rust toolchain and python3 (3.9 or newer, with venv);
# fetches maturin, ziglang (the linker that gives the manylinux glibc
# floor), pytest, msgpack, pyzmq (the queue's remote readers) and numpy
# from PyPI into target/pyenv. Arguments
# go to pytest (e.g. ./test.sh -k channel).
set -euo pipefail
cd "$(dirname "$0")"

echo "== cargo test (Rust)"
cargo test

echo "== Python: virtualenv target/pyenv"
py=${PYTHON:-python3}
if [ ! -x target/pyenv/bin/python ]; then
  "$py" -m venv target/pyenv
fi
export VIRTUAL_ENV="$PWD/target/pyenv"
export PATH="$VIRTUAL_ENV/bin:$PATH"
python -m pip install --quiet --disable-pip-version-check \
  "maturin==1.16.0" \
  "ziglang==0.14.1" \
  "pytest==8.4.2" \
  "msgpack>=1.0,<2" \
  "pyzmq==27.1.0" \
  "numpy==2.0.2; python_version < '3.10'" \
  "numpy==2.2.6; python_version == '3.10'" \
  "numpy==2.3.5; python_version >= '3.11'"

echo "== Python: build the wheel and install it"
wheel=$(tools/build_wheel.sh python)
python -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheel"

echo "== pytest tests/python (against the installed wheel)"
# Run as root, the tests of whose segments a process trusts need a second
# real user (tests/python/_users.py): made here if missing, removed after
# unless it was there before (or PINSHM_KEEP_TEST_USER=1).
made_user=""
if [ "$(id -u)" -eq 0 ] && ! id pinshm-other >/dev/null 2>&1; then
  echo "test.sh: running as root: creating the system user 'pinshm-other' for the tests of a second user; removed at the end"
  made_user=1
fi
cleanup_user() {
  if [ -n "$made_user" ] && [ "${PINSHM_KEEP_TEST_USER:-0}" != 1 ] && id pinshm-other >/dev/null 2>&1; then
    userdel pinshm-other 2>/dev/null || /usr/sbin/userdel pinshm-other || true
  fi
}
trap cleanup_user EXIT
# PINSHM_TEST_INSTALLED=1: a test checks that pinshm comes from
# site-packages, not from python/.
(cd target && unset PYTHONPATH && PINSHM_TEST_INSTALLED=1 python -m pytest ../tests/python -q "$@")
