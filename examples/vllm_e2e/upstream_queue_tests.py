"""Runs vLLM's own queue tests (tests/distributed/test_shm_broadcast.py of
0.33.0 or 0.34.0) against pinshm's MessageQueue, in a venv with vLLM and
torch (never in CI).

    V/bin/python examples/vllm_e2e/upstream_queue_tests.py vllm-0.34.0.tar.gz [--json OUT] [pytest args]

The test file comes from vLLM's source distribution (PyPI's
vllm-0.33.0.tar.gz; a source checkout's tests/ directory works too) and is
run from a temporary directory, changed in two ways only:

* the swap: a conftest binds pinshm's class to the name ``MessageQueue`` of
  ``vllm.distributed.device_communicators.shm_broadcast`` before the file
  imports it (what pinshm's vLLM plugin does in an engine), and provides
  the ``caplog_vllm`` fixture of vLLM's tests/conftest.py;
* the lines that set vLLM's spin state (``_spin_condition.busy_loop_s``,
  ``_spin_condition.last_read``), which pinshm's queue does not have, are
  dropped.

Tests that read vLLM's internals in other ways (its ring's metadata, its
spin condition's call counts, its tensor arena) are run too: they fail by
design, and the report says which and why (`DIFFERS`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import tempfile

TEST = "tests/distributed/test_shm_broadcast.py"

CONFTEST = '''
import logging

import pytest

from vllm.distributed.device_communicators import shm_broadcast
from pinshm.vllm.queue import MessageQueue

shm_broadcast.MessageQueue = MessageQueue


@pytest.fixture
def caplog_vllm(caplog, monkeypatch):
    """As vLLM's tests/conftest.py: vLLM's logger propagates to the root,
    whose level is INFO for the test."""
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    with caplog.at_level(logging.INFO):
        yield caplog
'''

# Tests that read or patch vLLM's queue internals: what each looks at.
DIFFERS = {
    "test_message_queue_idle_wake": "counts calls of vLLM's _spin_condition.wait",
    "test_message_queue_busy_to_idle": "counts calls of vLLM's _spin_condition.wait",
    "test_tensor_broadcast": "patches vLLM's _reduce_tensor and MessageQueue.recv (its overflow socket)",
    "test_broadcast_retains_values_after_ring_reuse": "patches MessageQueue.recv (vLLM's overflow socket) and counts its calls",
    "test_acquire_read_releases_slot_when_reader_raises": "reads vLLM's ring metadata (writer.buffer) and acquire_read/acquire_write",
    "test_reader_rechecks_shm_after_idle_wait_timeout_without_notify": "drives vLLM's notify sockets and poller",
    "test_busy_reader_consumes_write_notifications": "drives vLLM's notify sockets",
    "test_create_from_handle_tolerates_arena_attach_failure": "vLLM's tensor arena, not reproduced",
    "test_tensor_arena_registry_is_weak_and_survives_shutdown": "vLLM's tensor arena, not reproduced",
    "test_reader_timeout_caps_indefinite_waits": "uses vLLM's inner class MessageQueue.ReadTimeoutWithWarnings",
}


def read_test(source: str, test: str) -> str:
    """The text of `test` (a path under vLLM's tree) from a source checkout
    or vLLM's sdist."""
    if os.path.isdir(source):
        with open(os.path.join(source, test)) as f:
            return f.read()
    with tarfile.open(source) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(test))
        return tar.extractfile(member).read().decode()


def extract(source: str, into: str) -> str:
    dest = os.path.join(into, "test_shm_broadcast.py")
    text = read_test(source, TEST)
    dropped = re.compile(r"^\s*\w+\._spin_condition\.(busy_loop_s|last_read)\s*=.*$", re.M)
    text, n = dropped.subn(lambda m: re.sub(r"\S.*", "pass  # pinshm: vLLM's spin state", m.group(0)), text)
    print(f"{n} line(s) setting vLLM's spin state dropped")
    with open(dest, "w") as f:
        f.write(text)
    with open(os.path.join(into, "conftest.py"), "w") as f:
        f.write(CONFTEST)
    return dest


def _fn(test_id: str) -> str:
    return test_id.split("[", 1)[0]


def run_and_report(
    suite: str, source: str, tmp: str, differs: dict[str, str], args: list[str], target: str = ""
) -> int:
    """Runs pytest in `tmp` over `target` (default: `tmp`), prints each
    failure as DIFFERS (listed in `differs`, with why) or FAILED
    (unexpected); with ``--json OUT`` in `args`, merges this suite's counts
    into OUT. Exit 1 on an unexpected failure."""
    out_json = None
    if "--json" in args:
        i = args.index("--json")
        out_json, args = args[i + 1], args[:i] + args[i + 2 :]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "-q", *args, target or tmp],
        cwd=tmp,
        capture_output=True,
        text=True,
    )
    out = r.stdout + r.stderr
    print(out[-20000:])
    # Test ids as pytest counts them (a parametrized test once per case);
    # DIFFERS is keyed by the test's function name.
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) \S*::(\w+(?:\[[^\]\s]*\])?)", out, re.M)))
    unexpected = [t for t in failed if _fn(t) not in differs]
    for t in failed:
        print(f"{'DIFFERS' if _fn(t) in differs else 'FAILED '} {t}: {differs.get(_fn(t), 'unexpected')}")
    passed = sorted(set(re.findall(r"^PASSED \S*::(\w+(?:\[[^\]\s]*\])?)", out, re.M)))
    passed_anyway = sorted({_fn(t) for t in passed} & set(differs))
    if passed_anyway:
        print("listed as differing but passed:", ", ".join(passed_anyway))
    if out_json:
        import json

        results = json.load(open(out_json)) if os.path.exists(out_json) else {}
        import pinshm
        import vllm

        # One entry per suite and per vLLM version whose tests ran.
        m = re.search(r"vllm-(\d+\.\d+\.\d+)", os.path.basename(os.path.normpath(source)))
        results[f"{suite} {m.group(1) if m else 'source'}"] = {
            "passed": len(passed),
            "differ": {t: differs[_fn(t)] for t in failed if _fn(t) in differs},
            "failed": unexpected,
            "total": len(passed) + len(failed),
            "tests_from": os.path.basename(os.path.normpath(source)),
            "vllm_installed": vllm.__version__,
            "pinshm": pinshm.__version__,
        }
        with open(out_json, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
            f.write("\n")
    return 1 if unexpected else 0


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    with tempfile.TemporaryDirectory(prefix="pinshm-upstream-") as tmp:
        extract(sys.argv[1], tmp)
        return run_and_report("queue", sys.argv[1], tmp, DIFFERS, sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
