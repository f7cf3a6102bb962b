"""Notebooks that export (issue 12, item 14): figures carry an HTML copy, committed outputs carry no
stderr noise, and the executor stops loudly on a cell that hangs or fails."""
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from latentmoe_lab.viz.notebook import RENDERER, clean_outputs

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
PLOTLY = "application/vnd.plotly.v1+json"


def _stream(text, name="stderr"):
    return nbformat.v4.new_output("stream", name=name, text=text)


def test_clean_outputs_drops_noise_and_keeps_real_messages():
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [
        _stream("USDT:2026-11-30 08:18:03 17281:17281 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
                "USDT:2026-11-30 08:18:04 17281:17281 SyncActivityProfilerHandler.cpp:59] profiler_stop\n"),
        _stream("Some parameters are on the meta device because they were offloaded to the cpu and disk.\n"
                "UserWarning: something real\n"),
        _stream("USDT: profiler_start is mentioned on stdout\n", name="stdout"),
    ]
    notebook = nbformat.v4.new_notebook(cells=[cell])
    assert clean_outputs(notebook) == 3
    assert [(o.name, o.text) for o in cell.outputs] == [("stderr", "UserWarning: something real\n"),
                                                        ("stdout", "USDT: profiler_start is mentioned on stdout\n")]


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_chapter_uses_the_exporting_renderer(source):
    text = source.read_text()
    assert "use_notebook_renderer()" in text and 'renderers.default = "plotly_mimetype"' not in text
    assert RENDERER == "plotly_mimetype+notebook"


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_outputs_export_every_figure_and_carry_no_noise(source):
    executed = source.with_suffix(".ipynb")
    assert executed.exists(), f"{executed.name} missing: run `make notebooks NOTEBOOKS={source.name[:2]}`"
    notebook = nbformat.read(executed, as_version=4)
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    figures = [o for o in outputs if PLOTLY in o.get("data", {})]
    assert figures, "no plotly figure in the executed notebook"
    assert all("text/html" in o["data"] for o in figures)  # what nbconvert and GitHub draw
    html = "".join(o["data"].get("text/html", "") for o in outputs if "data" in o)
    assert not re.search(r"<script[^>]*\bsrc=[^>]*plotly", html)  # plotly.js is not fetched from a CDN ...
    assert "plotly.js v" in html  # ... because plotly.js itself is embedded (once)
    assert clean_outputs(notebook) == 0


def _chapter(tmp_path, code: str) -> Path:
    source = tmp_path / "99_probe.py"
    source.write_text("# %%\nimport time\n\n# %%\n" + code + "\n")
    return source


def test_executor_stops_loudly_on_a_cell_past_its_timeout(tmp_path):
    sys.path.insert(0, str(ROOT / "notebooks"))
    try:
        import run_notebooks
    finally:
        sys.path.pop(0)
    from nbclient.exceptions import CellTimeoutError

    source = _chapter(tmp_path, "time.sleep(60)")
    with pytest.raises(CellTimeoutError):
        run_notebooks.execute(source, cell_timeout=3, smoke=True)
    assert not source.with_suffix(".ipynb").exists()  # nothing half-written


def test_make_notebooks_runs_the_executor_with_a_cell_timeout():
    done = subprocess.run(["make", "-n", "-o", ".venv/.installed", "notebooks", "NOTEBOOKS=04",
                           "NOTEBOOK_CELL_TIMEOUT=120"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "notebooks/run_notebooks.py --cell-timeout 120 04" in done.stdout
