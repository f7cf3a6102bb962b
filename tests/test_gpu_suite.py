"""benchmarks/gpu_suite.sh: the CPU dry run goes through every stage; a broken install stops at the smoke."""
import importlib.util
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from latentmoe_lab.profiling import load_chrome_trace

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"


def _suite_module():
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, *args):
    env = dict(os.environ, OUT=str(tmp_path))
    env.pop("GPU_SUITE_DRY_RUN", None)
    return subprocess.run(["bash", str(SUITE), *args], env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the kernels need triton")
def test_dry_run_runs_every_stage(tmp_path):
    done = _run(tmp_path, "--dry-run")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    rows = report["rows"]
    assert report["dry_run"] and {r["stage"] for r in rows} == {"smoke", "kernels", "profile", "engine"}
    assert all(r["status"] in ("ok", "skipped") for r in rows), rows
    compared = [r for r in rows if r["stage"] == "kernels" and "tol" in r["parity"]]
    assert {r["item"] for r in compared} >= {"routing", "combine", "grouped SwiGLU", "grouped GEMM down",
                                             "sparse attention", "dequant GEMM fp8", "dequant GEMM mxfp4"}
    assert all(r["ms"] > 0 and r["twin_ms"] > 0 for r in compared)
    items = {r["item"] for r in rows}
    assert {"prefill wall", "decode step wall", "prefill attn.kda", "decode moe.experts", "decode step"} <= items
    for phase in ("prefill", "decode"):
        load_chrome_trace(tmp_path / f"profile-{phase}.trace.json")
    table = (tmp_path / "gpu_suite.md").read_text()
    assert table.count("\n| ") == len(rows) + 1 and "| kernels | combine |" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the early exit where no GPU is present")
def test_without_a_gpu_the_smoke_stops_the_suite(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 2, done.stdout[-2000:]
    rows = json.loads((tmp_path / "gpu_suite.json").read_text())["rows"]
    assert [r["stage"] for r in rows] == ["smoke"] and rows[0]["status"] == "error"
    assert "CUDA" in rows[0]["note"] and "suite stops here" in done.stdout


def test_parity_applies_the_family_tolerance():
    suite = _suite_module()
    ref = torch.ones(4)
    close = SimpleNamespace(family="combine", diff=lambda a, b: float((a - b).abs().max()))
    assert suite._parity(close, ref + 1e-3, ref)[1] == "ok"
    assert suite._parity(close, ref + 0.1, ref)[1] == "mismatch"
    picks = SimpleNamespace(family="routing", diff=lambda a, b: float((a != b).sum()))
    assert suite._parity(picks, torch.tensor([0, 1]), torch.tensor([1, 0]))[1] == "mismatch"
    in_place = SimpleNamespace(family="KDA decode step", diff=None)
    assert suite._parity(in_place, ref, ref) == ("not compared (state updated in place)", "ok")
