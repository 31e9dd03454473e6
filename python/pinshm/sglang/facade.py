"""What the SGLang adapter tells the rest of pinshm about itself (``pinshm
doctor`` reads it here, never the adapter's private modules): the SGLang
version, whether pinshm's class fits it, and the package SGLang's HTTP
tokenizer workers import to be bound. Importing it imports no SGLang."""

from __future__ import annotations

from ._fit import TESTED, misfit, sglang_version
from .plugin import WORKERS

__all__ = ["TESTED", "WORKERS", "misfit", "sglang_version"]
