"""``python -m pinshm inspect NAME`` and ``python -m pinshm doctor``
(see :mod:`pinshm.cli`)."""

from .cli import main

raise SystemExit(main())
