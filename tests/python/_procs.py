"""Spawned child processes for the tests: started, then joined with a
guard against a hang (not a timing assumption)."""

JOIN_S = 120


def start(ctx, target, *args):
    """Starts `target(*args)` in a child of context `ctx`."""
    p = ctx.Process(target=target, args=args)
    p.start()
    return p


def finish(p):
    """Joins `p`; it must have exited 0. A child still running after
    JOIN_S is killed (so pytest does not wait for it at exit) and fails
    the test."""
    p.join(JOIN_S)
    if p.exitcode is None:
        p.kill()
        p.join()
        raise AssertionError(f"child {p.pid} still running after {JOIN_S} s: killed")
    assert p.exitcode == 0, f"child exited with {p.exitcode}"
