"""Every notebook: its jupytext .py source and .ipynb agree, and it executes in smoke mode."""
import os
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("[0-9][0-9]_*.py"))


def _code_sources(notebook) -> list[str]:
    return [cell.source.strip() for cell in notebook.cells if cell.cell_type == "code"]


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_pair_in_sync(source):
    paired = source.with_suffix(".ipynb")
    assert paired.exists(), f"{paired.name} missing: run `make notebooks`"
    assert _code_sources(jupytext.read(source)) == _code_sources(nbformat.read(paired, as_version=4))


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes_in_smoke_mode(source, monkeypatch):
    monkeypatch.setenv("LATENTMOE_SMOKE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel is a fresh process: same reason as conftest.py
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))
    notebook = jupytext.read(source)
    client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(source.parent)}})
    client.execute()
    errors = [o for cell in notebook.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
