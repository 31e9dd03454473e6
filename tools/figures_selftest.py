"""python3 tools/figures_selftest.py (also run by tools/check_docs.py
--self-test): the check of tools/figures.py fails on each planted error
(a stale layout, a hand edit, an unfilled or unused figure, a stray
results file, a bench run at another layout, an edit to a measured source
after the stamp, a results page with no stamp), and passes on a good tree.
It builds a small git repository of its own, since staleness is read from
git's history."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from figures import run


def _git(root: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin:/usr/local/bin"}
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def _commit(root: Path, message: str) -> str:
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "--allow-empty", "-m", message)
    return _git(root, "rev-parse", "--short", "HEAD")


def self_test() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _git(root, "init", "-q")
        (root / "src").mkdir()
        (root / "docs" / "results").mkdir(parents=True)
        (root / "src/layout.rs").write_text("pub const LAYOUT_VERSION: u32 = 9;\n")
        (root / "src/measured.rs").write_text("fn get() {}\n")
        (root / "README.md").write_text("# r\n")
        measured = _commit(root, "the code measured")
        res = root / "docs/results/k.jsonl"

        def stamp_at(commit: str) -> None:
            res.write_text(
                json.dumps({"stamp": {"layout_version": 9, "commit": commit, "command": "bench"}})
                + "\n"
                + json.dumps({"op": "get_guard", "median_ns": 40.0, "ratio": 1.0})
                + "\n"
            )

        stamp_at(measured)
        doc = root / "docs/perf.md"
        head = "<!-- figure bench-keys docs/results/k.jsonl sources=src/measured.rs -->\n"
        doc.write_text(f"# p\n\n{head}<!-- /figure -->\n")
        assert run(root, write=False), "an unfilled figure passes"
        assert run(root, write=True) == [] and run(root, write=False) == [], "a filled figure fails"
        assert "40.0 ns" in doc.read_text() and f"commit {measured}, layout 9" in doc.read_text()
        doc.write_text(doc.read_text().replace("40.0 ns", "39.0 ns"))
        assert any("not what its results render" in p for p in run(root, False)), "a hand edit passes"
        run(root, write=True)
        _commit(root, "the figure")
        # An edit to a measured source after the stamp: uncommitted, then
        # committed; a commit that says it changed nothing measured passes.
        (root / "src/measured.rs").write_text("fn get() { slower() }\n")
        assert any("src/measured.rs changed since" in p for p in run(root, False)), "an uncommitted edit passes"
        _commit(root, "a change to the measured code")
        assert any("src/measured.rs changed since" in p for p in run(root, False)), "a committed edit passes"
        (root / "src/measured.rs").write_text("fn get() {}\n")
        _commit(root, "undone\n\nMeasured-unchanged: the edit before, undone")
        assert any("changed since" in p for p in run(root, False)), "a trailer excused another commit"
        stamp_at(_git(root, "rev-parse", "--short", "HEAD~1"))  # measured again after the change
        (root / "src/other.rs").write_text("fn unrelated() {}\n")
        _commit(root, "code no figure measured")
        run(root, write=True)
        assert run(root, write=False) == [], "a trailer commit or an unmeasured path made it stale"
        # A stale figure that says why stays, and says so in its text.
        (root / "src/measured.rs").write_text("fn get() { slower() }\n")
        _commit(root, "a change to the measured code")
        doc.write_text(doc.read_text().replace(head, head.replace(" -->", ' stale="no GPU lent" -->')))
        run(root, write=True)
        assert run(root, write=False) == [] and "Not measured again since commit" in doc.read_text(), doc.read_text()
        doc.write_text(doc.read_text().replace(' stale="no GPU lent"', ""))
        stamp_at("0000000")
        assert any("not in this repository" in p for p in run(root, False)), "an unknown commit passes"
        stamp_at(_git(root, "rev-parse", "--short", "HEAD"))
        doc.write_text(doc.read_text().replace(" sources=src/measured.rs", ""))
        assert any("names no sources" in p for p in run(root, False)), "a figure with no sources passes"
        doc.write_text(doc.read_text().replace("k.jsonl -->", "k.jsonl sources=src/measured.rs -->"))
        run(root, write=True)
        assert run(root, write=False) == [], run(root, write=False)
        # An end-to-end results page: a stamp block, filled and checked.
        page = root / "docs/RESULTS-e2e.md"
        page.write_text("# e2e\n\n| a | b |\n")
        assert any("no results-stamp" in p for p in run(root, False)), "a results page with no stamp passes"
        head_sha = _git(root, "rev-parse", "--short", "HEAD")
        page.write_text(f"# e2e\n\n<!-- results-stamp commit={head_sha} sources=src/measured.rs -->\n"
                        "<!-- /results-stamp -->\n")
        run(root, write=True)
        assert run(root, write=False) == [] and f"Measured at commit {head_sha}" in page.read_text()
        (root / "src/measured.rs").write_text("fn get() { faster() }\n")
        assert any("results-stamp: measured at commit" in p for p in run(root, False)), "a stale page passes"
        _git(root, "checkout", "-q", "--", "src/measured.rs")
        (root / "src/layout.rs").write_text("pub const LAYOUT_VERSION: u32 = 10;\n")
        assert any("measured at layout 9" in p for p in run(root, False)), "a stale layout passes"
        (root / "src/layout.rs").write_text("pub const LAYOUT_VERSION: u32 = 9;\n")
        (root / "docs/results/unused.json").write_text('{"stamp": {}}\n')
        assert any("no figure uses" in p for p in run(root, False)), "an unused results file passes"
        (root / "docs/results/unused.json").unlink()
        (root / "docs/stray.json").write_text('{"stamp": {}}\n')
        assert any("docs/stray.json" in p for p in run(root, False)), "a results file outside results/ passes"
        (root / "docs/stray.json").unlink()
        # a bench's own runs: the renderer reads them whatever the ops, and a
        # run at another layout than the file's stamp reads as stale
        bench = root / "docs/results/bench.jsonl"
        rows = [{"op": "stamp", "commit": head_sha, "layout_version": 9}]
        rows += [{"op": op, "size": 1 << 20, "median_ns": 100.0, "memcpy_median_ns": 100.0, "ratio": 1.0}
                 for op in ("put", "a_new_op")]
        bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
        doc.write_text(doc.read_text()
                       + "\n<!-- figure bench-store docs/results/bench.jsonl sources=src/measured.rs -->\n"
                       "<!-- /figure -->\n")
        assert run(root, write=True) == [], "a bench's runs do not render"
        assert "`a_new_op`" in doc.read_text() and f"commit {head_sha}, layout 9" in doc.read_text()
        bench.write_text(bench.read_text() + json.dumps({**rows[0], "layout_version": 8}) + "\n")
        assert any("layout mixed" in p for p in run(root, False)), "a run at another layout passes"
    print(
        "figures self-test: the check fails on a stale layout, an edit to a measured source after the stamp "
        "(uncommitted or committed; a 'Measured-unchanged:' commit excuses only itself), a stamp of an "
        "unknown commit, a figure with no sources, a hand-edited, unfilled or unused figure, a stray results "
        "file, a results page with no stamp or a stale one, and a bench run at another layout; a stale "
        "figure that says why renders that"
    )


if __name__ == "__main__":
    self_test()
    print("figures self-test: a good tree passes, each planted fault is named")
