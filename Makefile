# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Each creates .venv (once), installs the CPU torch wheel first, then the package with its dev extras.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# Extra pip arguments for torch, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
# Extra arguments for `make lab`, e.g. LAB_ARGS="--no-browser --port 8899"; as root --allow-root is added to them.
LAB_ARGS ?=
LAB_ROOT_ARGS := $(if $(filter 0,$(shell id -u)),$(if $(filter --allow-root,$(LAB_ARGS)),,--allow-root),)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo model model-mtp test lab clean notebooks

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/latentmoe-lab smoke
	$(PY) -m latentmoe_lab.trained_model demo --checkpoint $(MODEL_DIR)

# The trained model that `make demo` and `latentmoe-lab serve --config configs/service-cpu.yaml` use when it
# exists: the mini preset trained on this interpreter's standard library, MODEL_STEPS steps on two processes of
# one thread each (deterministic: one seed), then exported in bf16 with its training report and tokenizer files.
# 400 steps reach 2.78 held-out bits per byte; the run costs ~430 s of CPU time (~3.6 min on 2 idle cores; 5 min
# 46 s measured on a shared 2-core VM at load average 3-4), and two runs give bit-identical weights.
MODEL_DIR ?= checkpoints/mini-stdlib
MODEL_STEPS ?= 400
model: $(STAMP)
	$(VENV)/bin/latentmoe-lab train --preset mini --steps $(MODEL_STEPS) --warmup 20 --eval-every 80 --nproc 2 \
		--threads 1 --out runs/mini-stdlib
	$(PY) -m latentmoe_lab.trained_model export runs/mini-stdlib $(MODEL_DIR)

# The same run with a one-depth MTP head (loss weight 0.3): the drafter of speculative decoding's mtp method
# (benchmarks/bench_spec.py, notebook 09). Not the default model: its weights differ from `make model`'s.
MTP_MODEL_DIR ?= checkpoints/mini-stdlib-mtp
model-mtp: $(STAMP)
	$(VENV)/bin/latentmoe-lab train --preset mini --steps $(MODEL_STEPS) --warmup 20 --eval-every 80 --nproc 2 \
		--threads 1 --mtp-depth 1 --mtp-weight 0.3 --out runs/mini-stdlib-mtp
	$(PY) -m latentmoe_lab.trained_model export runs/mini-stdlib-mtp $(MTP_MODEL_DIR)

test: $(STAMP)
	$(PY) -m pytest

lab: $(STAMP)
	$(VENV)/bin/jupyter lab $(LAB_ROOT_ARGS) $(LAB_ARGS) notebooks/

clean:
	rm -rf $(VENV) reports .pytest_cache

# Re-create every notebooks/NN_*.ipynb from its jupytext .py source and execute it at full size: one fresh
# kernel per chapter, progress per cell, a cell past NOTEBOOK_CELL_TIMEOUT seconds (or one that raises) stops
# the run with an error, and known stderr noise is stripped from the outputs. NOTEBOOKS="03 04" picks chapters.
NOTEBOOK_CELL_TIMEOUT ?= 900
NOTEBOOKS ?=
notebooks: $(STAMP)
	$(PY) notebooks/run_notebooks.py --cell-timeout $(NOTEBOOK_CELL_TIMEOUT) $(NOTEBOOKS)
