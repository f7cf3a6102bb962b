"""Self-contained HTML reports: a title, preformatted text blocks and plotly figures, plotly.js inlined once."""
from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

import plotly.graph_objects as go


def html_report(title: str, sections: Sequence[str | go.Figure]) -> str:
    """Render text blocks (as <pre>) and figures in order into one HTML page that needs no network."""
    body = []
    first_figure = True
    for section in sections:
        if isinstance(section, go.Figure):
            body.append(section.to_html(full_html=False, include_plotlyjs="inline" if first_figure else False))
            first_figure = False
        else:
            body.append(f"<pre>{html.escape(section)}</pre>")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body style='font-family: sans-serif; max-width: 1100px; margin: auto'>"
            f"<h1>{html.escape(title)}</h1>{''.join(body)}</body></html>")


def write_html_report(path: str | Path, title: str, sections: Sequence[str | go.Figure]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html_report(title, sections), encoding="utf-8")
    return path
