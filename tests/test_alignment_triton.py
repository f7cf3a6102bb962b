"""The Triton backend as a candidate: every kernel family runs (interpreter on CPU) and aligns with the ops.

In a fresh process: TRITON_INTERPRET=1 must be set before triton is imported, and the rest of the
suite must not import triton (tests/test_ops_backend.py checks that).
"""
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
torch.set_num_threads(1)
from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.alignment import BackendCandidate, compare
from latentmoe_lab.alignment.candidates import forced_backend
from latentmoe_lab.ops import routing

torch.manual_seed(0)
model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny")).eval()
ids = torch.randint(0, model.config.vocab_size, (1, 9))
report = compare(model, BackendCandidate(model, "triton"), ids)
assert report.first_divergence is None, report.table()
assert all(r.routing_flips == 0.0 for r in report.rows if r.kind == "experts")
logits = report.row("logits")
assert 0 < logits.rel_l2 < 1e-4 and logits.top1_agreement == 1.0, logits
for family in ("routing", "kda", "sparse_attention", "grouped_gemm"):
    assert f"latentmoe_kernels.{family}" in sys.modules, f"the {family} kernels never ran"
assert routing.resolve_backend("auto", torch.zeros(1)) == "torch"  # the override ended with the forward
with forced_backend("triton"):
    assert routing.resolve_backend("auto", torch.zeros(1)) == "triton"
    assert routing.resolve_backend("torch", torch.zeros(1)) == "torch"  # explicit choices are kept
print("ok")
"""


def test_triton_backend_aligns_with_the_reference_ops():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
