"""The layering of docs/design.md holds: every `import` of powerfusion's own modules, at file
level and inside function bodies alike (read with `ast`, nothing imported), goes only where
the rules allow, and no module imports itself back (no cycle of packages or of modules)."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[2] / "powerfusion"

GROUND = {"errors", "options", "names", "scalar", "basic", "targets"}
# the compiled plan (powerfusion/plan.py): made by the pipeline, run by backend runtimes, so it
# imports only the ground floor (a runtime reads it without importing the pipeline)
PLAN = "plan"

# package -> packages it may not import (a package is a top-level module or subpackage of
# powerfusion; backends.<name> counts as a package of its own; the backend registry is
# targets/registry.py, on the ground floor: it names backend code by string and loads it on
# request, importing no backend);
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
# module import cycles allowed, each with its reason (module set -> why); a cycle through an
# import inside a function body counts too: it only hides the cycle until the function runs
KNOWN_MODULE_CYCLES: dict[frozenset[str], str] = {}
# packages whose modules import one another at file level only (a straight, one-way order)
STRAIGHT_PACKAGES = {"frontend"}
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


def _import_sites(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """(powerfusion module imported, line, inside a function body?) for every import in `module`."""
    out = []
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package[:len(package) - child.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in child.names]
            else:
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
                continue
            out.extend((t, child.lineno, in_function) for n in names
                       if n.startswith("powerfusion") and (t := _resolve(n)) and t != module)

    visit(ast.parse(path.read_text(), str(path)), False)
    return out


def _imported(module: str, path: Path) -> set[str]:
    """powerfusion modules that `module` imports anywhere in its body."""
    return {t for t, _, _ in _import_sites(module, path)}


def package_of(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "powerfusion"
    if parts[0] == "backends" and len(parts) > 1 and (ROOT / "backends" / parts[1]).is_dir():
        return f"backends.{parts[1]}"
    return parts[0]


EDGES = sorted((m, t) for m, p in MODULES.items() for t in _imported(m, p))


def _function_only() -> dict[tuple[str, str], bool]:
    """(module, imported module) -> True where every import of it is inside a function body."""
    out: dict[tuple[str, str], bool] = {}
    for m, p in MODULES.items():
        for t, _, in_function in _import_sites(m, p):
            out[(m, t)] = out.get((m, t), True) and in_function
    return out


FUNCTION_ONLY = _function_only()


def _allowed(src: str, dst: str) -> bool:
    top = dst.split(".")[0]
    if src in GROUND:
        return dst in GROUND
    if src == "gir":
        return top in GROUND
    if src == PLAN:
        return top in GROUND
    return top not in FORBIDDEN.get(src, set())


def test_scan_sees_function_level_imports():
    """The scan is only as good as its reading: a known function-level import must be found."""
    assert ("powerfusion.pipeline.driver", "powerfusion.frontend.partition") in EDGES


@pytest.mark.parametrize("package", ["gir", *sorted(FORBIDDEN), *sorted(GROUND), PLAN])
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


def module_cycles(function_only: dict[tuple[str, str], bool]) -> list[str]:
    """Each import cycle among modules, described: the modules, and where the cycle needs an
    import inside a function body, those imports (they hide it)."""
    g = nx.DiGraph(list(function_only))
    out = []
    for component in nx.strongly_connected_components(g):
        if len(component) < 2 or frozenset(component) in KNOWN_MODULE_CYCLES:
            continue
        inner = [(a, b) for a, b in g.subgraph(component).edges]
        file_level = nx.DiGraph([e for e in inner if not function_only[e]])
        if any(len(c) > 1 for c in nx.strongly_connected_components(file_level)):
            out.append(f"file-level cycle among {sorted(component)}")
        else:
            hiding = sorted(f"{a} -> {b}" for a, b in inner if function_only[(a, b)])
            out.append(f"cycle among {sorted(component)} hidden by function-body imports {hiding}")
    return out


def test_cycle_scan_sees_file_level_and_hidden_cycles():
    """The cycle check fails on what it should: a loop of file-level imports, and one closed by an
    import inside a function body; a one-way chain passes."""
    assert module_cycles({("a", "b"): False, ("b", "a"): False}) == ["file-level cycle among ['a', 'b']"]
    assert module_cycles({("a", "b"): False, ("b", "c"): False, ("c", "a"): True}) == [
        "cycle among ['a', 'b', 'c'] hidden by function-body imports ['c -> a']"]
    assert module_cycles({("a", "b"): True, ("b", "c"): False}) == []


def test_no_module_import_cycle():
    """No module imports itself back, at file level or through an import inside a function body
    (docs/design.md): shared pieces move down instead."""
    cycles = module_cycles(FUNCTION_ONLY)
    assert not cycles, "module import cycle(s):\n  " + "\n  ".join(cycles)
    present = {frozenset(c) for c in nx.strongly_connected_components(nx.DiGraph(list(FUNCTION_ONLY))) if len(c) > 1}
    gone = [sorted(c) for c in KNOWN_MODULE_CYCLES if c not in present]
    assert not gone, f"cycle(s) no longer present, strike them from KNOWN_MODULE_CYCLES: {gone}"


@pytest.mark.parametrize("package", sorted(STRAIGHT_PACKAGES))
def test_package_imports_itself_at_file_level(package):
    """A straight package's modules import one another at file level: the order is visible at the
    top of each file, and no import inside a function steps around a loop."""
    bad = [f"{m}:{line} -> {t}" for m, p in MODULES.items() if package_of(m) == package
           for t, line, in_function in _import_sites(m, p) if in_function and package_of(t) == package]
    assert not bad, f"{package} imports its own modules inside functions:\n  " + "\n  ".join(bad)
