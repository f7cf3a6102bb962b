"""The backend switch: validation, "auto" on CPU, and latentmoe_lab never importing triton by itself."""
import subprocess
import sys

import pytest
import torch

from latentmoe_lab.ops.backend import resolve_backend


def test_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backend: must be one of"):
        resolve_backend("cuda", torch.zeros(1))


def test_torch_and_auto_on_cpu_pick_the_reference():
    x = torch.zeros(2)
    assert resolve_backend("torch", x) == "torch"
    assert resolve_backend("auto", x, None) == "torch"
    assert resolve_backend("auto", x.double()) == "torch"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", torch.zeros(1)) == "triton"
    with pytest.raises(TypeError, match="float64"):
        resolve_backend("triton", torch.zeros(1, dtype=torch.float64))


def test_kernels_are_forward_only(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="forward-only"):
        resolve_backend("triton", x)
    with torch.no_grad():
        assert resolve_backend("triton", x) == "triton"


def test_package_and_auto_ops_do_not_import_triton():
    # In a fresh process: the kernel tests rely on setting TRITON_INTERPRET before triton's import.
    code = ("import sys, torch\n"
            "from latentmoe_lab.ops import kda_chunked, route_topk\n"
            "import latentmoe_lab.model\n"
            "route_topk(torch.randn(4, 8), 2, backend='auto')\n"
            "q = torch.randn(1, 3, 1, 4)\n"
            "kda_chunked(q, q, q, -q.abs(), torch.rand(1, 3, 1), backend='auto')\n"
            "from latentmoe_lab import ModelConfig\n"  # a whole forward and backward: the CPU experts' path too
            "model = latentmoe_lab.model.LatentMoEForCausalLM(ModelConfig.from_preset('tiny'))\n"
            "ids = torch.randint(0, 512, (2, 40))\n"
            "model(ids, labels=ids).loss.backward()\n"
            "assert 'triton' not in sys.modules, 'triton was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
