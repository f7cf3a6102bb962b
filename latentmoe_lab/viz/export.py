"""Notebooks exported to HTML that stand alone: formulas drawn without MathJax, no script from a CDN.

    latentmoe-lab export-notebook notebooks/*.ipynb            # -> reports/notebooks/NN_topic.html
    jupyter nbconvert --to html_offline notebooks/01_routing.ipynb   # the same exporter, through nbconvert

nbconvert's own HTML template loads MathJax (and require.js, mermaid) from a CDN, so offline every
`$...$` stays raw TeX. `math_to_mathml` turns each formula of a markdown cell into MathML (latex2mathml),
which browsers draw themselves (MathML Core), so no script is needed; `OfflineHTMLExporter` (registered
with nbconvert as `html_offline` in pyproject.toml) does that and drops the CDN scripts, which then have
nothing left to do. Figures are the inlined HTML copies that viz/notebook.py's renderer stores next to
every plotly output.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from nbconvert import HTMLExporter
from nbconvert.preprocessors import Preprocessor

# Code is never math: fenced blocks and inline code spans are kept as they are.
_CODE = re.compile(r"(```.*?```|~~~.*?~~~|`[^`\n]*`)", re.DOTALL)
# $$display$$ (may span lines), then $inline$ (one line, no space just inside the dollars, \$ is a dollar)
_MATH = re.compile(r"(?<!\\)\$\$(?P<display>.+?)\$\$|(?<![\\$])\$(?!\s)(?P<inline>[^$\n]+?)(?<![\s\\])\$(?!\$)",
                   re.DOTALL)
# Characters markdown would act on inside MathML text (emphasis, escapes, links, tables, code)
_MARKDOWN_ACTIVE = re.compile(r"[*_\\\[\]`|~]")
_CDN_SCRIPT = re.compile(r"<script[^>]*\bsrc=\"https?://[^\"]*\"[^>]*>\s*</script>\s*")
_MATHJAX_CONFIG = re.compile(r"<!-- MathJax configuration -->.*?<!-- End of mathjax configuration -->", re.DOTALL)


def _mathml(tex: str, display: bool) -> str:
    from latex2mathml.converter import convert

    markup = convert(tex.strip(), display="block" if display else "inline").replace("\n", "")
    markup = re.sub(r"(<mtext>[^<]*)", lambda m: re.sub(r"\\([_%&#$ {}])", r"\1", m.group(1)), markup)  # \text{a\_b}
    # entity-encode markdown's active characters in text nodes, so the markdown renderer leaves them alone
    return re.sub(r">([^<]+)<", lambda m: ">" + _MARKDOWN_ACTIVE.sub(lambda c: f"&#{ord(c.group())};",
                                                                      m.group(1)) + "<", markup)


def math_to_mathml(markdown: str) -> str:
    """Markdown with every $...$ and $$...$$ outside code replaced by MathML (display math as a block)."""
    parts = _CODE.split(markdown)
    for i in range(0, len(parts), 2):  # even parts are text, odd parts the code the split kept
        parts[i] = _MATH.sub(lambda m: _mathml(m["display"] or m["inline"], m["display"] is not None), parts[i])
    return "".join(parts)


class MathMLPreprocessor(Preprocessor):
    """nbconvert preprocessor: the formulas of every markdown cell become MathML (see math_to_mathml)."""

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "markdown":
            cell.source = math_to_mathml(cell.source)
        return cell, resources


class OfflineHTMLExporter(HTMLExporter):
    """nbconvert's HTML exporter, standing alone: MathML formulas, and no <script src> from a CDN
    (MathJax, require.js, mermaid, plotly's MathJax copies), which the page no longer needs."""

    export_from_notebook = "HTML, offline"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_preprocessor(MathMLPreprocessor(), enabled=True)

    def from_notebook_node(self, nb, resources=None, **kw):
        page, resources = super().from_notebook_node(nb, resources, **kw)
        return _CDN_SCRIPT.sub("", _MATHJAX_CONFIG.sub("", page)), resources


def standalone_html(notebook) -> str:
    """An nbformat notebook -> one HTML page that needs no network: MathML formulas, inlined figures."""
    return OfflineHTMLExporter().from_notebook_node(notebook)[0]


def export_notebook(path: str | Path, out_dir: str | Path) -> Path:
    """Write out_dir/<name>.html for the executed notebook at path; returns the page's path."""
    import nbformat

    path = Path(path)
    if not path.is_file() or path.suffix != ".ipynb":
        raise ValueError(f"notebook: {str(path)!r} is not an .ipynb file")
    target = Path(out_dir) / path.with_suffix(".html").name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(standalone_html(nbformat.read(path, as_version=4)), encoding="utf-8")
    return target


def add_parser(subparsers) -> None:
    """`latentmoe-lab export-notebook` (registered in latentmoe_lab/cli.py)."""
    parser = subparsers.add_parser(
        "export-notebook", help="export executed notebooks to HTML pages that need no network",
        description="Write OUT/<name>.html for each executed notebook: formulas drawn as MathML, figures inlined, "
                    "no script from a CDN (nbconvert's own HTML loads MathJax from one, so offline its formulas "
                    "stay raw TeX). The same exporter runs as `jupyter nbconvert --to html_offline NB.ipynb`.")
    parser.add_argument("notebooks", nargs="+", metavar="NOTEBOOK", help="executed .ipynb files")
    parser.add_argument("--out", default="reports/notebooks", help="output folder (default: %(default)s)")
    parser.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    for notebook in args.notebooks:  # every path first: a typo fails before any page is written
        if not Path(notebook).is_file() or Path(notebook).suffix != ".ipynb":
            raise ValueError(f"NOTEBOOK: {notebook!r} is not an .ipynb file")
    for notebook in args.notebooks:
        print(export_notebook(notebook, args.out))
    return 0
