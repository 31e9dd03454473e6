#!/usr/bin/env python3
"""Checks the repository's documentation (standard library only, well under
a second):

1. every relative link in a tracked Markdown file (`[text](target)`,
   `![alt](target)`, `[ref]: target`) names a file or folder tracked in
   the repository, and a `#anchor`, where given, names a heading (GitHub's
   slugs) or an `id`/`name` in the file it points at;
2. no tracked Markdown file, and no tracked text file under docs/ or
   examples/, names a path of one machine as a location (`/work/...`,
   `/root/...`, `/home/...`, `/tmp/...` and the like). System paths that
   exist everywhere (/dev/shm, /proc, /sys, /usr, ...) are fine;
3. every figure is what its stamped results file renders, no figure was
   measured at another layout version than the code's, and no results
   file goes unused (tools/figures.py --check; its self-test with
   --self-test);
4. README.md stays under 300 lines;
5. no user doc (README.md, SECURITY.md, docs/) cites the project's own
   issue numbers ("issue 41"), which a user cannot look up.

Usage: tools/check_docs.py [ROOT]   (default: the repository this file is in)
       tools/check_docs.py --self-test
Exits 1 and names file:line for each problem."""
import os
import re
import subprocess
import sys
import tempfile
import urllib.parse

README_LINES = 300

# Paths that only exist on the machine where a doc was written.
MACHINE_PATH = re.compile(
    r"(?<![\w.~:/$-])/(?:work|root|home|tmp|Users|mnt|scratch)(?=/|\b)[^\s`'\"()\[\]<>,;]*"
)
# The project's own issue numbers, which a reader of the docs cannot open.
OWN_ISSUE = re.compile(r"\bissues? #?\d+\b", re.IGNORECASE)
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ID = re.compile(r"""<[^>]+\b(?:id|name)\s*=\s*["']([^"']+)["']""")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
TEXT_EXT = {".md", ".py", ".rs", ".sh", ".txt", ".toml", ".json", ".jsonl", ".cfg", ".ini", ".yml", ".yaml"}


def tracked_files(root):
    """Tracked files (relative, '/'-separated), or every file when git is
    not available (a plain copy of the tree)."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z"], capture_output=True, check=True)
        files = [f for f in out.stdout.decode().split("\0") if f]
        # Deleted in the work tree but not yet in the index: gone.
        return {f for f in files if os.path.lexists(os.path.join(root, f))}
    except (OSError, subprocess.CalledProcessError):
        found = set()
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if x not in (".git", "target")]
            for n in names:
                found.add(os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/"))
        return found


def prose_lines(text):
    """(line number, line) outside fenced code blocks."""
    fenced = None
    for no, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            if fenced is None:
                fenced = m.group(1)
            elif m.group(1) == fenced:
                fenced = None
            continue
        if fenced is None:
            yield no, line


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text):
    seen, out = {}, set()
    for _, line in prose_lines(text):
        out.update(HTML_ID.findall(line))
        m = HEADING.match(line)
        if m:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def check(root):
    root = os.path.abspath(root)
    files = tracked_files(root)
    dirs = {"/".join(f.split("/")[:i]) for f in files for i in range(1, f.count("/") + 1)}
    problems, cache = [], {}

    def read(rel):
        if rel not in cache:
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
                cache[rel] = fh.read()
        return cache[rel]

    for md in sorted(f for f in files if f.endswith(".md")):
        text = read(md)
        for no, line in prose_lines(text):
            bare = INLINE_CODE.sub("", line)
            targets = LINK.findall(bare)
            m = REF_DEF.match(bare)
            if m:
                targets.append(m.group(1))
            for target in targets:
                if SCHEME.match(target):
                    continue  # http:, https:, mailto:
                path, _, anchor = target.partition("#")
                path = urllib.parse.unquote(path)
                if path.startswith("/"):
                    problems.append(f"{md}:{no}: link {target!r} is absolute; make it relative")
                    continue
                if path:
                    rel = os.path.normpath(os.path.join(os.path.dirname(md), path)).replace(os.sep, "/")
                    if rel.startswith("../") or rel == "..":
                        problems.append(f"{md}:{no}: link {target!r} leaves the repository")
                        continue
                    if rel not in files and rel not in dirs and rel != ".":
                        problems.append(f"{md}:{no}: link {target!r}: no tracked file {rel}")
                        continue
                else:
                    rel = md
                if anchor and rel.endswith(".md") and rel in files:
                    if urllib.parse.unquote(anchor).lower() not in anchors(read(rel)):
                        problems.append(f"{md}:{no}: link {target!r}: no heading #{anchor} in {rel}")

    scanned = sorted(
        f for f in files
        if f.endswith(".md")
        or (f.split("/")[0] in ("docs", "examples") and os.path.splitext(f)[1] in TEXT_EXT)
    )
    for rel in scanned:
        for no, line in enumerate(read(rel).splitlines(), 1):
            m = MACHINE_PATH.search(line)
            if m:
                problems.append(
                    f"{rel}:{no}: {m.group(0)!r} is one machine's path;"
                    " use a path relative to the repository or a placeholder (VENV, DIR)"
                )
            m = OWN_ISSUE.search(line)
            user_facing = rel in ("README.md", "SECURITY.md", "CHANGELOG.md") or rel.startswith("docs/")
            if m and (user_facing or os.path.basename(rel).startswith("RESULTS-")):
                problems.append(f"{rel}:{no}: {m.group(0)!r}: a project issue a user cannot look up; say what it was")
    readme = os.path.join(root, "README.md")
    if os.path.exists(readme):
        n = read("README.md").count("\n")
        if n >= README_LINES:
            problems.append(f"README.md: {n} lines; the front page stays under {README_LINES} (move detail to docs/)")
    return problems, len(scanned)


def self_test():
    """The check passes a good tree and names each planted fault."""
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "docs"))
        good = {
            "README.md": "# Top\n\n[guide](docs/guide.md#two-words) ![p](docs/p.png) [s](#top)\n"
                         "[web](https://example.com/home/x) `/dev/shm/pinshm-x` and /proc/self\n"
                         "```\n[not a link](missing.md) /work/in/a/fence is still scanned\n```\n",
            "docs/guide.md": "# Guide\n\n## Two words\n\n[up](../README.md)\n",
            "docs/p.png": "",
        }
        for name, body in good.items():
            with open(os.path.join(d, name), "w") as fh:
                fh.write(body.replace("/work/in/a/fence is still scanned", "a fence"))
        problems, _ = check(d)
        assert not problems, problems
        bad = {
            "docs/bad.md": "[a](nowhere.md)\n[b](guide.md#no-such-heading)\n[c](../../outside.md)\n"
                           "run `cd /work/tree` first\nas issue 41 asked\n",
        }
        bad["README.md"] = good["README.md"].replace("/work/in/a/fence is still scanned", "a fence") + "x\n" * 300
        for name, body in bad.items():
            with open(os.path.join(d, name), "w") as fh:
                fh.write(body)
        problems, _ = check(d)
        want = ["no tracked file docs/nowhere.md", "no heading #no-such-heading", "leaves the repository",
                "'/work/tree'", "the front page stays under 300", "'issue 41'"]
        for w in want:
            assert any(w in p for p in problems), (w, problems)
        assert len(problems) == len(want), problems
    print("check_docs self-test: a good tree passes, each planted fault is named")


def main():
    if sys.argv[1:] == ["--self-test"]:
        self_test()
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import figures_selftest
        import stub_keywords

        figures_selftest.self_test()
        stub_keywords.self_test()
        return 0
    here = os.path.dirname(os.path.abspath(__file__))
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..")
    problems, n = check(root)
    sys.path.insert(0, here)
    import figures
    import stub_keywords

    problems += figures.run(figures.Path(root).resolve(), write=False)
    problems += stub_keywords.run(stub_keywords.Path(root).resolve(), write=False)
    for p in problems:
        print(p)
    if problems:
        print(f"docs check: {len(problems)} problem(s)")
        return 1
    print(f"docs check: links and paths fine in {n} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
