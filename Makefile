# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Each creates .venv (once), installs the CPU torch wheel first, then the package with its dev extras.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# Extra pip arguments for torch, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lab clean notebooks

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/latentmoe-lab smoke

test: $(STAMP)
	$(PY) -m pytest

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

clean:
	rm -rf $(VENV) reports .pytest_cache

# Re-create every notebooks/NN_*.ipynb from its jupytext .py source and execute it at full size.
notebooks: $(STAMP)
	cd notebooks && for f in [0-9][0-9]_*.py; do ../$(VENV)/bin/jupytext --to ipynb --execute "$$f" || exit 1; done
