"""What is in /dev/shm, typed: a read-only look at one segment
(`inspect_segment`, as ``python -m pinshm inspect``) and the segments
whose writer is gone (`gc_segments`, as ``python -m pinshm gc``).

Both read anyone's segments and refuse a FIFO or other special file
(`UntrustedError`); neither can disturb a running store. The results are
frozen dataclasses; ``to_dict()`` gives the JSON that ``--json`` prints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

from ._pinshm import _gc_segments, _inspect_segment

__all__ = ["Abandoned", "Blocker", "ReaderEntry", "Slot", "Snapshot", "gc_segments", "inspect_segment"]


@dataclass(frozen=True)
class ReaderEntry:
    """One row of a store's reader table (a reader entry)."""

    #: The entry's number (`StoreReader.index`).
    index: int
    #: ``vacant``, ``attaching``, ``attached``, ``left`` or ``corrupt``.
    state: str
    #: The process that attached into it last.
    pid: int
    #: Whether that process still runs (it holds the entry's lock).
    alive: bool
    #: Milliseconds since its last acknowledged read (None: never).
    last_ack_ms_ago: Optional[int]
    #: The first object id whose reads it owes.
    counted_from: int
    #: How many of its reads were of an object already gone.
    stale_reads: int
    #: Guards, views and leases it holds now (its current attach only).
    holds: int
    #: How many times a reader attached into this entry.
    generation: int


@dataclass(frozen=True)
class Slot:
    """One object's slot in the data region."""

    address: int
    #: The object's id (0: free, skipped or being written).
    monotonic_id: int
    #: Payload bytes.
    size: int
    #: ``raw``, ``tensor``, ``item`` (or ``unknown``).
    kind: str
    #: Times it was put or handed out by ``get_cached``.
    refs: int
    #: Reads each reader entry still owes (one number, all readers
    #: together, in aggregate mode).
    reads_owed: tuple[int, ...]
    #: Holds per reader entry.
    holds: tuple[int, ...]


@dataclass(frozen=True)
class Blocker:
    """The oldest object in use: the first the writer must allocate around."""

    address: int
    monotonic_id: int
    size: int
    #: Who holds it or owes reads of it, in words.
    why: str


@dataclass(frozen=True)
class Snapshot:
    """Everything the inspector read from one store segment."""

    #: As in /dev/shm/NAME.
    name: str
    layout_version: int
    #: The segment's epoch (a handle of another epoch is of a replaced segment).
    epoch: int
    #: Bytes of the data region.
    capacity: int
    max_object_size: int
    #: A cache: objects owe no reads.
    cache: bool
    #: Reads counted in aggregate (vLLM's mode) rather than per reader.
    aggregate_reads: bool
    #: What kind of store it is, in words.
    store_kind: str
    #: The writer's pid (0 after a clean exit), and whether it runs.
    writer_pid: int
    writer_alive: bool
    #: Whose file it is, and its permission bits.
    owner_uid: int
    mode: int
    #: The id the next put gets; ids below ``cleared_below`` were cleared.
    next_id: int
    cleared_below: int
    #: The allocator's cursor and high-water mark in the data region.
    cursor: int
    high_water: int
    readers: tuple[ReaderEntry, ...]
    #: Entries held by live readers, and free for the next attach.
    entries_used: int
    entries_free: int
    #: Slots from the oldest to the newest.
    slots: tuple[Slot, ...]
    #: None: every live object may be reclaimed.
    blocker: Optional[Blocker]
    #: The text ``python -m pinshm inspect`` prints.
    report: str
    #: What happened to each ``(address, id)`` asked about, in order.
    explanations: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """The snapshot as plain data (what ``inspect --json`` prints)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Abandoned:
    """A segment whose writer is gone."""

    name: str
    #: ``store`` or ``channel``.
    kind: str
    #: Bytes of /dev/shm it holds.
    bytes: int
    #: None where unknown.
    writer_pid: Optional[int]
    #: Whose file it is.
    owner_uid: int
    #: Whether this call removed it (False in a dry run, or if it went meanwhile).
    removed: bool

    def to_dict(self) -> dict[str, Any]:
        """As plain data (what ``gc --json`` prints)."""
        return dataclasses.asdict(self)


def inspect_segment(name: str, handles: Optional[Iterable[tuple[int, int]]] = None) -> Snapshot:
    """Segment `name` (as in /dev/shm/NAME), read-only: its header, reader
    table and slots, the oldest object in use, the report ``python -m
    pinshm inspect`` prints, and what happened to each ``(address, id)``
    of `handles` (say, from a `StaleError`). `NotFoundError` if there is no
    such segment."""
    d = _inspect_segment(name, list(handles) if handles is not None else None)
    b = d["blocker"]
    return Snapshot(
        name=d["name"],
        layout_version=d["layout_version"],
        epoch=d["epoch"],
        capacity=d["capacity"],
        max_object_size=d["max_object_size"],
        cache=d["cache"],
        aggregate_reads=d["aggregate_reads"],
        store_kind=d["store_kind"],
        writer_pid=d["writer_pid"],
        writer_alive=d["writer_alive"],
        owner_uid=d["owner_uid"],
        mode=d["mode"],
        next_id=d["next_id"],
        cleared_below=d["cleared_below"],
        cursor=d["ring_cursor"],
        high_water=d["ring_high_water"],
        readers=tuple(ReaderEntry(**r) for r in d["readers"]),
        entries_used=d["entries_used"],
        entries_free=d["entries_free"],
        slots=tuple(
            Slot(**{**s, "reads_owed": tuple(s["reads_owed"]), "holds": tuple(s["holds"])}) for s in d["slots"]
        ),
        blocker=Blocker(**b) if b is not None else None,
        report=d["report"],
        explanations=tuple(d["explanations"]),
    )


def gc_segments(prefix: str = "", dry_run: bool = True) -> list[Abandoned]:
    """The segments in /dev/shm whose name starts with `prefix` and whose
    writer is gone. With `dry_run` (the default) nothing is removed; else
    each is removed under the dead writer's liveness lock, after checking
    that the name still names the file looked at."""
    return [Abandoned(**a) for a in _gc_segments(prefix, dry_run)]
