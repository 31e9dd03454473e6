"""Running a test body in a forked child (a helper module, not a test)."""

import os
import time

# A guard against a hang, not a timing assumption.
WAIT_S = 15


def in_child(body):
    """Runs `body()` in a forked child; returns its exit code (the child
    reports through it: body returns the code; an exception gives 99)."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = body()
        finally:
            os._exit(code)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child hung")
