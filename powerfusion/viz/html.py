"""The self-contained HTML page: viewer, layout library and data inlined, nothing fetched.

The layout library is dagre (MIT; static/dagre.min.js, licence in static/dagre.LICENSE.txt
and in the file's own header comment, which is kept in every page written).
"""
from __future__ import annotations

import html
import json
import re
from importlib import resources

_STATIC = "powerfusion.viz.static"


def _asset(name: str) -> str:
    return resources.files(_STATIC).joinpath(name).read_text(encoding="utf-8")


def _json_safe(payload: str) -> str:
    """JSON that cannot end the <script> element it sits in (model names are arbitrary)."""
    return payload.replace("<", "\\u003c").replace(">", "\\u003e")


def _js(name: str) -> str:
    text = _asset(name)
    if "</script" in text.lower() or "<!--" in text:
        raise ValueError(f"{name} cannot be inlined in a <script> element")
    return text


def render_html(data: dict) -> str:
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=True)
    page = _asset("viewer.html")
    parts = {  # substituted in one pass, so no inserted text is ever re-scanned for markers
        "{{TITLE}}": html.escape(str(data.get("model", "GIR"))),
        "{{CSS}}": _asset("viewer.css"),
        "{{DATA}}": _json_safe(payload),
        "{{DAGRE}}": _js("dagre.min.js"),
        "{{VIEWER}}": _js("viewer.js"),
    }
    return re.sub("|".join(re.escape(k) for k in parts), lambda m: parts[m.group(0)], page)
