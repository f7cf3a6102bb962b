"""Notebook plumbing: a plotly renderer that survives export, and output cleaning for committed notebooks.

    from latentmoe_lab.viz.notebook import explorer, use_notebook_renderer
    use_notebook_renderer()            # first cell of every chapter
    explorer(make_figure, alpha=ipywidgets.SelectionSlider(options=[1, 2, 4, 8], value=2))

"plotly_mimetype" alone draws figures in JupyterLab only: nbconvert's HTML export and GitHub's
viewer know nothing of that mimetype and show an empty cell. Adding the "notebook" renderer stores
an HTML copy of every figure next to it, with plotly.js embedded once per notebook (no network
needed, so an offline export still draws; "notebook_connected" would fetch it from a CDN). plotly's
renderer also links MathJax from a CDN (hard-coded there); only LaTeX labels need it, and we use none.
`explorer` puts widget controls over a figure that stays in the saved notebook (its starting state).

`clean_outputs(notebook)` removes known stderr noise from executed outputs before they are
committed: the profiler's USDT start / stop lines and allocator warning (held back at the source by
profiling/quiet.py) and accelerate's notice that offloaded parameters sit on the meta device (silenced
at the source in parallel/offload.py); both kept here for notebooks run with older code. Anything else
on stderr stays, so a real warning is never hidden.
"""
from __future__ import annotations

import re

from latentmoe_lab.profiling.quiet import PROFILER_NOISE

RENDERER = "plotly_mimetype+notebook"

NOISE = (
    *PROFILER_NOISE,
    re.compile(r"^Some parameters are on the meta device because they were offloaded to the .*\.\s*$"),
)


def use_notebook_renderer() -> None:
    """Make plotly figures display in JupyterLab and in exported / rendered notebooks alike."""
    import plotly.io as pio

    pio.renderers.default = RENDERER


def explorer(figure_for, **controls) -> None:
    """Show ipywidgets `controls` above one figure, `figure_for(**their values)`, that they redraw in place.

    The figure is an ordinary display output (with a display id the controls update), not a widget's
    output: an executed notebook keeps it, so an exported page or GitHub's viewer shows the figure of
    the controls' starting values where a widget-only cell would show nothing.
    """
    import ipywidgets
    from IPython.display import display

    def figure():
        return figure_for(**{name: control.value for name, control in controls.items()})

    display(ipywidgets.HBox(list(controls.values())))
    shown = display(figure(), display_id=True)
    for control in controls.values():
        control.observe(lambda change: shown.update(figure()), names="value")


def is_noise(line: str) -> bool:
    return any(pattern.match(line) for pattern in NOISE)


def clean_outputs(notebook) -> int:
    """Drop noise lines from every stderr stream of an nbformat notebook (in place); return lines removed.

    A stream left empty is removed entirely, so no blank stderr box remains.
    """
    removed = 0
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        kept = []
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream" and output.get("name") == "stderr":
                text = output["text"] if isinstance(output["text"], str) else "".join(output["text"])
                lines = text.splitlines(keepends=True)
                clean = [line for line in lines if not is_noise(line)]
                removed += len(lines) - len(clean)
                if not clean:
                    continue
                output["text"] = "".join(clean)
            kept.append(output)
        cell["outputs"] = kept
    return removed
