"""Execute the chapters (NN_topic.py, jupytext percent) into their .ipynb copies, loudly and with time limits.

    python notebooks/run_notebooks.py                     # every chapter at full size
    python notebooks/run_notebooks.py --smoke 03 04       # chosen chapters, LATENTMOE_SMOKE=1
    python notebooks/run_notebooks.py --cell-timeout 300

Each chapter runs in a fresh kernel through nbclient. Progress goes to stderr, one line per code cell
with its time. A cell that raises, or that runs past --cell-timeout seconds, stops the run with a
non-zero exit status naming the chapter and the cell (a hung cell can no longer stall `make notebooks`
silently). Outputs are cleaned of known stderr noise (latentmoe_lab.viz.notebook.clean_outputs) before
the .ipynb is written; a chapter that fails leaves its previous .ipynb untouched.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

from latentmoe_lab.viz.notebook import clean_outputs

HERE = Path(__file__).resolve().parent


def chapters(selected: list[str]) -> list[Path]:
    """NN_*.py sources, all or those whose name starts with one of `selected` (e.g. "04")."""
    found = sorted(HERE.glob("[0-9][0-9]_*.py"))
    if selected:
        found = [p for p in found if any(p.name.startswith(s) for s in selected)]
        if not found:
            raise SystemExit(f"run_notebooks: no chapter matches {selected}")
    return found


def execute(source: Path, cell_timeout: int, smoke: bool) -> None:
    notebook = jupytext.read(source)
    code_cells = [i for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"]
    started = {}

    def on_execute(cell, cell_index):  # a code cell is about to run
        started[cell_index] = time.perf_counter()
        print(f"{source.stem}: code cell {code_cells.index(cell_index) + 1}/{len(code_cells)} ...", end="",
              file=sys.stderr, flush=True)

    def on_executed(cell, cell_index, execute_reply):  # its reply came back
        print(f" {time.perf_counter() - started[cell_index]:.1f}s", file=sys.stderr, flush=True)

    env = {"LATENTMOE_SMOKE": "1" if smoke else "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    os.environ.update(env)  # the kernel is a child of this process and inherits them
    client = NotebookClient(notebook, timeout=cell_timeout, kernel_name="python3", startup_timeout=120,
                            resources={"metadata": {"path": str(HERE)}},
                            on_cell_execute=on_execute, on_cell_executed=on_executed)
    client.execute()
    removed = clean_outputs(notebook)
    nbformat.write(notebook, source.with_suffix(".ipynb"))
    print(f"{source.stem}: written ({removed} noise lines removed)", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("chapters", nargs="*", help="chapter prefixes such as 04 (default: all)")
    parser.add_argument("--smoke", action="store_true", help="run small (LATENTMOE_SMOKE=1), as the tests do")
    parser.add_argument("--cell-timeout", type=int, default=600, help="seconds per cell (default: 600)")
    args = parser.parse_args(argv)
    if args.cell_timeout < 1:
        parser.error(f"--cell-timeout: must be >= 1 second, got {args.cell_timeout}")
    for source in chapters(args.chapters):
        try:
            execute(source, args.cell_timeout, args.smoke)
        except CellTimeoutError as error:
            print(f"\n{source.name}: a cell ran past --cell-timeout {args.cell_timeout}s: {error}", file=sys.stderr)
            return 1
        except (CellExecutionError, DeadKernelError) as error:
            print(f"\n{source.name}: failed:\n{error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
