"""tests/unit is the fast lane (`pytest tests/unit`): every folder in it is a package, so its
test modules are named `unit.<package>.<module>` and never clash with a model-level module of
the same file name, and no module in it is a device-only file (those live beside the model
tests, in the package's folder under tests/)."""
from __future__ import annotations

import ast
from pathlib import Path

UNIT = Path(__file__).resolve().parent


def test_every_unit_folder_is_a_package():
    folders = [d for d in UNIT.rglob("*") if d.is_dir() and d.name != "__pycache__"]
    assert folders, "tests/unit has no package folders"
    missing = [d.relative_to(UNIT).as_posix() for d in [UNIT, *folders] if not (d / "__init__.py").is_file()]
    assert not missing, f"folders under tests/unit without __init__.py: {missing}"


def _module_marks(path: Path) -> set[str]:
    """The marker names of a module-level `pytestmark = ...` assignment."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            return {n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute)}
    return set()


def test_no_unit_module_is_device_only():
    device_only = [p.relative_to(UNIT).as_posix() for p in UNIT.rglob("test_*.py")
                   if {"gpu", "browser", "slow"} & _module_marks(p)]
    assert not device_only, f"device-only or slow test modules in the fast lane: {device_only}"
