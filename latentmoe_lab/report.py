"""Self-contained HTML reports: a title, preformatted text blocks and plotly figures, plotly.js inlined once.

A figure may come with a caption (`Captioned`): one sentence under it saying what to read in it.
"""
from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import plotly.graph_objects as go


@dataclass(frozen=True)
class Captioned:
    """A figure and the caption printed under it."""

    figure: go.Figure
    caption: str

    def __post_init__(self) -> None:
        if not isinstance(self.figure, go.Figure):
            raise TypeError(f"figure: expected a plotly go.Figure, got {type(self.figure).__name__}")
        if not isinstance(self.caption, str) or not self.caption.strip():
            raise ValueError("caption: must be a non-empty string")


Section = str | go.Figure | Captioned


def html_report(title: str, sections: Sequence[Section]) -> str:
    """Render text blocks (as <pre>) and figures in order into one HTML page that needs no network."""
    body = []
    first_figure = True
    for section in sections:
        if isinstance(section, (go.Figure, Captioned)):
            figure = section.figure if isinstance(section, Captioned) else section
            plot = figure.to_html(full_html=False, include_plotlyjs="inline" if first_figure else False)
            first_figure = False
            if isinstance(section, Captioned):
                plot = f"<figure>{plot}<figcaption>{html.escape(section.caption)}</figcaption></figure>"
            body.append(plot)
        else:
            body.append(f"<pre>{html.escape(section)}</pre>")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body style='font-family: sans-serif; max-width: 1100px; margin: auto'>"
            f"<h1>{html.escape(title)}</h1>{''.join(body)}</body></html>")


def write_html_report(path: str | Path, title: str, sections: Sequence[Section]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html_report(title, sections), encoding="utf-8")
    return path
