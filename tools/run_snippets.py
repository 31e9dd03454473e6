#!/usr/bin/env python3
"""Runs the docs' Python snippets as a newcomer would: with a given Python
(a fresh venv holding the wheel and only what the text says to install),
each ```python block of README.md and docs/*.md in its own interpreter,
from an empty directory. A block that imports a module the venv does not
have (vLLM, torch: docs whose text installs them) is listed as not run,
with that module; tests/python/test_docs_snippets.py runs those against a
stand-in. Exit 1 if a block that could run fails.

Usage: tools/run_snippets.py PYTHON [ROOT]
       tools/run_snippets.py --self-test PYTHON
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
IMPORT = re.compile(r"^\s*(?:from|import)\s+([A-Za-z_][\w]*)", re.MULTILINE)


def blocks(root):
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        if not path.exists():
            continue
        text = path.read_text()
        for m in FENCE.finditer(text):
            yield f"{path.relative_to(root)}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1)


def importable(python, names):
    """The names among `names` that `python` cannot import."""
    code = "import importlib.util, sys\nprint(' '.join(n for n in sys.argv[1:] if importlib.util.find_spec(n) is None))"
    out = subprocess.run([python, "-c", code, *names], capture_output=True, text=True, check=True)
    return out.stdout.split()


def run(python, root):
    ran, skipped, failed = 0, [], []
    for where, code in blocks(root):
        missing = importable(python, sorted(set(IMPORT.findall(code))))
        if missing:
            skipped.append(f"{where} (needs {', '.join(missing)})")
            continue
        with tempfile.TemporaryDirectory() as cwd:
            p = subprocess.run([python, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
        ran += 1
        if p.returncode != 0:
            failed.append(f"{where}: exit {p.returncode}\n{p.stderr[-2000:]}")
    return ran, skipped, failed


def main(argv):
    if argv[:1] == ["--self-test"]:
        with tempfile.TemporaryDirectory() as d:
            root = Path(d)
            (root / "docs").mkdir()
            (root / "README.md").write_text("```python\nimport json\nprint(json.dumps(1))\n```\n")
            (root / "docs" / "a.md").write_text(
                "```python\nimport no_such_module_here\n```\n```python\nraise SystemExit(3)\n```\n"
            )
            ran, skipped, failed = run(os.path.abspath(argv[1]) if os.sep in argv[1] else argv[1], root)
            assert (ran, len(skipped), len(failed)) == (2, 1, 1), (ran, skipped, failed)
            assert "no_such_module_here" in skipped[0] and "exit 3" in failed[0], (skipped, failed)
        print("run_snippets self-test: a good block passes, a broken one fails, a missing import is said")
        return 0
    python = os.path.abspath(argv[0])  # blocks run from an empty directory; not resolved: a venv's python is a link
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1]
    ran, skipped, failed = run(python, root)
    for s in skipped:
        print(f"not run here: {s}")
    for f in failed:
        print(f"FAILED {f}")
    print(f"docs snippets: {ran} run with {python}, {len(failed)} failed, {len(skipped)} need what this venv lacks")
    return 1 if failed or not ran else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
