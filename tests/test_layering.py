"""The layering of docs/design.md holds: every `import` of powerfusion's own modules, at file
level and inside function bodies alike (read with `ast`, nothing imported), goes only where
the rules allow."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1] / "powerfusion"

GROUND = {"errors", "options", "names", "scalar", "basic", "targets"}
# backends.registry names backend code by string and loads it on request; it imports no backend
REGISTRY = "backends.registry"
# the compiled plan (powerfusion/plan.py): made by the pipeline, run by backend runtimes, so it
# imports only the ground floor (a runtime reads it without importing the pipeline)
PLAN = "plan"

# package -> packages it may not import (a package is a top-level module or subpackage of
# powerfusion; backends.<name> and backends.registry count as packages of their own);
# gir and the ground floor may import only the ground floor
FORBIDDEN = {
    "rewrite": {"backends", "frontend", "cli", "session", "compiler", "pipeline", "viz", "runtime"},
    "templates": {"backends", "frontend", "cli", "session", "compiler", "pipeline", "viz", "runtime"},
    "perfmodel": {"backends", "frontend", "cli", "session", "compiler", "pipeline", "viz", "runtime"},
    "frontend": {"backends", "gir", "templates", "rewrite"},
}
# package cycles still present, listed so that no new one appears unnoticed and a removed one
# is struck from this list (none since every driver runs pipeline/driver.py)
KNOWN_PACKAGE_CYCLES: list[set[str]] = []
# the pipeline's steps after the import (partition -> templates + merge -> rewrite): only the
# pipeline package calls more than one of them (pipeline/driver.py, choose.py, search.py)
PIPELINE_STEPS = {"partition_graph", "lower_subgraph", "optimise"}


def _modules() -> dict[str, Path]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: str, path: Path) -> set[str]:
    """powerfusion modules that `module` imports anywhere in its body."""
    out = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out |= {t for n in names if n.startswith("powerfusion") and (t := _resolve(n)) and t != module}
    return out


def package_of(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "powerfusion"
    if parts[0] == "backends" and len(parts) > 1 and (ROOT / "backends" / parts[1]).is_dir():
        return f"backends.{parts[1]}"
    if parts[:2] == ["backends", "registry"]:
        return REGISTRY
    return parts[0]


EDGES = sorted((m, t) for m, p in MODULES.items() for t in _imported(m, p))


def _allowed(src: str, dst: str) -> bool:
    top = dst.split(".")[0]
    if src in GROUND:
        return dst in GROUND
    if src == "gir":
        return top in GROUND
    if src in (REGISTRY, PLAN):
        return top in GROUND
    if dst == REGISTRY:
        return True
    return top not in FORBIDDEN.get(src, set())


def test_scan_sees_function_level_imports():
    """The scan is only as good as its reading: a known function-level import must be found."""
    assert ("powerfusion.pipeline.driver", "powerfusion.frontend.partition") in EDGES


@pytest.mark.parametrize("package", ["gir", *sorted(FORBIDDEN), *sorted(GROUND), REGISTRY, PLAN])
def test_package_imports_only_what_the_layering_allows(package):
    bad = [f"{m} -> {t}" for m, t in EDGES
           if package_of(m) == package and package_of(t) != package and not _allowed(package, package_of(t))]
    assert not bad, f"{package} imports what docs/design.md forbids it:\n  " + "\n  ".join(bad)


def test_no_new_package_cycle():
    g = nx.DiGraph((package_of(a), package_of(b)) for a, b in EDGES if package_of(a) != package_of(b))
    cycles = [set(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    new = [sorted(c) for c in cycles if c not in KNOWN_PACKAGE_CYCLES]
    gone = [sorted(c) for c in KNOWN_PACKAGE_CYCLES if c not in cycles]
    assert not new, f"new package import cycle(s): {new}"
    assert not gone, f"cycle(s) no longer present, strike them from KNOWN_PACKAGE_CYCLES: {gone}"


def _called(path: Path) -> set[str]:
    """Functions a module calls by name or attribute, or imports by name (under any alias)."""
    calls = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            calls.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
        elif isinstance(node, ast.ImportFrom):
            calls |= {a.name for a in node.names}
    return calls


def test_one_pipeline_driver():
    """No module outside the pipeline package chains two of the pipeline's steps (docs/design.md):
    compile, the sessions, inspect and the visualiser run pipeline.compile and observe it."""
    chains = {m: sorted(_called(p) & PIPELINE_STEPS) for m, p in MODULES.items() if package_of(m) != "pipeline"}
    bad = {m: steps for m, steps in chains.items() if len(steps) > 1}
    assert not bad, f"modules that drive the pipeline themselves: {bad}"
