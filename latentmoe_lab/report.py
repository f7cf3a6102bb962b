"""Self-contained HTML reports: a title, preformatted text blocks and plotly figures, plotly.js inlined once.

A figure may come with a caption (`Captioned`): one sentence under it saying what to read in it. `Data`
embeds the numbers a report was drawn from as JSON, for programs (read_report_data) rather than readers.
"""
from __future__ import annotations

import html
import json
import re
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


@dataclass(frozen=True)
class Data:
    """A JSON object embedded as <script type="application/json" id="{name}">: invisible, parseable."""

    name: str
    payload: dict

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", self.name):
            raise ValueError(f"name: letters, digits, '_' and '-', starting with a letter; got {self.name!r}")

    def html(self) -> str:
        text = json.dumps(self.payload, allow_nan=False).replace("</", "<\\/")  # never ends the script element
        return f"<script type='application/json' id='{self.name}'>{text}</script>"


def read_report_data(page: str, name: str) -> dict:
    """The payload of the Data section `name` of a report page; KeyError naming it when the page has none."""
    match = re.search(f"<script type='application/json' id='{re.escape(name)}'>(.*?)</script>", page, re.S)
    if match is None:
        raise KeyError(f"name: the report holds no data section {name!r}")
    return json.loads(match.group(1))


Section = str | go.Figure | Captioned | Data


def html_report(title: str, sections: Sequence[Section]) -> str:
    """Render text blocks (as <pre>), figures and data in order into one HTML page that needs no network."""
    body = []
    first_figure = True
    for section in sections:
        if isinstance(section, Data):
            body.append(section.html())
        elif isinstance(section, (go.Figure, Captioned)):
            figure = section.figure if isinstance(section, Captioned) else section
            plot = figure.to_html(full_html=False, include_plotlyjs="inline" if first_figure else False)
            first_figure = False
            if isinstance(section, Captioned):
                plot = f"<figure>{plot}<figcaption>{html.escape(section.caption)}</figcaption></figure>"
            body.append(plot)
        else:
            body.append(f"<pre style='white-space: pre-wrap; overflow-wrap: anywhere'>{html.escape(section)}</pre>")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body style='font-family: sans-serif; max-width: 1100px; margin: auto'>"
            f"<h1>{html.escape(title)}</h1>{''.join(body)}</body></html>")


def check_report_path(path: str | Path, name: str = "path") -> Path:
    """The path of a report file, refused (ValueError naming `name`, e.g. "--report") when it cannot be written:
    empty, an existing directory, or under a file. Commands call it before their work, not after."""
    if not str(path).strip():
        raise ValueError(f"{name}: an HTML report path is required, got {str(path)!r}")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{name}: {str(path)!r} is a directory; give a file path such as {str(path / 'report.html')!r}")
    blocking = next((parent for parent in path.parents if parent.exists() and not parent.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"{name}: {str(path)!r} cannot be created, {str(blocking)!r} is a file, not a directory")
    return path


def write_html_report(path: str | Path, title: str, sections: Sequence[Section]) -> Path:
    path = check_report_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html_report(title, sections), encoding="utf-8")
    return path
