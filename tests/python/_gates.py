"""Gates that prove a thread's state instead of sleeping for it."""

import contextlib
import sys
import threading


@contextlib.contextmanager
def calling(name, entered):
    """Within the block, sets `entered` (a threading.Event) when this thread
    calls a C function named `name`: the call is then under way (pinshm's
    blocking calls release the GIL and wait), not merely about to be made
    by a thread that has not yet run."""

    def hook(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", None) == name:
            entered.set()

    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(None)


def in_call(name, target):
    """A daemon thread running `target()` and an Event set once it calls
    `name` (see `calling`); started."""
    entered = threading.Event()

    def run():
        with calling(name, entered):
            target()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, entered
