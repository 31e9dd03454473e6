"""``python -m pinshm`` (and the ``pinshm`` console script):

- ``inspect NAME [ADDRESS:ID ...]``: a live or abandoned segment, as the
  Rust ``pinshm-inspect`` shows it (the same inspector, through the
  binding): readers and their state, holds, occupancy, the oldest blocker,
  and what happened to each ``ADDRESS:ID`` of a Stale error. ``--json``
  prints the structured snapshot instead.
- ``doctor``: checks a machine before vLLM starts (:mod:`pinshm.doctor`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Optional


def _handle(text: str) -> tuple[int, int]:
    address, sep, ident = text.strip("'").partition(":")
    if not sep or not address.isdigit() or not ident.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not of the form ADDRESS:ID")
    return int(address), int(ident)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pinshm", description="pinshm's tools for a machine that runs it")
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="show a segment in /dev/shm (read-only)")
    i.add_argument("name", help="the segment's name, as in /dev/shm/NAME")
    i.add_argument("handles", nargs="*", type=_handle, metavar="ADDRESS:ID", help="explain a Stale error's handle")
    i.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    d = sub.add_parser("doctor", help="check /dev/shm, CUDA, vLLM and the start method before vLLM starts")
    d.add_argument("--cache-gib", type=float, default=4.0, help="planned --mm-processor-cache-gb (vLLM's default: 4)")
    d.add_argument("--tp", type=int, default=1, help="planned --tensor-parallel-size (workers on this node)")
    d.add_argument("--mq-chunk-mib", type=int, default=16, help="VLLM_MQ_MAX_CHUNK_BYTES_MB (vLLM's default: 16)")
    d.add_argument("--tensor-arena", action="store_true", help="planned --enable-shm-tensor-arena")
    d.add_argument("--shm-mib", type=int, default=None, help="plan for a /dev/shm of this size (default: this one's)")
    d.add_argument("--json", action="store_true", help="print the checks as JSON")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "inspect":
        from . import PinshmError, _pinshm

        name = args.name.removeprefix("/dev/shm/").lstrip("/")
        try:
            snap = _pinshm.inspect_segment(name, args.handles)
        except (PinshmError, OSError, ValueError) as e:
            print(f"pinshm inspect: {e}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(snap, indent=2))
            return 0
        print(snap["report"], end="")
        for (address, ident), why in zip(args.handles, snap["explanations"]):
            print(f"\n{address}:{ident}: {why}")
        return 0
    from . import doctor

    plan = doctor.Plan(
        cache_gib=args.cache_gib,
        tp=args.tp,
        mq_chunk_mib=args.mq_chunk_mib,
        tensor_arena=args.tensor_arena,
        shm_mib=args.shm_mib,
    )
    checks = doctor.run(plan)
    if args.json:
        print(json.dumps([dataclasses.asdict(c) for c in checks], indent=2))
    else:
        print(doctor.format_report(checks))
    return 1 if any(c.status == doctor.FAIL for c in checks) else 0
