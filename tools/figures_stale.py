"""Whether the code a figure measured changed after it was measured.

A figure names the source paths its numbers depend on (`sources=a,b`);
its results' stamp names the commit it measured. The figure is stale when
a commit after that one touched any of those paths, or the work tree has
uncommitted changes to them, unless the commit says, in a trailer line of
its message, that it changed no measured behaviour:

    Measured-unchanged: import paths and docs only

(a reviewed claim, listed by `git log --grep`). A stale figure fails the
check, unless its block says why it was not measured again
(`stale="no GPU lent since"`): then the check renders that, with the
paths that changed, into the figure, where a reader sees it.

Standard library only; needs git and the repository's history.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

TRAILER = "Measured-unchanged:"
ATTR = re.compile(r'([a-z-]+)=("([^"]*)"|\S+)')


def attrs(text: str) -> dict[str, str]:
    """`key=value key2="a value"` as a dict."""
    return {m.group(1): m.group(3) if m.group(3) is not None else m.group(2) for m in ATTR.finditer(text)}


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)


def changed_since(root: Path, commit: str, paths: list[str]) -> tuple[list[str], str]:
    """(the paths among `paths` changed after `commit`, an error): by a
    commit after it without the trailer, or uncommitted in the work tree."""
    if not _git(root, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").stdout.strip():
        if _git(root, "rev-parse", "--is-shallow-repository").stdout.strip() == "true":
            return [], "this clone is shallow: the check needs the history (git fetch --unshallow)"
        return [], f"its stamp's commit {commit} is not in this repository's history"
    if _git(root, "merge-base", "--is-ancestor", commit, "HEAD").returncode != 0:
        return [], f"its stamp's commit {commit} is not an ancestor of HEAD (measured on another branch)"
    log = _git(root, "log", "--format=%H%x1f%B%x1e", f"{commit}..HEAD", "--", *paths)
    if log.returncode != 0:
        return [], f"git log failed: {log.stderr.strip()}"
    changed: set[str] = set()
    for entry in log.stdout.split("\x1e"):
        if not entry.strip():
            continue
        sha, _, body = entry.strip().partition("\x1f")
        if any(line.startswith(TRAILER) for line in body.splitlines()):
            continue
        files = _git(root, "diff-tree", "--no-commit-id", "--name-only", "-r", "--root", sha, "--", *paths)
        changed.update(f for f in files.stdout.split() if f)
    dirty = _git(root, "status", "--porcelain", "--untracked-files=all", "--", *paths)
    changed.update(line[3:].split(" -> ")[-1] for line in dirty.stdout.splitlines() if line.strip())
    return sorted(changed), ""


def verdict(root: Path, where: str, commit: str, spec: dict[str, str]) -> tuple[str, list[str]]:
    """(a line to render into the figure, problems) for a block whose
    attributes are `spec` and whose results were measured at `commit`."""
    paths = [p for p in spec.get("sources", "").split(",") if p]
    if not paths:
        return "", [f"{where}: names no sources (sources=PATH,PATH: the code its numbers depend on)"]
    missing = [p for p in paths if not (root / p).exists()]
    if missing:
        return "", [f"{where}: sources that do not exist: {', '.join(missing)}"]
    changed, error = changed_since(root, commit, paths)
    if error:
        return "", [f"{where}: {error}"]
    if not changed:
        return "", []
    shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
    why = spec.get("stale")
    if why:
        return f"<sub>**Not measured again since commit {commit}**, though {shown} changed: {why}.</sub>\n", []
    return "", [
        f"{where}: measured at commit {commit}, and {shown} changed since: measure it again (and stamp "
        f'it), say why not (stale="..."), or delete the figure; a commit that changes no measured '
        f"behaviour says so in a '{TRAILER}' trailer"
    ]
