"""A second, unprivileged user of the host, for the tests of whose segments
a process trusts (test_local_trust.py): made with useradd where missing,
processes run as it with setpriv. Needs root; skipped with the reason
elsewhere, unless PINSHM_REQUIRE_USERS=1 (set by .ci/run, which runs as
root): then that is a failure."""

import os
import pwd
import shutil
import subprocess
import sys

import pytest

NAME = "pinshm-other"


def _unavailable(why):
    if os.environ.get("PINSHM_REQUIRE_USERS") == "1":
        pytest.fail(f"PINSHM_REQUIRE_USERS=1 but {why}")
    pytest.skip(why)


def other_user():
    """(uid, gid) of the second user."""
    if os.geteuid() != 0:
        _unavailable("needs root (useradd, and setpriv to run as another user)")
    if shutil.which("setpriv") is None:
        _unavailable("no setpriv (util-linux)")
    try:
        entry = pwd.getpwnam(NAME)
    except KeyError:
        useradd = shutil.which("useradd") or "/usr/sbin/useradd"
        made = subprocess.run(
            [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", NAME],
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            _unavailable(f"useradd {NAME} failed: {made.stderr.strip()}")
        entry = pwd.getpwnam(NAME)
    return entry.pw_uid, entry.pw_gid


def run_as(user, code, *args, env=None, **kw):
    """A Python process running `code` as `user` ((uid, gid)), its stdout a
    pipe; the same interpreter and packages as this one."""
    uid, gid = user
    environ = {k: v for k, v in os.environ.items() if k != "PINSHM_TRUSTED_UIDS"}
    environ.update(env or {})
    return subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.PIPE,
        text=True,
        cwd="/",
        env=environ,
        **kw,
    )
