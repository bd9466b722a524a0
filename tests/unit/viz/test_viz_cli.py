"""`powerfusion viz` and the other output formats: html, json, dot, svg, show()."""
from __future__ import annotations

import json
import re
import shutil

import onnx
import pytest

from powerfusion.cli import main
from powerfusion.viz import show, viz_data
from tests.viz.models import channel_shuffle, relu_add


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "shuffle.onnx"
    onnx.save(channel_shuffle(), str(path))
    return path


@pytest.fixture(scope="module")
def data(model):
    return viz_data(str(model), target="cuda")


def test_html_is_self_contained(model, tmp_path, capsys):
    out = tmp_path / "v.html"
    assert main(["-q", "viz", str(model), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    page = out.read_text()
    assert re.search(r"<(script|link|img)[^>]+(src|href)=", page) is None   # nothing fetched
    assert "cdn" not in page.lower() and "https://" not in page
    assert page.count("<script") == page.count("</script>") == 3
    assert "Permission is hereby granted" in page   # dagre's licence header travels with it
    embedded = re.search(r'<script id="pf-data" type="application/json">(.*?)</script>', page, re.S).group(1)
    assert json.loads(embedded)["subgraphs"][0]["name"] == "sg0"


def test_json_format(model, tmp_path):
    out = tmp_path / "v.json"
    assert main(["-q", "viz", str(model), "-o", str(out)]) == 0   # format from the extension
    d = json.loads(out.read_text())
    assert d["format"] == "powerfusion-viz" and d["version"] == 1 and d["partition"]["nodes"]


def test_dot_views(data, model, tmp_path):
    from powerfusion.viz import render
    sg = data["subgraphs"][0]
    for k, stage in enumerate(sg["stages"]):
        text = render(data, "dot", "sg0", k)
        assert text.startswith("digraph G {")
        for op in stage["gir"]["ops"]:
            assert re.search(rf'^\s*"{op["index"]}" \[label=', text, re.M)
        assert len(re.findall(r'^\s*"[^"]+" -> "', text, re.M)) == len(stage["gir"]["edges"])
    part = render(data, "dot", "partition")
    assert all(f'"{n["id"]}"' in part for n in data["partition"]["nodes"])
    out = tmp_path / "v.dot"
    assert main(["-q", "viz", str(model), "--format", "dot", "--view", "sg0", "--step", "1", "-o", str(out)]) == 0
    assert out.read_text() == render(data, "dot", "sg0", 1)


def test_bad_view_is_a_user_error(model, tmp_path, capsys):
    assert main(["-q", "viz", str(model), "--format", "dot", "--view", "nope", "-o", str(tmp_path / "x")]) == 2
    assert "no subgraph 'nope'" in capsys.readouterr().err
    assert main(["-q", "viz", str(model), "--format", "dot", "--view", "sg0", "--step", "99",
                 "-o", str(tmp_path / "x")]) == 2


def test_svg_through_graphviz_or_a_clear_error(model, tmp_path, capsys):
    out = tmp_path / "v.svg"
    rc = main(["-q", "viz", str(model), "--view", "sg0", "--step", "1", "-o", str(out)])   # merged
    if shutil.which("dot"):
        assert rc == 0 and "<svg" in out.read_text() and "sync(device)" in out.read_text()
    else:
        assert rc == 2 and "Graphviz" in capsys.readouterr().err


def test_show_for_notebooks():
    v = show(relu_add(), target="cuda")
    page = v._repr_html_()
    assert page.startswith("<iframe srcdoc=") and "&lt;script" in page and "</script>" not in page
    assert v.data["subgraphs"][0]["kernels"]["after"] == 1


def test_packed_page_data_unpacks_to_the_json(data):
    from powerfusion.viz.html import pack, unpack
    packed = json.loads(json.dumps(pack(data)))
    assert unpack(packed) == json.loads(json.dumps(data))
    sizes = [len(json.dumps(x)) for x in (data, packed)]
    assert sizes[1] < sizes[0]
