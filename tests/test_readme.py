"""Every README snippet runs as pasted: the Python blocks, and the demo command line (its
`pip install` part aside, run from an empty folder, where the model path resolves to the
bundled model as it does from a wheel)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from powerfusion.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
SHELL_BLOCKS = re.findall(r"```\n(.*?)```", README, flags=re.S)


def test_readme_has_python_snippets():
    assert len(PYTHON_BLOCKS) >= 2


@pytest.mark.parametrize("k", range(len(PYTHON_BLOCKS)))
def test_python_snippet_runs(k, monkeypatch):
    monkeypatch.chdir(ROOT)
    exec(compile(PYTHON_BLOCKS[k], f"README.md python block {k + 1}", "exec"), {"__name__": "readme"})


def test_demo_command_runs_from_an_empty_folder(tmp_path, monkeypatch):
    demo = SHELL_BLOCKS[0].strip()
    commands = [shlex.split(c) for c in demo.split("&&")]
    powerfusion = [c for c in commands if c[0] == "powerfusion"]
    assert [c[:2] for c in powerfusion] == [["powerfusion", "compile"], ["powerfusion", "run"]]
    assert any(c[:4] == ["python3", "-m", "pip", "install"] for c in commands)   # it installs what it needs
    monkeypatch.chdir(tmp_path)
    for argv in powerfusion:
        assert main(["-q", *argv[1:]]) == 0, argv
    assert (tmp_path / "out" / "sardrn" / "plan.json").is_file()
