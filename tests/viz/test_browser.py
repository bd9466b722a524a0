"""The HTML page in headless Chromium: loads offline without console messages, draws a
graph, and stepping (driven by the URL hash) changes what is drawn."""
from __future__ import annotations

import re

import pytest

from powerfusion.viz import write
from tests.viz import chromium
from tests.viz.models import channel_shuffle, relu_add

pytestmark = [pytest.mark.browser,   # driven through the executable's flags, not playwright
              pytest.mark.skipif(chromium.executable() is None, reason="needs a chromium executable on PATH")]
CANVAS = (245, 200, 1040, 900)   # the graph area of a 1400x900 window (sidebar 240, details 340)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    path = tmp_path_factory.mktemp("viz") / "shuffle.html"
    data = write(channel_shuffle(), str(path), target="cuda")
    return path, data


def _attrs(dom: str) -> dict:
    body = re.search(r"<body([^>]*)>", dom).group(1)
    return dict(re.findall(r'data-(\w+)="([^"]*)"', body))


def test_harness_sees_console_errors(tmp_path):
    """The check below can fail: an uncaught exception shows up as a console message."""
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>throw new Error('deliberate');</script></body></html>")
    _, console = chromium.dump_dom(bad.as_uri())
    assert any("deliberate" in m for m in console)


def test_loads_without_console_messages_and_draws(page):
    path, data = page
    sg = data["subgraphs"][0]
    merged = next(k for k, s in enumerate(sg["stages"]) if s["kind"] == "merged")
    assert sg["stages"][merged + 1]["kind"] == "rule"
    for step in (0, merged, len(sg["stages"]) - 1):
        dom, console = chromium.dump_dom(f"{path.as_uri()}#view={sg['name']}&step={step}")
        assert console == [], console
        attrs = _attrs(dom)
        assert attrs["ready"] == "1" and attrs["view"] == sg["name"] and attrs["step"] == str(step)
        drawn = len(re.findall(r'<g class="node[ "]', dom))
        assert drawn == int(attrs["nodes"]) and drawn >= len(sg["stages"][step]["gir"]["ops"])
        # the page stores no edges: viewer.js derives them from the ops, as gir_json does
        assert len(re.findall(r'<g class="edge', dom)) == len(sg["stages"][step]["gir"]["edges"])
        assert sg["stages"][step]["label"] in dom.replace("&amp;", "&").replace("&gt;", ">")
        coming = sg["stages"][step + 1] if step + 1 < len(sg["stages"]) else None
        doomed = set(coming["changed"]) if coming and coming["kind"] == "rule" else set()
        outlined = len(re.findall(r'<g class="node[^"]*doomed', dom))
        assert outlined == len([op for op in sg["stages"][step]["gir"]["ops"] if op["uid"] in doomed])
        assert outlined > 0 if step == merged else outlined == 0
    dom, console = chromium.dump_dom(f"{path.as_uri()}#view=partition")
    assert console == [] and _attrs(dom)["view"] == "partition"
    assert len(re.findall(r'<g class="node[ "]', dom)) == len(data["partition"]["nodes"]) + 4  # + 2 in, 2 out


def test_stepping_changes_the_picture(page, tmp_path):
    path, data = page
    sg = data["subgraphs"][0]
    merged = next(k for k, s in enumerate(sg["stages"]) if s["kind"] == "merged")
    shots = {}
    for step in (merged, len(sg["stages"]) - 1):
        png = str(tmp_path / f"step{step}.png")
        assert chromium.screenshot(f"{path.as_uri()}#view={sg['name']}&step={step}", png) == []
        shots[step] = png
        assert chromium.coloured_pixels(png, CANVAS) > 2000, "the graph area is (nearly) empty"
    a, b = (chromium.read_png(p)[2] for p in shots.values())
    assert a != b


def test_search_by_node_and_buffer_name(page):
    path, data = page
    dom, console = chromium.dump_dom(f"{path.as_uri()}#view=partition&q=transpose")
    assert console == [] and _attrs(dom)["matches"] == "1"
    assert len(re.findall(r'<g class="node[^"]*match', dom)) == 1
    merged = next(k for k, s in enumerate(data["subgraphs"][0]["stages"]) if s["kind"] == "merged")
    ops = data["subgraphs"][0]["stages"][merged]["gir"]["ops"]
    users = [op for op in ops if any(s["buffer"] == "cat" for s in op["inputs"] + op["outputs"])]
    dom, console = chromium.dump_dom(f"{path.as_uri()}#view=sg0&step={merged}&q=cat")
    assert console == [] and int(_attrs(dom)["matches"]) >= len(users) > 0


def test_notebook_embedding(tmp_path):
    """show()._repr_html_ in a page, as a notebook would show it: a sandboxed srcdoc iframe."""
    from powerfusion.viz import show
    page = tmp_path / "notebook.html"
    page.write_text("<html><body><h1>notebook</h1>" + show(relu_add(), target="cuda")._repr_html_() + "</body></html>")
    png = str(tmp_path / "nb.png")
    assert chromium.screenshot(page.as_uri(), png) == []
    assert chromium.coloured_pixels(png, (250, 250, 1000, 700)) > 1000


def test_search_and_details_with_awkward_names(tmp_path):
    """A node name containing '</script>' neither breaks the page nor runs as markup."""
    path = tmp_path / "relu_add.html"
    write(relu_add(), str(path), target="cuda")
    dom, console = chromium.dump_dom(f"{path.as_uri()}#view=partition&node=relu%3C%2Fscript%3E%3Cb%3Eadd")
    assert console == []
    assert "<b>add" not in dom and "relu&lt;/script&gt;&lt;b&gt;add" in dom


@pytest.mark.slow
@pytest.mark.parametrize("name", ["shufflenet_small"])
def test_bundled_model_page(name, tmp_path):
    """A committed model end to end (default template choice, to keep it to a minute or so)."""
    import os
    model = os.path.join(os.path.dirname(__file__), "..", "..", "models", "small", f"{name}.onnx")
    path = tmp_path / f"{name}.html"
    data = write(model, str(path), target="cuda", search=False, timeout=300)
    failed = [(s["name"], s["failed_at"], s["error"]) for s in data["subgraphs"] if s["error"]]
    assert not failed, failed
    dom, console = chromium.dump_dom(f"{path.as_uri()}#view=partition")
    assert console == [] and _attrs(dom)["nodes"] == str(len(re.findall(r'<g class="node[ "]', dom)))
    sg = max(data["subgraphs"], key=lambda s: s["trace_steps"])
    for step in (0, len(sg["stages"]) - 1):
        dom, console = chromium.dump_dom(f"{path.as_uri()}#view={sg['name']}&step={step}")
        assert console == []
        drawn = len(re.findall(r'<g class="node[ "]', dom))
        assert drawn == int(_attrs(dom)["nodes"]) > 0
