"""Runs vLLM's own storage tests (tests/distributed/test_shm_storage.py)
and, where the source has it, its ring buffer's tests
(tests/distributed/test_shm_buffer.py), of 0.33.0 or 0.34.0, against
pinshm's drop-ins, in a venv with vLLM and torch (never in CI).

    V/bin/python examples/vllm_e2e/upstream_storage_tests.py vllm-0.34.0.tar.gz [--json OUT] [pytest args]

The test file comes from vLLM's source distribution (PyPI's
vllm-0.33.0.tar.gz, or a source checkout) and is changed in one way only:
its import of ``SingleWriterShmObjectStorage``, ``SingleWriterShmRingBuffer``
and ``MsgpackSerde`` from ``vllm.distributed.device_communicators.shm_object_storage``
imports them from ``pinshm.vllm.cache`` instead. Tests that check a
behaviour pinshm changes on purpose are run too: they fail by design, and
the report says which and why (``DIFFERS``). With ``--json``, the counts
go to OUT (upstream_queue_tests.py writes the queue's beside them): the
one place the docs take them from.
"""

from __future__ import annotations

import os
import sys
import tempfile

from upstream_queue_tests import read_test, run_and_report

ORIGINAL = "from vllm.distributed.device_communicators.shm_object_storage import ("
SWAPPED = "from pinshm.vllm.cache import ("

# Tests that check what pinshm changes on purpose: why each differs.
DIFFERS = {
    "test_blocking_unread_object": (
        "expects the put behind an unread object to fail (vLLM's ring stalls behind it); "
        "pinshm allocates around the unread object, and the put succeeds"
    ),
}

# The ring buffer's tests drive vLLM's ring as a standalone allocator. In
# pinshm the ring is the store's: vLLM's storage is its only user (vLLM
# never allocates from the ring outside its storage), and the class keeps
# only what the storage's callers touch (handle, close, clear).
_BY_STORE = (
    "drives vLLM's ring allocator directly (allocate_buf/access_buf/free_buf); "
    "pinshm's ring is allocated by its store's put only"
)
DIFFERS_BUFFER: dict[str, str] = {
    "test_allocation_and_free": _BY_STORE,
    "test_buffer_access": _BY_STORE,
    "test_clear_buffer": _BY_STORE,
    "test_memory_error_on_full_buffer": _BY_STORE,
    "test_allocation_cycles": "reads vLLM's ring metadata size (MD_SIZE) and allocates from the ring directly",
    "test_buffer_opening": (
        "opens a second ring from handle() alone as a stdlib SharedMemory (pinshm's ring lives in its store's segment)"
    ),
}


#: Per suite: the test file, and the tests that differ by design (why).
SUITES = {
    "storage": ("tests/distributed/test_shm_storage.py", DIFFERS),
    "buffer": ("tests/distributed/test_shm_buffer.py", DIFFERS_BUFFER),
}


def main() -> int:
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        return 2
    source, rest = args[0], args[1:]
    worst = 0
    for suite, (test, differs) in SUITES.items():
        try:
            text = read_test(source, test)
        except (StopIteration, FileNotFoundError):
            print(f"{test}: not in {source}, skipped")
            continue
        if ORIGINAL not in text:
            print(f"{test} no longer imports the storage classes as expected: not run")
            worst = 2
            continue
        with tempfile.TemporaryDirectory(prefix="pinshm-upstream-") as tmp:
            with open(os.path.join(tmp, os.path.basename(test)), "w") as f:
                f.write(text.replace(ORIGINAL, SWAPPED, 1))
            worst = max(worst, run_and_report(suite, source, tmp, differs, rest))
    return worst


if __name__ == "__main__":
    sys.exit(main())
