"""The queue within the node's /dev/shm budget (pinshm._node.budget): its
slots are backed at start, a message /dev/shm cannot take arrives whole
another way, and a queue that cannot get its slots refuses at start,
naming the size it needs. Each runs in a private small /dev/shm."""

import pytest

from pinshm._node import budget as _budget

from _small_shm import run_in_small_dev_shm

# Fills /dev/shm but `keep` bytes, with a file removed at the end.
FILL = """
import os
def fill(keep):
    free = os.statvfs("/dev/shm").f_bavail * 4096
    with open("/dev/shm/filler", "wb") as f:
        f.truncate(free - keep)
        os.posix_fallocate(f.fileno(), 0, free - keep)
"""


def test_a_message_dev_shm_cannot_take_arrives_whole_in_pieces():
    out = run_in_small_dev_shm(
        FILL
        + """
import os
from pinshm.vllm.queue import MessageQueue
mq = MessageQueue(1, 1, max_chunk_bytes=64 << 10, max_chunks=4)
big = os.urandom(6 << 20)  # about a hundred pieces through 4 slots
want = [("before", 1), big, ("after", 2)]
pid = os.fork()
if pid == 0:  # the reader: a real process, as vLLM's workers are
    code = 1
    try:
        rd = MessageQueue.create_from_handle(mq.export_handle(), 0)
        rd.wait_until_ready()
        got = [rd.dequeue(timeout=100) for _ in range(3)]
        code = 0 if got == want else 2
    finally:
        os._exit(code)
try:
    mq.wait_until_ready()
    fill(1 << 20)  # less than vLLM's reserve: the overflow store cannot grow
    for m in want:
        mq.enqueue(m, timeout=100)
    _, status = os.waitpid(pid, 0)
    print("reader", os.waitstatus_to_exitcode(status))
finally:
    try:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
print("detours", mq.detours.messages)
mq.close(); os.unlink("/dev/shm/filler")
print("left", sorted(os.listdir("/dev/shm")))
""",
        size="16m",
    )
    assert out.returncode == 0, out.stderr
    assert "reader 0" in out.stdout  # every message, whole, in order
    assert "detours 1" in out.stdout
    assert "left []" in out.stdout
    assert "went through the queue's slots in pieces" in out.stderr


def test_a_started_queue_has_its_slots_backed_within_its_share():
    out = run_in_small_dev_shm(
        """
import os
from pinshm.vllm.queue import MessageQueue
# vLLM's executor queue: 10 chunks of 16 MiB; /dev/shm is 64 MiB.
mq = MessageQueue(2, 2, max_chunk_bytes=16 << 20, max_chunks=10)
name = mq._tx.name
print("resident", os.stat("/dev/shm/" + name).st_blocks * 512)
print("slot", mq._slot_bytes, "chunk", mq.max_chunk_bytes)
mq.close()
""",
        size="64m",
    )
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    resident, slot = int(words[1]), int(words[3])
    # A sixteenth of 64 MiB for 10 slots, in 64 KiB units; all backed.
    assert slot == (4 << 20) // 10 // (64 << 10) * (64 << 10)
    assert resident >= 10 * slot
    assert int(words[5]) == 16 << 20  # vLLM's chunk, as vLLM reads it


def test_a_queue_that_cannot_back_its_slots_refuses_at_start_naming_the_size():
    out = run_in_small_dev_shm(
        FILL
        + """
from pinshm.vllm.queue import MessageQueue
fill(512 << 10)
try:
    MessageQueue(1, 1, max_chunk_bytes=16 << 20, max_chunks=10)
except MemoryError as e:
    print("refused:", e)
""",
        size="16m",
    )
    assert out.returncode == 0, out.stderr
    assert "refused: pinshm MessageQueue: /dev/shm has 0.50 MiB free; a queue needs 2.62 MiB" in out.stdout


@pytest.mark.parametrize("mib", [16, 64, 1 << 15])
def test_the_cache_leaves_the_queues_and_vllm_their_parts(mib):
    size = mib << 20
    # The cache's headroom covers vLLM's reserve and the overflow's share;
    # the queues' slots are backed before any cache put (at start).
    assert _budget.cache_headroom(size) == _budget.vllm_reserve(size) + _budget.overflow_share(size)
    assert _budget.vllm_reserve(size) <= 8 << 20
    assert _budget.queue_slot_bytes(16 << 20, 10, size, size) * 10 <= _budget.queue_share(size)
