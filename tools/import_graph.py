#!/usr/bin/env python3
"""Import graphs of the Rust crate and of the Python package.

src/: one node per top-level module (a file or folder under src/), an edge
for every `crate::X` path that leaves the module. Exits 1 on an edge that
does not point down the layer order below (the layers of docs/design.md,
as src/lib.rs lists them), on a module missing from that order, on a
cycle, or on a Rust file over 800 lines.

python/pinshm: one node per module (a package is its __init__), an edge
for every import of a pinshm module, at module level or inside a function
(`from .x import y`, `from . import x`, `import pinshm.x`): a package's
__init__ runs before its submodules, so `from .pkg import mod` is an edge
to both. Exits 1 on a cycle, on an import of an entry point (ENTRY_POINTS:
nothing may import them), or on a module over 800 lines.

Inside folders: one node per Rust file of src/ and of python/src (the
binding), an edge for every `super::x`, `self::x` and `crate::a::b` path
(in `use` lists too) that names another file; exits 1 on a cycle between
files (store::reader <-> store::guard, say), not only between top-level
modules. The size limits hold for tests/, examples/, benches/ and tools/
too: 800 lines of Rust, 800 of Python. The bounds are smell detectors,
not targets: a file is one idea a reader can name, split by subject (a
file near a bound is asked whether it holds two ideas, never cut to fit).
In tools/ and each examples/ folder, scripts that import their siblings
must not import in a circle either."""
import os, re, sys

# Lowest first: a module may import only modules before it.
LAYERS = ["dtype", "layout", "error", "sys", "atomics", "ring", "geometry", "codec",
          "cuda", "pin", "copy", "device", "store", "channel", "inspect"]

SRC = os.path.join(os.path.dirname(__file__), "..", "src")
mods = sorted({n[:-3] if n.endswith(".rs") else n for n in os.listdir(SRC)
              if n not in ("lib.rs", "bin") and (n.endswith(".rs") or os.path.isdir(os.path.join(SRC, n)))})
edges, too_long = {m: set() for m in mods}, []
for root, _, files in os.walk(SRC):
    for f in files:
        path = os.path.join(root, f)
        rel = os.path.relpath(path, SRC).split(os.sep)
        if rel[0] in ("lib.rs", "bin") or not f.endswith(".rs"):
            continue
        me = rel[0][:-3] if rel[0].endswith(".rs") else rel[0]
        text = open(path).read()
        if text.count("\n") > 800:
            too_long.append((path, text.count("\n")))
        code = re.sub(r"//[^\n]*", "", text)  # doc links are not imports
        for m in re.findall(r"\bcrate::(\w+)", code):
            if m in edges and m != me:
                edges[me].add(m)
        # super:: from a top-level file reaches lib.rs; from a folder, stays inside
for m in mods:
    print(f"{m:10} -> {', '.join(sorted(edges[m])) or '-'}")
def find_cycles(graph):
    """Every cycle a depth-first walk of `graph` ({node: set of nodes}) meets."""
    state, stack, found = {}, [], []
    def visit(m):
        state[m] = 1; stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop(); state[m] = 2
    for m in graph:
        if m not in state:
            visit(m)
    return found
cycles = find_cycles(edges)
for c in cycles:
    print("CYCLE:", " -> ".join(c))
upward = []
for m in mods:
    if m not in LAYERS:
        upward.append(f"{m} is not in the layer order (add it to LAYERS and src/lib.rs)")
        continue
    for n in sorted(edges[m]):
        if n in LAYERS and LAYERS.index(n) >= LAYERS.index(m):
            upward.append(f"{m} -> {n} points up the layer order")
for u in upward:
    print("LAYER:", u)
PY = os.path.join(os.path.dirname(__file__), "..", "python", "pinshm")
# Entry points: loaded by their host (vLLM loads the plugin and the encoder-cache
# connector), never imported.
ENTRY_POINTS = {"pinshm.vllm.plugin", "pinshm.vllm.ec_connector"}


def py_modules():
    """{dotted name: path} of every module of the Python package."""
    found = {}
    for root, _, files in os.walk(PY):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, f), os.path.dirname(PY))[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                found[".".join(rel)] = os.path.join(root, f)
    return found


def py_imports(name, path, modules):
    """The pinshm modules `name` (at `path`) imports, anywhere in it."""
    import ast

    is_pkg = path.endswith("__init__.py")
    package = name if is_pkg else name.rpartition(".")[0]
    # The packages `name` sits in have run (or are running) their __init__
    # before it: reaching them again through a longer path is no edge.
    parts = name.split(".")
    ancestors = {".".join(parts[:i]) for i in range(1, len(parts))}
    out = set()

    def reach(target, itself=True):
        # Importing a.b.c runs a, a.b and a.b.c: each of them is reached.
        # `itself`: the module the statement names counts even when it is
        # an ancestor (`import pinshm`, `from .. import __version__`).
        steps = target.split(".")
        for i in range(1, len(steps) + 1):
            t = ".".join(steps[:i])
            if t in modules and (t not in ancestors or (itself and i == len(steps))):
                out.add(t)

    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            for a in node.names:
                reach(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            # `from . import mod` names the package only to reach `mod`.
            reach(target, itself=len(subs) < len(node.names))
            for sub in subs:
                reach(sub)
    out.discard(name)
    return out


# ---- inside folders: one node per Rust file ------------------------------
def rust_files(src):
    """{module path (store::reader): file} of every .rs file under `src`
    but the crate root and binaries."""
    found = {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(root, f), src)[:-3].split(os.sep)
            if rel[0] in ("lib", "bin", "main"):
                continue
            if rel[-1] == "mod":
                rel = rel[:-1]
            found["::".join(rel)] = os.path.join(root, f)
    return found


def rust_file_edges(src):
    """Edges between the files of `src`: `super::x` (a sibling), `self::x`
    (a child), `crate::a::b` (the deepest file the path names), in `use`
    lists too (`use super::{a::X, b}`)."""
    files = rust_files(src)
    edges = {m: set() for m in files}
    for m, path in files.items():
        code = re.sub(r"//[^\n]*", "", open(path).read())
        parent = m.split("::")[:-1] if not path.endswith("mod.rs") else m.split("::")
        here = m.split("::") if path.endswith("mod.rs") else m.split("::")
        refs = []
        for kw, base in (("super", parent[:-1] if path.endswith("mod.rs") else parent),
                         ("self", here if path.endswith("mod.rs") else here),
                         ("crate", [])):
            for g in re.finditer(rf"\b{kw}::(\{{[^}}]*\}}|[\w:]+)", code):
                body = g.group(1)
                items = [x.strip() for x in body.strip("{}").split(",")] if body.startswith("{") else [body]
                for it in items:
                    parts = [x for x in re.split(r"::", it) if re.fullmatch(r"\w+", x)]
                    refs.append(base + parts)
        for r in refs:
            # The longest prefix that names a file.
            for n in range(len(r), 0, -1):
                t = "::".join(r[:n])
                if t in files:
                    if t != m and not m.startswith(t + "::") and not t.startswith(m + "::"):
                        edges[m].add(t)
                    break
    return edges, files


file_cycles = []
for label, src in (("src", SRC), ("python/src", os.path.join(os.path.dirname(__file__), "..", "python", "src"))):
    fedges, ffiles = rust_file_edges(src)
    for c in find_cycles(fedges):
        print(f"CYCLE ({label}, files):", " -> ".join(c))
        file_cycles.append(c)
    if label == "python/src":
        for p in ffiles.values():
            n = open(p).read().count("\n")
            if n > 800:
                too_long.append((p, n))
cycles += file_cycles

# ---- tests and examples: the same size limits -----------------------------
TOP = os.path.join(os.path.dirname(__file__), "..")
for folder in ("tests", "examples", "benches", "tools"):
    for root, _, files in os.walk(os.path.join(TOP, folder)):
        for f in files:
            limit = 800 if f.endswith(".rs") or f.endswith(".py") else None
            if limit is None:
                continue
            p = os.path.join(root, f)
            n = open(p).read().count("\n")
            if n > limit:
                too_long.append((p, n))

# ---- tools/ and each examples/ folder: scripts importing their siblings --
for folder in [os.path.join(TOP, "tools")] + sorted(
    os.path.join(TOP, "examples", d) for d in os.listdir(os.path.join(TOP, "examples"))
):
    if not os.path.isdir(folder):
        continue
    sibs = {f[:-3]: os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".py")}
    sedges = {m: set() for m in sibs}
    for m, p in sibs.items():
        for g in re.finditer(r"^\s*(?:from\s+(\w+)\s+import|import\s+(\w+))", open(p).read(), re.M):
            n = g.group(1) or g.group(2)
            if n in sibs and n != m:
                sedges[m].add(n)
    for c in find_cycles(sedges):
        print(f"CYCLE ({os.path.relpath(folder, TOP)}):", " -> ".join(c))
        cycles.append(c)

py_mods = py_modules()
py_edges = {m: py_imports(m, p, py_mods) for m, p in sorted(py_mods.items())}
for m, deps in py_edges.items():
    print(f"{m:34} -> {', '.join(sorted(deps)) or '-'}")
py_cycles = find_cycles(py_edges)
for c in py_cycles:
    print("CYCLE:", " -> ".join(c))
cycles += py_cycles
entry = [f"{m} imports {e}, an entry point" for m, deps in py_edges.items() for e in sorted(deps & ENTRY_POINTS)]
for e in entry:
    print("ENTRY:", e)
for m, path in py_mods.items():
    n = open(path).read().count("\n")
    if n > 800:
        too_long.append((path, n))
for p, n in too_long:
    print(f"TOO LONG: {p} has {n} lines")
sys.exit(1 if cycles or too_long or upward or entry else 0)
