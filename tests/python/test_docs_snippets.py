"""Every ```python block of README.md and docs/*.md runs, as a user would
paste it: in a fresh interpreter, with the installed package, leaving
nothing in /dev/shm. A block that uses vLLM runs against the stand-in of
vLLM (_ec_vllm.py), whose `LLM` makes the connector the block configures
and refuses what the connector would not take (an unknown key of its
extra config, a value it rejects, a module or class that is not there)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _ec_vllm import install

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks():
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            yield pytest.param(m.group(1), id=f"{path.relative_to(ROOT)}:{line}")


def segments_of(pid):
    """Segments named by process `pid`: anonymous ones (pinshm-PID-...) and
    the stand-in's (pinshm-doc-PID-...)."""
    mine = (f"pinshm-{pid}-", f"pinshm-doc-{pid}-")
    return {n for n in os.listdir("/dev/shm") if n.startswith(mine)}


def test_the_docs_have_python_blocks():
    assert len(list(blocks())) >= 3, "the fence pattern no longer finds the docs' examples"


@pytest.mark.parametrize("code", blocks())
def test_a_python_block_of_the_docs_runs_as_pasted(code, tmp_path):
    env = dict(os.environ)
    if re.search(r"^\s*(from|import) vllm\b", code, re.MULTILINE):
        # For the block's interpreter only: this one's sys.path is left alone.
        install(str(tmp_path / "stand-in"), on_path=False)
        here = str(Path(__file__).resolve().parent)
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "stand-in"), here, env.get("PYTHONPATH", "")])
    p = subprocess.Popen(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = p.communicate(timeout=300)
    finally:
        p.kill()
        left = segments_of(p.pid)
        for n in left:
            os.unlink(f"/dev/shm/{n}")
    assert p.returncode == 0, f"{stdout[-2000:]}\n{stderr[-4000:]}"
    assert left == set(), "the block left a segment in /dev/shm"
