"""`latentmoe-lab verify` as users run it: every shipped CPU service file passes, the planning-only file is refused
as `serve` refuses it, bad flags get one line (exit 2), an injection exits 1 naming the path; and the combined
matrix of state-moving paths (the fast part here, the multi-process part marked `matrix`)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from verify_cases import BASE, NGRAM, model, verify  # noqa: F401

ROOT = pathlib.Path(__file__).parent.parent
SHIPPED = sorted(p.name for p in (ROOT / "configs").glob("service-cpu*.yaml"))


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "latentmoe_lab", "verify", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_cpu_file_passes(name, tmp_path):
    out = tmp_path / "verify.json"
    result = run_cli("--config", f"configs/{name}", "--prompts", "4", "--max-tokens", "4", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    table = json.loads(out.read_text())
    assert table["passed"] and all(row["verdict"] == "PASS" and row["requests"] > 0 for row in table["rows"])
    assert "all paths equal the reference" in result.stdout


def test_the_planning_only_file_is_refused_in_one_line():
    result = run_cli("--config", "configs/service-example.yaml")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) <= 2, result.stderr


@pytest.mark.parametrize("args, message", [
    (["--prompts", "1"], "--prompts: must be an integer in [4, 64]"),
    (["--inject", "zero-state"], "--inject: unknown injection 'zero-state'; choose one of zero-kda-state"),
    (["--inject", "stale-spec-slot"], "stale-spec-slot corrupts the spec verify path"),
    (["--max-tokens", "0"], "--max-tokens: must be an integer in [1, 64]"),
])
def test_bad_flags_get_one_line_and_exit_2(args, message):
    result = run_cli("--config", "configs/service-cpu.yaml", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_an_injection_through_the_cli_on_a_worker_process_exits_1_naming_the_path():
    result = run_cli("--config", "configs/service-cpu.yaml", "--prompts", "4", "--max-tokens", "4",
                     "--inject", "zero-kda-state")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FIRST DIVERGENCE" in result.stdout and "path prefix hit" in result.stdout
    assert "worker processes" in result.stdout  # the layer cannot be located there, and it says so


def test_model_flag_verifies_a_saved_checkpoint_and_a_disk_tier_stays_in_scratch(tmp_path):
    """--model: any directory from_pretrained loads (here one of ours); the file's disk_dir is not written."""
    import yaml

    from latentmoe_lab import LatentMoEForCausalLM, ModelConfig

    LatentMoEForCausalLM(ModelConfig.from_preset("tiny")).save_pretrained(tmp_path / "ckpt")
    spill = {"host_bytes": 0, "disk_dir": str(tmp_path / "spill")}
    service = BASE | {"memory": BASE["memory"] | {"prefix_cache": spill}}
    (tmp_path / "service.yaml").write_text(yaml.safe_dump(service))
    result = run_cli("--config", str(tmp_path / "service.yaml"), "--model", str(tmp_path / "ckpt"),
                     "--prompts", "4", "--max-tokens", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tier restore" in result.stdout and not (tmp_path / "spill").exists()


LOSSY = BASE | NGRAM | {"memory": BASE["memory"] | {"kv_cache_dtype": "fp8",
                                                    "offload": {"host_cache_bytes": 2_000_000,
                                                                "hot_rows_per_layer": 40}}}
PD_SPEC = BASE | NGRAM | {"disaggregation": {"prefill_instances": 1, "decode_instances": 1}}


@pytest.mark.parametrize("service", [LOSSY, PD_SPEC], ids=["fp8-offload-spec", "pd-spec"])
def test_combined_files_in_process(model, service):
    report = verify(model, service)
    assert report.passed, report.table()


MATRIX = {
    "ep2-eplb": BASE | {"parallel": {"expert_parallel_size": 2},
                        "eplb": {"enabled": True, "num_redundant_experts": 2, "rebalance_interval_steps": 1000}},
    "tp2-spill-spec": BASE | NGRAM | {"parallel": {"tensor_parallel_size": 2},
                                      "memory": BASE["memory"] | {"prefix_cache": {"host_bytes": 2_000_000}}},
    "pp2-spec": BASE | NGRAM | {"parallel": {"pipeline_parallel_size": 2}},
}


@pytest.mark.matrix
@pytest.mark.parametrize("name", sorted(MATRIX))
def test_matrix_on_worker_processes(model, name):
    """The multi-process part of the matrix (minutes): `make verify-matrix` runs it (fp8 / lossy caches are in
    the in-process part above)."""
    report = verify(model, MATRIX[name])
    assert report.passed, report.table()
