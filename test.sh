#!/usr/bin/env bash
# The test command: the Rust tests, then the Python package built into a
# throw-away virtualenv and its pytest suite. Needs the Rust toolchain and
# python3 (3.9 or newer, with venv); fetches maturin, pytest, msgpack and numpy from
# PyPI into target/pyenv. Arguments go to pytest (e.g. ./test.sh -k channel).
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
  "pytest==8.4.2" \
  "msgpack>=1.0,<2" \
  "numpy==2.0.2; python_version < '3.10'" \
  "numpy==2.2.6; python_version == '3.10'" \
  "numpy==2.3.5; python_version >= '3.11'"

echo "== Python: build and install pinshm (maturin, release)"
# The abi3 wheel needs Python 3.11 (see python/Cargo.toml); older
# interpreters get a build for their own version.
if ! python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  export MATURIN_PEP517_ARGS="--no-default-features"
fi
# The binding's build outputs stay under target/ with the rest.
CARGO_TARGET_DIR="$PWD/target/python" \
  python -m pip install --quiet --disable-pip-version-check --no-build-isolation --force-reinstall --no-deps .

echo "== pytest tests/python"
python -m pytest tests/python -q "$@"
