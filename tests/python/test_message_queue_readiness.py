"""vLLM 0.34's readiness calls on pinshm's MessageQueue: ``readable()`` (a
peek that never consumes) and ``spin_until_readable(pending, deadline)``
(a wait that ends on a message, on input in `pending`, or at the
deadline), which vLLM 0.34's engine core calls on its workers' response
queues every step. No test depends on timing: waits that a lost wake-up
would make endless have generous deadlines, and each check is on what
the call returned or left behind."""

import threading
import time
from collections import deque

import numpy as np
import pytest

from pinshm.vllm.queue import MessageQueue

MIB = 1 << 20
LONG = 30.0  # a deadline no correct wait reaches


def pair(unique_name, closing, chunk=1 << 16):
    mq = closing(MessageQueue(1, 1, max_chunk_bytes=chunk, max_chunks=4, name=unique_name()))
    rd = closing(MessageQueue.create_from_handle(mq.export_handle(), 0))
    mq.wait_until_ready()
    rd.wait_until_ready()
    return mq, rd


@pytest.mark.parametrize("size", [16, 4 * MIB], ids=["in-a-chunk", "through-the-store"])
def test_readable_is_a_peek_that_never_consumes_a_message(unique_name, closing, size):
    mq, rd = pair(unique_name, closing)
    assert rd.readable() is False
    payload = np.arange(size // 8, dtype=np.int64)
    mq.enqueue({"step": 1, "out": payload})
    for _ in range(50):
        assert rd.readable() is True
    got = rd.dequeue(timeout=LONG)
    assert got["step"] == 1 and np.array_equal(got["out"], payload)
    assert rd.readable() is False, "the message was taken by dequeue, not by readable"


def test_spin_until_readable_returns_at_the_deadline_when_nothing_comes(unique_name, closing):
    _, rd = pair(unique_name, closing)
    deadline = time.monotonic() + 0.05
    rd.spin_until_readable([], deadline)
    assert time.monotonic() >= deadline
    assert rd.readable() is False


def test_spin_until_readable_returns_at_once_when_input_is_pending(unique_name, closing):
    _, rd = pair(unique_name, closing)
    t0 = time.monotonic()
    rd.spin_until_readable(["a request"], t0 + LONG)
    assert time.monotonic() < t0 + LONG
    assert rd.readable() is False


def test_spin_until_readable_wakes_for_a_message_sent_by_another_thread(unique_name, closing):
    mq, rd = pair(unique_name, closing)
    sent = threading.Event()

    def send():
        sent.wait()
        mq.enqueue("the step's output")

    t = threading.Thread(target=send)
    t.start()
    sent.set()
    rd.spin_until_readable(deque(), time.monotonic() + LONG)
    assert rd.readable() is True, "it returned before the deadline only because the message came"
    t.join()
    assert rd.dequeue(timeout=LONG) == "the step's output"


def test_spin_until_readable_sees_input_added_by_another_thread_while_it_waits(unique_name, closing):
    # vLLM's engine core: its input thread appends to the deque it passes.
    _, rd = pair(unique_name, closing)
    pending = deque()
    started = threading.Event()

    def add_input():
        started.wait()
        pending.append("ADD")

    t = threading.Thread(target=add_input)
    t.start()
    t0 = time.monotonic()
    started.set()
    rd.spin_until_readable(pending, t0 + LONG)
    t.join()
    assert pending and time.monotonic() < t0 + LONG
    assert rd.readable() is False


def test_after_shutdown_both_raise_cancelled_and_a_wait_in_progress_ends(unique_name, closing):
    _, rd = pair(unique_name, closing)
    outcome = []
    started = threading.Event()

    def wait():
        started.set()
        try:
            rd.spin_until_readable([], time.monotonic() + LONG)
            outcome.append("returned")
        except RuntimeError as e:
            outcome.append(str(e))

    t = threading.Thread(target=wait)
    t.start()
    started.wait()
    rd.shutdown()
    t.join(LONG)
    assert outcome == ["cancelled"]
    with pytest.raises(RuntimeError, match="cancelled"):
        rd.readable()
    with pytest.raises(RuntimeError, match="cancelled"):
        rd.spin_until_readable([], time.monotonic() + 1)


def test_a_writer_cannot_ask_for_readability(unique_name, closing):
    mq, _ = pair(unique_name, closing)
    with pytest.raises(RuntimeError, match="Only readers"):
        mq.readable()
    with pytest.raises(RuntimeError, match="Only readers"):
        mq.spin_until_readable([], time.monotonic() + 1)


def test_a_gone_writer_makes_the_reader_readable_so_dequeue_fails_at_once(unique_name, closing):
    mq, rd = pair(unique_name, closing)
    mq.enqueue("last")
    mq.close()
    assert rd.readable() is True
    assert rd.dequeue(timeout=LONG) == "last"
    # Nothing more will come: readable, and dequeue raises instead of waiting.
    assert rd.readable() is True
    with pytest.raises(Exception, match="(?i)writer"):
        rd.dequeue(timeout=LONG)


def test_a_remote_reader_polls_its_socket_and_never_consumes(unique_name, closing):
    pytest.importorskip("zmq")
    mq = closing(MessageQueue(1, 0, [], connect_ip="127.0.0.1", name=unique_name()))
    rd = closing(MessageQueue.create_from_handle(mq.export_handle(), 0))
    mq.wait_until_ready()
    rd.wait_until_ready()
    assert rd.readable() is False
    deadline = time.monotonic() + LONG
    rd.spin_until_readable([], deadline)  # one short poll of the socket, then back
    assert time.monotonic() < deadline
    mq.enqueue({"remote": 1})
    rd.spin_until_readable([], time.monotonic() + LONG)
    # The socket delivers in its own time: poll until it has the message.
    end = time.monotonic() + LONG
    while not rd.readable() and time.monotonic() < end:
        rd.spin_until_readable([], end)
    assert rd.readable() is True and rd.readable() is True
    assert rd.dequeue(timeout=LONG) == {"remote": 1}
    assert rd.readable() is False


ENGINE_LOOP = __import__("pathlib").Path(__file__).resolve().parents[2] / "examples/vllm_e2e/engine_loop.py"


@pytest.mark.parametrize("mode, shm_mib", [("1", None), ("1", 64), ("auto", 64)])
def test_vllm_034s_own_engine_loop_runs_over_pinshms_queue(mode, shm_mib):
    """vLLM 0.34's real collective_rpc(non_block=True) and
    EngineCoreProc._wait_for_output, forked workers, every response checked
    (examples/vllm_e2e/engine_loop.py); in a container's 64 MiB /dev/shm,
    auto must build pinshm's queue. Where vLLM 0.34 is installed only."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("vllm", reason="vLLM is not installed (never in CI)")
    from vllm.distributed.device_communicators import shm_broadcast

    if not hasattr(shm_broadcast.MessageQueue, "readable"):
        pytest.skip("the installed vLLM is older than 0.34 (no readable(): its engine never calls it)")
    if shm_mib and subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot create a mount namespace here (needs root and unshare)")
    cmd = [sys.executable, str(ENGINE_LOOP), "--mode", mode, "--steps", "40"]
    if shm_mib:
        cmd += ["--shm-mib", str(shm_mib)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["inputs_handled"] == result["inputs"], result
    assert set(result["queues"].values()) == {"pinshm.vllm.queue.message_queue"}, result
