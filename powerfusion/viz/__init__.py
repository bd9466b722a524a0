"""GIR visualiser: the partition, each subgraph's GIR at every stage (chosen templates,
merged, after each rule application, final), per-level traffic and emitted source lines.

    viz_data(model_or_plan_or_gir, ...) -> dict          the JSON format (docs/viz.md)
    write(source, path, format="html"|"json"|"dot"|"svg", ...)
    show(source, ...) -> Visualisation                   for notebooks (_repr_html_)
"""
from __future__ import annotations

import html as _html
import json

from powerfusion.viz.data import FORMAT_VERSION, run_data, to_run, viz_data

FORMATS = ("html", "json", "dot", "svg")


def render(data: dict, format: str = "html", view: str | None = None, step: int | None = None) -> str:
    """The viz data dict in one output format (dot/svg show one view: partition or one stage)."""
    if format == "html":
        from powerfusion.viz.html import render_html
        return render_html(data)
    if format == "json":
        return json.dumps(data, indent=1)
    from powerfusion.viz.dot import to_dot, to_svg
    if format == "dot":
        return to_dot(data, view, step)
    if format == "svg":
        return to_svg(to_dot(data, view, step))
    raise ValueError(f"unknown format '{format}'; one of {', '.join(FORMATS)}")


def write(source, path: str, format: str = "html", *, view: str | None = None, step: int | None = None,
          **kwargs) -> dict:
    """Write one visualisation file; returns the data dict it was made from."""
    data = source if isinstance(source, dict) else viz_data(source, **kwargs)
    text = render(data, format, view, step)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return data


class Visualisation:
    """What `show` returns: notebooks display it through `_repr_html_` (the page in a sandboxed iframe)."""

    def __init__(self, data: dict, height: int = 720):
        self.data, self.height = data, height

    def html(self) -> str:
        return render(self.data, "html")

    def _repr_html_(self) -> str:
        # srcdoc keeps the page's ids and scripts apart from the notebook's own document
        return (f'<iframe srcdoc="{_html.escape(self.html(), quote=True)}" style="width:100%;height:{self.height}px;'
                f'border:1px solid #ccc" sandbox="allow-scripts"></iframe>')

    def save(self, path: str, format: str = "html", **kw) -> None:
        write(self.data, path, format, **kw)


def show(source, *, height: int = 720, **kwargs) -> Visualisation:
    """`source` as for viz_data: a model path / ModelProto, a compiled Plan, or GIR (graph, trace)."""
    return Visualisation(source if isinstance(source, dict) else viz_data(source, **kwargs), height)


__all__ = ["viz_data", "run_data", "to_run", "render", "write", "show", "Visualisation", "FORMATS",
           "FORMAT_VERSION"]
