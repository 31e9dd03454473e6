"""``python -m pinshm`` (and the ``pinshm`` console script):

- ``inspect NAME [ADDRESS:ID ...]``: a live or abandoned segment, as the
  Rust ``pinshm-inspect`` shows it (the same inspector, through the
  binding): readers and their state, holds, occupancy, the oldest blocker,
  and what happened to each ``ADDRESS:ID`` of a Stale error. ``--json``
  prints the structured snapshot instead.
- ``gc [--prefix P] [--dry-run] [--json]``: removes the segments whose
  writer is gone (it died, or exited without removing the name), each
  checked against the dead writer's liveness lock; ``--dry-run`` lists
  them only. Live writers' segments and other programs' files are never
  touched.
- ``doctor``: checks a machine before vLLM starts (:mod:`pinshm.doctor`);
  ``--gpu`` adds the GPU kit's checks on this machine's GPU
  (:mod:`pinshm.doctor.gpu`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, Callable, Optional


def _handle(text: str) -> tuple[int, int]:
    address, sep, ident = text.strip("'").partition(":")
    if not sep or not address.isdigit() or not ident.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not of the form ADDRESS:ID")
    return int(address), int(ident)


def _bounded(kind: type, low: float, high: float, what: str) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` within [low, high]."""

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"{what} must be from {low:g} to {high:g}, not {text}")
        return v

    return parse


def _prog() -> str:
    """`pinshm` when run as the console script, `python -m pinshm` else."""
    return "pinshm" if os.path.basename(sys.argv[0]) == "pinshm" else "python -m pinshm"


def _version() -> str:
    from . import _pinshm

    cuda = _pinshm.cuda_status()
    built = "with the cuda feature" if cuda.get("feature") else "CPU only (no cuda feature)"
    return f"pinshm {_pinshm.__version__} ({built})"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=_prog(),
        description="pinshm's tools for a machine that runs it: look into a segment, remove dead writers' "
        "segments, check the machine before vLLM starts.",
    )
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", required=True, metavar="{inspect,gc,doctor}")
    i = sub.add_parser(
        "inspect",
        usage="%(prog)s [-h] [--json] NAME [ADDRESS:ID ...]",
        help="show a segment in /dev/shm (read-only)",
        description="Show a store or channel in /dev/shm, live or abandoned, without changing it: its writer, "
        "readers and their state, objects and holds, occupancy, and what blocks reclamation. With ADDRESS:ID "
        "arguments (from a Stale error), say what happened to each object.",
    )
    # Optional to argparse, which would otherwise say ADDRESS:ID is
    # required too: main() says what is missing.
    i.add_argument("name", nargs="?", metavar="NAME", help="the segment's name, as in /dev/shm/NAME")
    i.add_argument("handles", nargs="*", type=_handle, metavar="ADDRESS:ID", help="explain a Stale error's handle")
    i.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    g = sub.add_parser(
        "gc",
        help="remove the segments in /dev/shm whose writer is gone",
        description="Remove the segments whose writer died or exited without removing the name, each checked "
        "against its writer's liveness lock. Live writers' segments, other users' and other programs' files "
        "are never touched.",
    )
    g.add_argument("--prefix", default="", help="only names that start with this")
    g.add_argument("--dry-run", action="store_true", help="list them, remove nothing")
    g.add_argument("--json", action="store_true", help="print what was found as JSON")
    d = sub.add_parser(
        "doctor",
        help="check /dev/shm, CUDA, vLLM and the start method before vLLM starts",
        description="Check this machine before vLLM starts with pinshm: /dev/shm against a plan of pinshm's "
        "stores and queues (from the options below), the CUDA driver, vLLM and the worker start method. "
        "What cannot be checked here is said, not passed.",
    )
    d.add_argument(
        "--cache-gib",
        type=_bounded(float, 0, 1 << 20, "--cache-gib"),
        default=4.0,
        help="planned --mm-processor-cache-gb (vLLM's default: 4)",
    )
    d.add_argument(
        "--tp",
        type=_bounded(int, 1, 1024, "--tp"),
        default=1,
        help="planned --tensor-parallel-size (workers on this node)",
    )
    d.add_argument(
        "--mq-chunk-mib",
        type=_bounded(int, 1, 1 << 16, "--mq-chunk-mib"),
        default=16,
        help="VLLM_MQ_MAX_CHUNK_BYTES_MB (vLLM's default: 16)",
    )
    d.add_argument("--tensor-arena", action="store_true", help="planned --enable-shm-tensor-arena")
    d.add_argument(
        "--shm-mib",
        type=_bounded(int, 1, 1 << 30, "--shm-mib"),
        default=None,
        help="plan for a /dev/shm of this size (default: this one's)",
    )
    d.add_argument("--json", action="store_true", help="print the checks as JSON")
    d.add_argument(
        "--gpu", action="store_true", help="also pin, copy and time on this machine's GPU (needs torch and a GPU)"
    )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line (``python -m pinshm`` and the ``pinshm`` script):
    its exit code. Output into a closed pipe (``doctor --json | head``)
    ends quietly, as a Unix tool's does."""
    try:
        code = _main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would flush stdout again at exit and fail once more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    return code


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "inspect" and not args.name:
        print(f"usage: {parser.prog} inspect [-h] [--json] NAME [ADDRESS:ID ...]", file=sys.stderr)
        print(
            f"{parser.prog} inspect: a segment's NAME is required (as in /dev/shm/NAME); ADDRESS:ID is optional",
            file=sys.stderr,
        )
        return 2
    if args.command == "inspect":
        from . import PinshmError
        from .segments import inspect_segment

        name = args.name.removeprefix("/dev/shm/").lstrip("/")
        try:
            snap = inspect_segment(name, args.handles)
        except (PinshmError, OSError, ValueError) as e:
            print(f"pinshm inspect: {e}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(snap.to_dict(), indent=2))
            return 0
        print(snap.report, end="")
        for (address, ident), why in zip(args.handles, snap.explanations):
            print(f"\n{address}:{ident}: {why}")
        return 0
    if args.command == "gc":
        return _gc(args.prefix, args.dry_run, args.json)
    from . import doctor

    plan = doctor.Plan(
        cache_gib=args.cache_gib,
        tp=args.tp,
        mq_chunk_mib=args.mq_chunk_mib,
        tensor_arena=args.tensor_arena,
        shm_mib=args.shm_mib,
    )
    checks = doctor.run(plan)
    if args.gpu:
        from .doctor import gpu

        checks += gpu.run()
    if args.json:
        print(json.dumps([dataclasses.asdict(c) for c in checks], indent=2))
    else:
        print(doctor.format_report(checks))
    return 1 if any(c.status == doctor.FAIL for c in checks) else 0


def _gc(prefix: str, dry_run: bool, as_json: bool) -> int:
    from . import PinshmError
    from .segments import gc_segments

    try:
        found = gc_segments(prefix, dry_run)
    except (PinshmError, OSError) as e:
        print(f"pinshm gc: {e}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps([a.to_dict() for a in found], indent=2))
        return 0
    for a in found:
        what = "would remove" if dry_run else "removed" if a.removed else "gone meanwhile:"
        pid = f", writer pid {a.writer_pid} gone" if a.writer_pid else ", writer gone"
        owner = "" if a.owner_uid == os.geteuid() else f", uid {a.owner_uid}'s"
        print(f"{what} /dev/shm/{a.name} ({a.kind}, {a.bytes / 2**20:.1f} MiB{pid}{owner})")
    if not found:
        print("pinshm gc: no segment of a dead writer" + (f" under {prefix!r}" if prefix else ""))
    return 0
