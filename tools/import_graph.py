#!/usr/bin/env python3
"""Import graph of src/: one node per top-level module (a file or folder
under src/), an edge for every `crate::X` path that leaves the module.
Prints the edges; exits 1 on an edge that does not point down the layer
order below (DESIGN.md's layers, as src/lib.rs lists them), on a module
missing from that order, on a cycle, on a Rust file over 800 lines, or on
a module of the Python package (python/pinshm) over 500."""
import os, re, sys

# Lowest first: a module may import only modules before it.
LAYERS = ["dtype", "layout", "error", "sys", "atomics", "ring", "geometry", "codec",
          "cuda", "pin", "copy", "store", "channel", "inspect"]

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
state, stack, cycles = {}, [], []
def visit(m):
    state[m] = 1; stack.append(m)
    for n in edges[m]:
        if state.get(n) == 1:
            cycles.append(stack[stack.index(n):] + [n])
        elif n not in state:
            visit(n)
    stack.pop(); state[m] = 2
for m in mods:
    if m not in state:
        visit(m)
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
for root, _, files in os.walk(PY):
    for f in files:
        if f.endswith(".py"):
            path = os.path.join(root, f)
            n = open(path).read().count("\n")
            if n > 500:
                too_long.append((path, n))
for p, n in too_long:
    print(f"TOO LONG: {p} has {n} lines")
sys.exit(1 if cycles or too_long or upward else 0)
