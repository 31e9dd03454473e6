"""The release gate across fork(): a forked child polls its own gated
reads and never its parent's, and a child forked while the poller polls
never hangs (tests of test_release_gate.py's fixtures, in a file of their
own)."""

import time

import pinshm
from test_release_gate import DEADLINE_S, KIB, OBJ, eventually, gate, gated_read, small_store  # noqa: F401 - fixtures

def test_a_forked_child_polls_its_own_reads_and_never_its_parents(unique_name, closing, gate):
    import os

    from _fork import in_child

    store = small_store(unique_name, closing)
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    gated_read(store, reader, "a")  # the parent's, pending: never completes here
    theirs = gate[0]
    child_name = unique_name("child")

    def child():
        seen = theirs.queries
        cstore = pinshm.ObjectStore(3 * 64 * KIB, OBJ, 1, name=child_name)
        creader = pinshm.StoreReader.attach(cstore.handle(), 0)
        try:
            gated_read(cstore, creader, "c")
            gate[-1].done = True
            end = time.monotonic() + DEADLINE_S
            while cstore.free_unused() != 1:
                if time.monotonic() > end:
                    return 1  # its own read, completed, never released
                time.sleep(0.005)
            return 0 if theirs.queries == seen else 2  # 2: polled the parent's
        finally:
            creader.close()
            cstore.close()

    try:
        assert in_child(child) == 0
    finally:
        if os.path.exists(f"/dev/shm/{child_name}"):
            os.unlink(f"/dev/shm/{child_name}")
    # The parent's read is still pending, and still its poller's.
    assert store.free_unused() == 0
    theirs.done = True
    eventually(lambda: store.free_unused() == 1, "the parent's read, once completed")


FORK_ROUNDS = 200


def test_a_child_forked_while_the_poller_polls_never_hangs(unique_name, closing):
    # The poller locks its state about every pass without the GIL, and
    # `os.fork()` needs only the GIL: a child that inherited that lock held
    # must not wait for it. Many reads pend on an event that never
    # completes (a long pass, a busy poller), while each child makes a
    # gated read of its own, drops it, and flushes: every child exits 0,
    # and at once.
    import atexit
    import os
    import types

    from _fork import WAIT_S

    ev = types.SimpleNamespace(query=bool)  # bool() is False: never done
    pinshm.set_release_gate(lambda: ev)
    store = closing(pinshm.ObjectStore(3 * 64 * KIB, OBJ, 1, name=unique_name()))
    reader = closing(pinshm.StoreReader.attach(store.handle(), 0))
    h = store.put("a", b"a" * 64)
    guards = [reader.get(h) for _ in range(5000)]
    for g in guards:
        memoryview(g).release()
    del guards, g  # 5000 reads pend at once (no get in between flushes)
    child_name = unique_name("child")
    try:
        hung = []
        for round in range(FORK_ROUNDS):
            pid = os.fork()
            if pid == 0:
                code = 99
                try:
                    cstore = pinshm.ObjectStore(3 * 64 * KIB, OBJ, 1, name=child_name)
                    creader = pinshm.StoreReader.attach(cstore.handle(), 0)
                    ch = cstore.put("c", b"c" * 64)
                    cg = creader.get(ch)
                    memoryview(cg).release()
                    del cg  # pends in the child, on the child's poller
                    code = 0 if pinshm.flush_releases() == 1 else 1
                    creader.close()
                    cstore.close()
                    atexit._run_exitfuncs()
                    # The exit door counts only the child's threads: they
                    # count themselves out (the event waited for), where
                    # the parent's poller, had it been counted at the fork,
                    # never would. Bounded well inside the parent's guard.
                    end = time.monotonic() + WAIT_S / 3
                    while pinshm._pinshm._exit_door_passing() != 0:
                        if time.monotonic() > end:
                            code = 3
                            break
                        time.sleep(0.001)
                finally:
                    os._exit(code)
            deadline = time.monotonic() + WAIT_S
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    code = os.waitstatus_to_exitcode(status)
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    code = "hung"
                    break
                time.sleep(0.001)
            if os.path.exists(f"/dev/shm/{child_name}"):
                os.unlink(f"/dev/shm/{child_name}")
            if code != 0:
                hung.append((round, code))
                if len(hung) >= 2:
                    break
        assert not hung, hung
    finally:
        ev.query = lambda: True
        pinshm.set_release_gate(None)
        pinshm.flush_releases()
    eventually(lambda: store.free_unused() == 1, "the parent's reads, once completed")
