#!/usr/bin/env python3
"""The crate's public API as a sorted list, one item per line, committed
as docs/public-api.txt and diffed in CI (`--check`), so that a change to
the surface is a reviewed change to that file.

It reads rustdoc's JSON (stable rustdoc with RUSTC_BOOTSTRAP=1, so no
nightly toolchain is needed) for the default build and for `--features
cuda`; an item only the latter has is marked `[cuda]`. Items hidden from
the docs (`#[doc(hidden)]`, the `testing` module) are not API and are not
listed. Each line names the item by the path a user writes, with its
kind and, for functions, methods and fields, its signature.

    tools/public_api.py            # print the list
    tools/public_api.py --write    # update docs/public-api.txt
    tools/public_api.py --check    # fail (and show the diff) if it differs
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LISTED = ROOT / "docs" / "public-api.txt"
Item = dict[str, Any]
# The root keeps the types a user starts from; the rest lives in its room.
ROOT_MOST = 15


def rustdoc_json(features: list[str]) -> dict[str, Any]:
    env = dict(os.environ, RUSTC_BOOTSTRAP="1")
    cmd = ["cargo", "rustdoc", "--lib", "-q", *features, "--", "-Z", "unstable-options",
           "--output-format", "json"]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    with open(target / "doc" / "pinshm.json") as f:
        data: dict[str, Any] = json.load(f)
    return data


def render(t: Any) -> str:
    """A type from rustdoc's JSON, written as in source (near enough)."""
    if t is None:
        return "()"
    (kind, v), = t.items()
    if kind == "primitive":
        return str(v)
    if kind == "generic":
        return str(v)
    if kind == "resolved_path":
        return str(v["path"]) + render_args(v.get("args"))
    if kind == "borrowed_ref":
        life = f"{v['lifetime']} " if v.get("lifetime") else ""
        return f"&{life}{'mut ' if v['is_mutable'] else ''}{render(v['type'])}"
    if kind == "raw_pointer":
        return f"*{'mut' if v['is_mutable'] else 'const'} {render(v['type'])}"
    if kind == "slice":
        return f"[{render(v)}]"
    if kind == "array":
        return f"[{render(v['type'])}; {v['len']}]"
    if kind == "tuple":
        return "(" + ", ".join(render(x) for x in v) + ")"
    if kind in ("impl_trait", "dyn_trait"):
        bounds = v if kind == "impl_trait" else v["traits"]
        names = []
        for b in bounds:
            if isinstance(b, dict) and "trait_bound" in b:
                tr = b["trait_bound"]["trait"]
                names.append(str(tr["path"]) + render_args(tr.get("args")))
            elif isinstance(b, dict) and "trait" in b:
                names.append(str(b["trait"]["path"]) + render_args(b["trait"].get("args")))
            elif isinstance(b, dict) and "outlives" in b:
                names.append(str(b["outlives"]))
        word = "impl" if kind == "impl_trait" else "dyn"
        return f"{word} " + " + ".join(names)
    if kind == "qualified_path":
        return f"<{render(v['self_type'])}>::{v['name']}"
    if kind == "function_pointer":
        sig = v["sig"]
        ins = ", ".join(render(x[1]) for x in sig["inputs"])
        return f"fn({ins}) -> {render(sig.get('output'))}"
    return kind


def render_args(args: Any) -> str:
    if not args or "angle_bracketed" not in args:
        return ""
    out = []
    for a in args["angle_bracketed"]["args"]:
        if "type" in a:
            out.append(render(a["type"]))
        elif "lifetime" in a:
            out.append(str(a["lifetime"]))
        elif "const" in a:
            out.append(str(a["const"].get("expr", "_")))
    return "<" + ", ".join(out) + ">" if out else ""


def fn_sig(it: Item) -> str:
    f = it["inner"]["function"]
    h = f["header"]
    words = ("const " if h["is_const"] else "") + ("unsafe " if h["is_unsafe"] else "")
    ins = []
    for name, t in f["sig"]["inputs"]:
        if name == "self":
            r = render(t)
            ins.append({"Self": "self", "&Self": "&self", "&mut Self": "&mut self"}.get(r, f"self: {r}"))
        else:
            ins.append(f"{name}: {render(t)}")
    out = f["sig"].get("output")
    ret = f" -> {render(out)}" if out is not None else ""
    gen = [p["name"] for p in f["generics"]["params"] if not p["name"].startswith("'")
           and "lifetime" not in p.get("kind", {})]
    gens = f"<{', '.join(gen)}>" if gen else ""
    return f"{words}fn {it['name']}{gens}({', '.join(ins)}){ret}"


def hidden(it: Item) -> bool:
    return any("doc(hidden)" in json.dumps(a) for a in it.get("attrs", []))


def walk(data: dict[str, Any]) -> set[str]:
    index: dict[str, Item] = data["index"]
    lines: set[str] = set()

    def get(i: Any) -> Item | None:
        return index.get(str(i))

    def non_exhaustive(it: Item) -> str:
        return "#[non_exhaustive] " if any("non_exhaustive" in json.dumps(a) for a in it.get("attrs", [])) else ""

    def impls(it: Item, path: str, ids: list[Any]) -> None:
        for i in ids:
            imp = get(i)
            if imp is None:
                continue
            im = imp["inner"]["impl"]
            if im.get("is_synthetic") or im.get("blanket_impl") is not None:
                continue
            if im.get("trait"):
                lines.add(f"{path}: impl {im['trait']['path']}{render_args(im['trait'].get('args'))}")
                continue
            for j in im["items"]:
                m = get(j)
                if m is None or m.get("visibility") != "public" or hidden(m):
                    continue
                if "function" in m["inner"]:
                    lines.add(f"{path}::{m['name']}: pub {fn_sig(m)}")
                elif "assoc_const" in m["inner"]:
                    lines.add(f"{path}::{m['name']}: pub const {render(m['inner']['assoc_const']['type'])}")

    def item(it: Item, path: str) -> None:
        if hidden(it):
            return
        (kind, v), = it["inner"].items()
        if kind == "module":
            lines.add(f"{path}: pub mod")
            for i in v["items"]:
                child = get(i)
                if child is None:
                    continue
                if "use" in child["inner"]:
                    u = child["inner"]["use"]
                    target = get(u["id"]) if u.get("id") is not None else None
                    if target is None or hidden(child):
                        if not hidden(child):
                            lines.add(f"{path}::{u['name']}: pub use {u['source']}")
                        continue
                    if path == "pinshm" and "::" in u["source"]:
                        # A root re-export of an item listed in its room.
                        lines.add(f"{path}::{u['name']}: pub use pinshm::{u['source']}")
                        continue
                    item(target, f"{path}::{u['name']}")
                elif child.get("visibility") == "public":
                    item(child, f"{path}::{child['name']}")
        elif kind == "struct":
            lines.add(f"{path}: {non_exhaustive(it)}pub struct")
            sk = v["kind"]
            fields = sk.get("plain", {}).get("fields", []) if isinstance(sk, dict) else []
            for fi in fields:
                f = get(fi)
                if f and f.get("visibility") == "public" and not hidden(f):
                    lines.add(f"{path}::{f['name']}: pub field {render(f['inner']['struct_field'])}")
            impls(it, path, v["impls"])
        elif kind == "enum":
            lines.add(f"{path}: {non_exhaustive(it)}pub enum")
            for vi in v["variants"]:
                var = get(vi)
                if var and not hidden(var):
                    lines.add(f"{path}::{var['name']}: variant")
            impls(it, path, v["impls"])
        elif kind == "trait":
            unsafe = "unsafe " if v.get("is_unsafe") else ""
            lines.add(f"{path}: pub {unsafe}trait")
            for j in v["items"]:
                m = get(j)
                if m and "function" in m["inner"]:
                    lines.add(f"{path}::{m['name']}: {fn_sig(m)}")
        elif kind == "function":
            lines.add(f"{path}: pub {fn_sig(it)}")
        elif kind == "constant":
            lines.add(f"{path}: pub const {render(v['type'])}")
        elif kind == "type_alias":
            lines.add(f"{path}: pub type = {render(v['type'])}")
        else:
            lines.add(f"{path}: pub {kind}")

    root = index[str(data["root"])]
    item(root, "pinshm")
    return lines


def listing() -> str:
    plain = walk(rustdoc_json([]))
    cuda = walk(rustdoc_json(["--features", "cuda"]))
    rows = sorted(plain | cuda)
    out = [r if r in plain else f"{r}  [cuda]" for r in rows]
    head = ("# pinshm's public API, generated by tools/public_api.py (do not edit; "
            "CI fails when the code's API differs from this list).\n")
    return head + "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="update docs/public-api.txt")
    ap.add_argument("--check", action="store_true", help="fail if docs/public-api.txt differs")
    a = ap.parse_args()
    now = listing()
    if a.write:
        LISTED.write_text(now)
        return 0
    if a.check:
        was = LISTED.read_text() if LISTED.exists() else ""
        if was != now:
            sys.stdout.writelines(difflib.unified_diff(
                was.splitlines(True), now.splitlines(True), "docs/public-api.txt", "the code"))
            print("public API changed: review the diff, then run tools/public_api.py --write",
                  file=sys.stderr)
            return 1
        root = [ln for ln in now.splitlines()[1:] if ln.split(": ")[0].count("::") == 1]
        if len(root) > ROOT_MOST:
            print(f"the crate root exports {len(root)} items (at most {ROOT_MOST}): "
                  + ", ".join(ln.split(":")[0] for ln in root), file=sys.stderr)
            return 1
        print(f"public API: {now.count(chr(10)) - 1} lines, {len(root)} at the root, as listed")
        return 0
    sys.stdout.write(now)
    return 0


if __name__ == "__main__":
    sys.exit(main())
