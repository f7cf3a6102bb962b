"""Exports that stand alone (issue 31 item 5): notebook formulas as MathML with no CDN script, widget cells
that leave a figure, committed outputs without this machine's paths, and report figures that show what
they plot (serve cache panel, align flips panel, log axes, the KDA state figure's first frame)."""
import re
import types
from pathlib import Path

import nbformat
import pytest

from latentmoe_lab.report import html_report
from latentmoe_lab.viz import alignment as viz_alignment
from latentmoe_lab.viz import model as viz_model
from latentmoe_lab.viz import serving as viz_serving
from latentmoe_lab.viz.export import math_to_mathml, standalone_html
from latentmoe_lab.viz.notebook import explorer

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PLOTLY = "application/vnd.plotly.v1+json"
REMOTE_SCRIPT = re.compile(r"<script[^>]*\bsrc=[\"']?https?://", re.IGNORECASE)


def test_formulas_become_mathml_and_code_stays_code():
    text = math_to_mathml(r"Scores $s = \sigma(W_r x)$, `code $x$`, a \$5 note and"
                          "\n$$w_i = \\text{routed\\_scaling} \\cdot s_i$$")
    assert text.count("<math ") == 2 and 'display="block"' in text
    assert "`code $x$`" in text and r"\$5" in text  # code and an escaped dollar are not math
    assert "routed&#95;scaling" in text and "\\_" not in text.split("`")[-1]
    assert "_" not in re.sub(r"<[^>]+>", "", text.split("`")[-1])  # markdown sees no emphasis marker in the math


def test_an_exported_notebook_needs_no_network():
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell(r"Per head, $S_t = S' + \beta_t k_t (v_t - S'^\top k_t)^\top$ and"
                                      "\n\n$$o_t = S_t^\\top q_t$$"),
        nbformat.v4.new_code_cell("1 + 1", outputs=[nbformat.v4.new_output(
            "display_data", data={"text/html": '<div>figure</div><script src="https://cdn.example/mathjax.js">'
                                               "</script>"})])])
    page = standalone_html(notebook)
    assert not REMOTE_SCRIPT.search(page)
    assert page.count("<math ") == 2 and "\\beta" not in page and "$$" not in page


def test_reports_wrap_long_lines_and_load_nothing():
    import plotly.graph_objects as go

    page = html_report("r", ["steps 12, " * 40, go.Figure(go.Bar(y=[1, 2]))])
    assert "white-space: pre-wrap" in page and not REMOTE_SCRIPT.search(page)


def _step(time, blocks, prefill):
    return types.SimpleNamespace(time=time, duration=0.5, running=1, waiting=0, blocks_used=blocks, slots_used=1,
                                 prefill_tokens=prefill, decode_tokens=1, preemptions=0)


def test_serve_cache_panel_is_scaled_to_what_is_used():
    fig = viz_serving.timeline_figure([_step(1.0, 3, 16), _step(3.0, 5, 0)], num_blocks=26_000)
    assert not fig.layout.shapes  # no line at the 26k-block pool that would flatten the use to zero
    assert any("26,000 blocks" in note.text for note in fig.layout.annotations)
    bars = [trace for trace in fig.data if trace.type == "bar"]
    assert all(list(bar.width) == [0.5, 0.5] and list(bar.offset) == [-0.5, -0.5] for bar in bars)


def _tap(kind, layer, flips=None):
    return {"kind": kind, "layer": layer, "name": f"{kind}{layer}", "rel_l2": 0.0 if flips is None else None,
            "cosine": 1.0, "routing_flips": flips}


@pytest.mark.parametrize("flips, note", [([0.0, 0.0], True), ([0.0, 0.25], False)])
def test_align_flips_panel_says_when_there_are_none(flips, note):
    rows = [_tap("residual", 0), _tap("residual", 1)] + [_tap("experts", i, f) for i, f in enumerate(flips)]
    fig = viz_alignment.alignment_figure(rows)
    assert any("no routing flips" in (a.text or "") for a in fig.layout.annotations) == note


def test_log_axes_put_a_labelled_tick_above_the_tallest_bar():
    fig = viz_model.parameter_breakdown_figure({"experts": {"total": 25_000, "active": 900},
                                                "embed": {"total": 40, "active": 0}})
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis.dtick == 1
    assert tuple(fig.layout.yaxis.range) == (1, 5)  # 10 .. 100k: the 25k bar sits under the 100k tick


def test_explorer_draws_its_starting_figure_as_an_output_and_redraws_it(monkeypatch):
    import ipywidgets
    from IPython import display as ipython_display

    shown = []

    class Handle:
        def update(self, figure):
            shown.append(("update", figure))

    def display(obj, display_id=False):
        shown.append(("display", obj))
        return Handle() if display_id else None

    monkeypatch.setattr(ipython_display, "display", display)
    slider = ipywidgets.IntSlider(value=2, min=1, max=4)
    explorer(lambda n: f"figure {n}", n=slider)
    slider.value = 3
    assert [s for s in shown if not isinstance(s[1], ipywidgets.HBox)] == [("display", "figure 2"),
                                                                          ("update", "figure 3")]


@pytest.mark.parametrize("executed", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebooks_leave_figures_for_widgets_and_no_local_paths(executed):
    cells = [cell for cell in nbformat.read(executed, as_version=4).cells if cell.cell_type == "code"]
    for number, cell in enumerate(cells, start=1):
        texts = [o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in cell.get("outputs", [])]
        local = [m for text in texts for m in re.findall(r"(?:/work|/root|/home|/tmp)/[^\s'\"]*", text)]
        assert not local, f"code cell {number} prints paths of the machine it ran on: {local}"
        if "ipywidgets." in cell.source:
            assert any(PLOTLY in o.get("data", {}) for o in cell.get("outputs", [])), \
                f"code cell {number} uses widgets and saved no figure for exported pages"
