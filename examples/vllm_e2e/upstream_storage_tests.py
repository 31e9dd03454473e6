"""Runs vLLM 0.33.0's own storage tests (tests/distributed/test_shm_storage.py)
against pinshm's drop-ins, in a venv with vLLM and torch (never in CI).

    V/bin/python examples/vllm_e2e/upstream_storage_tests.py vllm-0.33.0.tar.gz [--json OUT] [pytest args]

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

TEST = "tests/distributed/test_shm_storage.py"
ORIGINAL = "from vllm.distributed.device_communicators.shm_object_storage import ("
SWAPPED = "from pinshm.vllm.cache import ("

# Tests that check what pinshm changes on purpose: why each differs.
DIFFERS = {
    "test_blocking_unread_object": (
        "expects the put behind an unread object to fail (vLLM's ring stalls behind it); "
        "pinshm allocates around the unread object, and the put succeeds"
    ),
}


def main() -> int:
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        return 2
    source, rest = args[0], args[1:]
    with tempfile.TemporaryDirectory(prefix="pinshm-upstream-") as tmp:
        text = read_test(source, TEST)
        if ORIGINAL not in text:
            print(f"{TEST} no longer imports the storage classes as expected: not run")
            return 2
        with open(os.path.join(tmp, "test_shm_storage.py"), "w") as f:
            f.write(text.replace(ORIGINAL, SWAPPED, 1))
        return run_and_report("storage", source, tmp, DIFFERS, rest)


if __name__ == "__main__":
    sys.exit(main())
