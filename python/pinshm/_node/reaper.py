"""A process tree's reaper (:mod:`.tracker`): reads ``+ DEV INO NAME`` and
``- DEV INO NAME`` lines on stdin until every writer of the pipe is gone,
then removes each segment still told of, if the name still names that
file and no live writer holds it. Run as ``python -S PATH/reaper.py``
(a script: no package import until the end), by :mod:`.tracker` only."""

from __future__ import annotations

import os
import signal
import sys
import time

#: How long a segment whose writer still holds its lock is asked again.
LINGER_S = 5.0


def main() -> int:
    # The engine's Ctrl-C and SIGTERM are for the engine: this outlives it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.argv[1:] == ["--detach"]:
        # Fork; the first process says the second's pid and exits, so the
        # reaper is nobody's child (an engine that kills its process tree
        # leaves it running).
        pid = os.fork()
        if pid:
            sys.stdout.write(f"{pid}\n")
            sys.stdout.flush()
            os._exit(0)
        os.close(1)
        os.open(os.devnull, os.O_WRONLY)
    told: dict[tuple[str, int, int], None] = {}
    for raw in sys.stdin.buffer:
        parts = raw.rstrip(b"\n").split(b" ", 3)
        if len(parts) != 4 or parts[0] not in (b"+", b"-"):
            continue
        try:
            entry = (parts[3].decode(), int(parts[1]), int(parts[2]))
        except ValueError:
            continue
        if parts[0] == b"+":
            told[entry] = None
        else:
            told.pop(entry, None)
    if not told:
        return 0
    # Imported only now: the start costs the engine's cores as little as
    # it can (PYTHONPATH, set by the tracker, finds the package).
    from pinshm._pinshm import InUseError, PinshmError, _remove_if_abandoned_file

    # The pipe's end closes as the last process exits, maybe before its
    # other descriptors (a segment's, with its writer's lock): a writer
    # still alive is asked again, for a while.
    deadline = time.monotonic() + LINGER_S
    left = list(told)
    while left:
        alive = []
        for name, dev, ino in left:
            try:
                _remove_if_abandoned_file(name, dev, ino)
            except InUseError:
                alive.append((name, dev, ino))  # its writer lives (or it is being made): asked again
            except (PinshmError, OSError):
                pass  # another's file, gone, untrusted: left alone
        if not alive or time.monotonic() >= deadline:
            break
        left = alive
        time.sleep(0.02)
    return 0


if __name__ == "__main__":
    sys.exit(main())
