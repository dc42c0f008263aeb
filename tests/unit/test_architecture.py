"""The package's shape, checked over its import graph (docs/ARCHITECTURE.md explains each rule):
no import circle, lower layers never import higher ones, only kvexp.app touches Hydra, an import
inside a function outside kvexp.app says why on its line, and no module grows past MAX_LINES."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT

PKG = ROOT / "kvexp"

# Top to bottom. A package may import its own modules and any package of a lower row; packages on
# one row are independent of each other (neither imports the other).
LAYERS: list[tuple[str, ...]] = [
    ("app",),  # the command line: Hydra, composition, checks, preflight, help, progress
    ("report", "measure"),  # present a sweep | drive a server through a scenario
    ("analysis", "quality"),  # interpret documents | what a KV dtype costs in quality
    ("planning",),  # the planner's prediction for a job, calibration, what-if, recomputation
    ("results",),  # versioned documents: write, read, validate, other tools' files
    ("backends",),  # one adapter per server, processes, installs
    ("capacity",),  # pure KV-capacity maths, a model's architecture from its files
    ("assets",),  # what kvexp builds or brings: llama.cpp binaries, vLLM venv, models, evaluation text
    ("workload",),  # what a level sends: lengths, datasets, traces, prompts
    ("metrics",),  # request records, the metric registry, statistics, levels, SLO search
    ("core",),  # typed configuration, folders, the machine, the version
]
HYDRA = ("hydra", "omegaconf")
MAX_LINES = 600


@dataclass(frozen=True)
class Import:
    src: str  # importing module
    dst: str  # imported kvexp module (or a third-party top-level name)
    line: int
    in_function: bool
    reason: bool  # a comment on the import's line (or the line above) says why


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _targets(mod: str, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        pkg = mod.split(".") if MODULES[mod].name == "__init__.py" else mod.split(".")[:-1]
        base = ".".join(pkg[:len(pkg) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _imports() -> list[Import]:
    out = []
    for mod, path in MODULES.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        inside: set[int] = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside.update(id(n) for n in ast.walk(fn) if n is not fn)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                said = "#" in lines[node.lineno - 1] or lines[node.lineno - 2].strip().startswith("#")
                for dst in _targets(mod, node):
                    if dst != mod:
                        out.append(Import(mod, dst, node.lineno, id(node) in inside, said))
    return out


IMPORTS = _imports()
EDGES = [i for i in IMPORTS if i.dst in MODULES]


def _package(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else None


def _rank(pkg: str | None) -> int | None:
    return next((r for r, row in enumerate(LAYERS) if pkg in row), None)


def test_every_module_belongs_to_a_layer():
    loose = sorted(m for m in MODULES if m not in ("kvexp", "kvexp.__main__") and _rank(_package(m)) is None)
    assert not loose, f"modules outside every layer of LAYERS: {loose}"


def test_no_import_circle():
    graph: dict[str, set[str]] = {}
    for e in EDGES:
        graph.setdefault(e.src, set()).add(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    assert not cycles, f"import circles: {cycles}"


def test_lower_layers_never_import_higher_ones():
    bad = []
    for e in EDGES:
        a, b = _package(e.src), _package(e.dst)
        ra, rb = _rank(a), _rank(b)
        if e.src in ("kvexp", "kvexp.__main__") or a == b or ra is None or rb is None:
            continue  # the package's own front door; within one package; reported by the test above
        if rb < ra or (rb == ra and a != b):
            bad.append(f"{e.src}:{e.line} imports {e.dst} ({a} may not import {b})")
    assert not bad, "layer contract broken:\n" + "\n".join(bad)


def test_only_app_touches_hydra():
    bad = [f"{i.src}:{i.line} imports {i.dst}" for i in IMPORTS
           if i.dst.split(".")[0] in HYDRA and _package(i.src) != "app"]
    assert not bad, "Hydra/OmegaConf outside kvexp.app:\n" + "\n".join(bad)


def test_imports_inside_functions_say_why():
    bad = sorted({f"{i.src}:{i.line}" for i in IMPORTS
                  if i.in_function and not i.reason and _package(i.src) != "app" and i.src != "kvexp"})
    assert not bad, ("imports inside functions outside kvexp.app with no comment saying why "
                     "(move them to the top, or say why on the line):\n" + "\n".join(bad))


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_module_size(mod):
    n = len(MODULES[mod].read_text().splitlines())
    assert n <= MAX_LINES, f"{MODULES[mod].relative_to(PKG.parent)}: {n} lines; split it by concern (<= {MAX_LINES})"
