"""``python -m pinshm inspect NAME`` and ``python -m pinshm doctor``
(see :mod:`pinshm.cli`)."""

import os
import sys

from .cli import main

try:
    code = main()
    sys.stdout.flush()
except BrokenPipeError:
    # The reader went away (`doctor --json | head`): quiet, as a Unix tool
    # is. Python would flush stdout again at exit and fail once more.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    code = 0
raise SystemExit(code)
