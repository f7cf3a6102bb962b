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

.PHONY: setup demo model model-mtp test verify-matrix lab clean notebooks

$(STAMP): pyproject.toml
	@echo "make: first run: creating $(VENV) and installing $(TORCH_SPEC), then this package with its dev extras"
	@echo "make: (once; ~4 minutes on a 2-core machine, mostly downloads; pip prints only its warnings and errors)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	@echo "make: torch installed; installing latentmoe-lab with its dev extras (jupyter, lm-eval, transformers, pytest)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)
	@echo "make: $(VENV) is ready"

setup: $(STAMP)

demo: $(STAMP)
	@echo "make: the smoke run (a small random model, an image + text prompt), then the trained model's completion"
	$(VENV)/bin/latentmoe-lab smoke
	$(PY) -m latentmoe_lab.trained_model demo --checkpoint $(MODEL_DIR)

# The trained model that `make demo` and `latentmoe-lab serve --config configs/service-cpu.yaml` use when it
# exists: the mini preset trained on this interpreter's standard library, MODEL_STEPS steps on two processes of
# one thread each (deterministic: one seed), then exported in bf16 with its training report and tokenizer files.
# 400 steps reach about 2.77-2.78 held-out bits per byte; the run costs ~430 s of CPU time (~3.6 min on 2 idle
# cores; 5-6 min measured on a shared 2-core VM at load average 3-6). Two runs of one checkout on one machine
# give bit-identical weights; other weights (and another greedy completion) come with another Python standard
# library (the corpus: `train` prints its sha256), torch version, CPU kernels (AVX2 vs AVX512) or checkout.
# README.md, "What the figures depend on".
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

# The multi-process part of `latentmoe-lab verify`'s matrix (EP + EPLB, TP + spill + spec, PP + spec + fp8 cache):
# minutes on 2 cores, so `make test` leaves it out (tests/test_verify_cli.py, marker `matrix`).
verify-matrix: $(STAMP)
	$(PY) -m pytest -m matrix tests/test_verify_cli.py

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
