"""The backend registry (targets/registry.py) is the one place a backend is named: its devices
come from its own folder, every backend folder is registered, and a new backend needs nothing
but a folder and a registration line (docs/design.md, "Adding a backend")."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from powerfusion.errors import PowerFusionError
from powerfusion.targets import registry, specs
from powerfusion.targets.registry import BACKENDS, Backend

BACKEND_FOLDERS = Path(registry.__file__).resolve().parents[1] / "backends"


@pytest.fixture
def fresh_tables():
    specs.targets.cache_clear(), specs.aliases.cache_clear(), specs._calibrated.cache_clear()
    yield
    specs.targets.cache_clear(), specs.aliases.cache_clear(), specs._calibrated.cache_clear()


def test_every_device_names_the_backend_that_registers_it():
    for b in BACKENDS.values():
        assert b.devices and b.default_device in b.load_devices(), b.name
        assert all(spec.backend == b.name for spec in b.load_devices().values()), b.name
    assert specs.get_target("cuda").name == "H200" and specs.get_target("cpu-reference").backend == "cpu"


def test_every_backend_folder_is_registered():
    folders = {d.name for d in BACKEND_FOLDERS.iterdir() if (d / "renderer.py").is_file()}
    assert folders - {"cstyle"} == set(BACKENDS), "a backend folder without a registration (or the reverse)"


def test_a_new_backend_is_one_folder_and_one_registration(tmp_path, monkeypatch, fresh_tables):
    pkg = tmp_path / "toy_backend"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "devices.py").write_text(
        "from powerfusion.targets.target_spec import gpu_spec\n"
        "DEVICES = {'toy1': gpu_spec('Toy-1', 'toy', 32, 4, 1e11, 1 << 30, 48 << 10, 65536,\n"
        "                            {'float32': 1e12}, 1e12, 5e-6, 4e11)}\n")
    (pkg / "renderer.py").write_text("class ToyRenderer:\n    def render(self, graph):\n        return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(BACKENDS, "toy", Backend("toy", ".toy", "toy_backend.renderer:ToyRenderer", "toycc",
                                                 devices="toy_backend.devices:DEVICES", default_device="toy1"))
    assert specs.get_target("toy").name == "Toy-1"
    assert specs.get_target("TOY1").backend == "toy"
    assert "toy" in registry.source_backends()
    assert registry.backend("toy").load_renderer().render(None) == []
    sys.modules.pop("toy_backend", None)


def test_a_device_registered_under_the_wrong_backend_is_refused(monkeypatch, fresh_tables):
    monkeypatch.setitem(BACKENDS, "bad", Backend("bad", devices="powerfusion.backends.hip.devices:DEVICES"))
    with pytest.raises(PowerFusionError, match="backend 'bad' registers device 'mi100'"):
        specs.get_target("h200")
