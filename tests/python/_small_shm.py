"""Running code with a small /dev/shm (a helper module, not a test)."""

import os
import subprocess
import sys
import textwrap

import pytest


def run_in_small_dev_shm(code, size="32m", env=None):
    """Runs `code` in a fresh interpreter whose /dev/shm is a tmpfs of
    `size` (a private mount namespace, as a container's). Skips, saying
    why, where that is not allowed, unless PINSHM_REQUIRE_NS=1 (set by
    .ci/run where it runs as root): then that is a failure, so a green run
    means the test ran."""
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        if os.environ.get("PINSHM_REQUIRE_NS") == "1":
            pytest.fail("PINSHM_REQUIRE_NS=1 but a mount namespace cannot be created here")
        pytest.skip("cannot create a mount namespace here (needs root and unshare)")
    script = f"mount -t tmpfs -o size={size} pinshm-test /dev/shm && exec \"$0\" -c \"$1\""
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script, sys.executable, textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=None if env is None else dict(os.environ, **env),
    )
