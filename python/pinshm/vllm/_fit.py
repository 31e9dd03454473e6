"""Whether pinshm's drop-ins fit the vLLM that is installed, checked before
anything is bound (by the plugin) and reported by ``python -m pinshm
doctor``: one function decides both.

vLLM moves monthly, and a class bound in place of vLLM's must offer what
vLLM calls on it. vLLM 0.34 added ``MessageQueue.readable`` and
``spin_until_readable``, which its engine calls every step: a queue
without them crashes the engine at its first step. So for each drop-in the
check compares vLLM's class with pinshm's:

- every public name of vLLM's class (methods, class attributes) must be
  pinshm's too, except the few in :data:`INTERNAL`, which vLLM calls only
  from inside its own class (each with the reason);
- every parameter vLLM's method declares must be one pinshm's method
  takes (a new argument vLLM passes would raise ``TypeError``), and
  pinshm's must require no argument vLLM's does not have;
- for the encoder-cache connector, which subclasses vLLM's base: every
  abstract method of ``ECConnectorBase`` is pinshm's own, and it and every
  method of the base that pinshm's overrides take the base's parameters.

Where a class does not fit, the plugin leaves vLLM's in place with one
WARNING naming what is missing and the vLLM version (the engine then runs
stock for that part, never crashes), and doctor reports a problem.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional

#: vLLM versions whose classes pinshm's drop-ins were checked against
#: (their tests run with pinshm bound: docs/vllm.md).
TESTED = ("0.32.0", "0.33.0", "0.34.0")

#: Public names of vLLM's classes that pinshm's lack on purpose: vLLM
#: calls them only from inside its own class (checked by grep over vLLM
#: 0.32-0.34's sources). Any other name vLLM's class gains makes it stay
#: vLLM's.
INTERNAL: dict[str, dict[str, str]] = {
    "MessageQueue": {
        "acquire_read": "the ring slot vLLM's own dequeue reads from",
        "acquire_write": "the ring slot vLLM's own enqueue writes to",
        "recv": "vLLM's dequeue reads its overflow socket with it",
        "ReadTimeoutWithWarnings": "acquire_read's timer (auto forwards it to vLLM's class)",
    },
    "SingleWriterShmObjectStorage": {
        "copy_to_buffer": "put's copy into vLLM's ring",
        "default_is_free_check": "vLLM's ring's reclamation callback",
        "increment_reader_flag": "get's flag update",
        "increment_writer_flag": "put's and get_cached's flag update",
    },
    "SingleWriterShmRingBuffer": {
        "byte2int": "vLLM's ring's header encoding",
        "int2byte": "vLLM's ring's header encoding",
    },
}

# The names inside vLLM that the plugin rebinds (read by the plugin, and
# by doctor through pinshm.vllm.facade, without loading the plugin).
#: Where vLLM 0.33's multimodal cache looks the storage classes up.
CACHE_MODULE = "vllm.multimodal.cache.shm"
#: The names rebound there.
REBOUND = ("SingleWriterShmRingBuffer", "SingleWriterShmObjectStorage", "MsgpackSerde")

#: Modules that look ``MessageQueue`` up: those that import it at module
#: level, and shm_broadcast itself (parallel_state imports it from there
#: inside its methods, so rebinding it there covers them). The first is
#: required; the others are optional parts of vLLM.
QUEUE_MODULES = (
    "vllm.distributed.device_communicators.shm_broadcast",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.executor.ray_executor_v2",
)

_SELF = ("self", "cls")
_P = inspect.Parameter


class NotFit(Exception):
    """A drop-in does not fit the installed vLLM; the message is the
    WARNING (:func:`not_fit_line`)."""


@dataclasses.dataclass
class Fit:
    """How pinshm's class for `what` fits vLLM's."""

    what: str
    #: What happens instead where it does not fit (the warning's tail).
    stays: str = "vLLM's class stays"
    #: Public names of vLLM's class that pinshm's lacks.
    missing: list[str] = dataclasses.field(default_factory=list)
    #: Methods whose parameters differ: "name(what differs)".
    mismatched: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.mismatched

    def describe(self) -> str:
        """What differs, in one clause (empty when it fits)."""
        parts = []
        if self.missing:
            parts.append("missing " + ", ".join(self.missing))
        if self.mismatched:
            parts.append("other parameters in " + ", ".join(self.mismatched))
        return "; ".join(parts)


def _params(f: Any) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(f)
    except (TypeError, ValueError):  # a builtin without a signature
        return None


def signature_gaps(ours: Any, theirs: Any) -> list[str]:
    """What keeps `ours` from being called as vLLM calls `theirs`: each
    parameter of vLLM's that ours does not take, and each that ours
    requires and vLLM's does not have (empty: it fits, or a signature
    cannot be read)."""
    o, t = _params(ours), _params(theirs)
    if o is None or t is None:
        return []
    op = o.parameters
    var_kw = any(p.kind is _P.VAR_KEYWORD for p in op.values())
    var_pos = any(p.kind is _P.VAR_POSITIONAL for p in op.values())
    gaps = []
    for name, p in t.parameters.items():
        if name in _SELF or p.kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD) or name in op:
            continue
        if p.kind is _P.KEYWORD_ONLY:
            taken = var_kw
        elif p.kind is _P.POSITIONAL_ONLY:
            taken = var_pos
        else:
            taken = var_kw and var_pos
        if not taken:
            gaps.append(name)
    if any(p.kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD) for p in t.parameters.values()):
        return gaps  # vLLM's passes on what it is given: it cannot be told
    for name, p in op.items():
        required = p.default is _P.empty and p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)
        if required and name not in _SELF and name not in t.parameters:
            gaps.append(f"requires {name}")
    return gaps


def public_names(cls: Any) -> list[str]:
    return sorted(n for n in dir(cls) if not n.startswith("_"))


def compare(what: str, vllm_class: Any, ours: Any, internal: Optional[dict[str, str]] = None, stays: str = "") -> Fit:
    """How `ours` fits `vllm_class` (see the module doc); `internal`:
    :data:`INTERNAL`'s entry for `what` unless given."""
    skip = INTERNAL.get(what, {}) if internal is None else internal
    fit = Fit(what, stays or Fit.stays)
    if vllm_class is ours:
        return fit
    for name in public_names(vllm_class) + ["__init__"]:
        if name in skip:
            continue
        theirs = inspect.getattr_static(vllm_class, name, None)
        if theirs is None:
            continue
        if not hasattr(ours, name):
            fit.missing.append(name)
            continue
        if name == "__init__" and theirs is object.__init__:
            continue
        gaps = signature_gaps(getattr(ours, name), getattr(vllm_class, name)) if callable(theirs) else []
        if gaps:
            fit.mismatched.append(f"{name}({', '.join(gaps)})")
    return fit


def compare_connector(base: Any, ours: Any) -> Fit:
    """How `ours` (a subclass of vLLM's connector `base`) fits: each of the
    base's abstract methods must be ours, taking what vLLM passes."""
    fit = Fit(ours.__name__, "an engine configured with it may fail; leave it out of ec_transfer_config")
    abstract = set(getattr(base, "__abstractmethods__", ()))
    # The abstract methods, and every method of the base that ours overrides
    # (vLLM calls those the base's way too).
    overridden = {n for n in vars(ours) if not n.startswith("_") and callable(getattr(base, n, None))}
    for name in sorted(abstract | overridden):
        mine = inspect.getattr_static(ours, name, None)
        if mine is None or getattr(mine, "__isabstractmethod__", False):
            fit.missing.append(name)
            continue
        gaps = signature_gaps(getattr(ours, name), getattr(base, name))
        if gaps:
            fit.mismatched.append(f"{name}({', '.join(gaps)})")
    return fit


def vllm_version() -> str:
    """The installed vLLM's own version string ("unknown" where it has none)."""
    import importlib
    import importlib.metadata

    try:
        return str(importlib.import_module("vllm").__version__)
    except Exception:  # noqa: BLE001 - a broken vLLM still gets a report
        try:
            return importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return "unknown"


def not_fit_line(fit: Fit, version: str) -> str:
    """The one WARNING (and doctor's problem) for a drop-in that does not
    fit: what differs, the vLLM version, what happens instead."""
    return (
        f"pinshm's {fit.what} does not fit vLLM {version}: {fit.describe()}; {fit.stays} "
        f"(pinshm is tested with vLLM {', '.join(TESTED)})"
    )


def vllm_queue_class(bound: Any) -> Any:
    """vLLM's own MessageQueue behind what is bound to the name (``auto``'s
    chooser keeps it as ``.vllm``)."""
    return getattr(bound, "vllm", bound)


def queue_fit(vllm_class: Any) -> Fit:
    from .queue import MessageQueue

    return compare("MessageQueue", vllm_queue_class(vllm_class), MessageQueue, stays="vLLM's MessageQueue stays in use")


def cache_fits(module: Any) -> list[Fit]:
    """The storage classes of vLLM's cache `module` (or vLLM's objects of
    those names) against pinshm's; MsgpackSerde is a serializer pinshm
    reimplements whole, with no method vLLM calls that it lacks."""
    from .cache import storage

    names = ("SingleWriterShmRingBuffer", "SingleWriterShmObjectStorage")
    stays = "vLLM's multimodal shm cache stays"
    return [compare(n, getattr(module, n), getattr(storage, n), stays=stays) for n in names if hasattr(module, n)]


def connector_fit(import_module: Callable[[str], Any]) -> Optional[Fit]:
    """PinshmECConnector against the installed vLLM's ``ECConnectorBase``;
    None where vLLM has no connector base (the connector cannot be
    configured there)."""
    try:
        base = import_module("vllm.distributed.ec_transfer.ec_connector.base").ECConnectorBase
    except Exception:  # noqa: BLE001 - a vLLM without encoder-cache connectors
        return None
    from .ec._connector import PinshmECConnector

    return compare_connector(base, PinshmECConnector)
