#!/usr/bin/env bash
# The GPU suite (see benchmarks/gpu_suite.py): smoke, every Triton kernel against its torch twin,
# a prefill/decode profile, the serving engine at batch 64; one table, also written to $OUT or
# benchmarks/gpu_suite/. `--dry-run` (or GPU_SUITE_DRY_RUN=1) runs every stage at tiny sizes on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" benchmarks/gpu_suite.py "$@"
