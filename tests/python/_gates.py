"""Gates that prove a thread got somewhere instead of sleeping for it."""

import contextlib
import sys
import threading


@contextlib.contextmanager
def calling(name, entered, nth=1):
    """Within the block, sets `entered` (a threading.Event) when this thread
    makes its `nth` call of a C function named `name`. The event fires
    just before the call: the thread has got that far (it is not a thread
    that has not run yet), and whatever the caller does next lands either
    just before the call starts waiting or while it waits; pinshm's
    blocking calls give the same outcome both ways (a cancel is seen
    before a wait starts, and wakes one in progress)."""
    seen = 0

    def hook(frame, event, arg):
        nonlocal seen
        if event == "c_call" and getattr(arg, "__name__", None) == name:
            seen += 1
            if seen == nth:
                entered.set()

    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(None)


def in_call(name, target, nth=1):
    """A daemon thread running `target()` and an Event set at its `nth`
    call of `name` (see `calling`); started."""
    entered = threading.Event()

    def run():
        with calling(name, entered, nth):
            target()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, entered
