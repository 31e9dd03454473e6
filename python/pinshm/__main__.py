"""``python -m pinshm inspect NAME`` and ``python -m pinshm doctor``
(see :mod:`pinshm.cli`, which also ends quietly into a closed pipe)."""

from .cli import main

raise SystemExit(main())
