"""One resolution of a service file for `serve`, `serve-bench` and `plan-service` (server/loading.resolve_service).

They used to check different models: with model.checkpoint_if_present built, `serve` ran the checkpoint while
plan-service and the colocated serve-bench planned the preset, so a file they accepted `serve` refused.
plan-service also accepted what serve-bench refused after building the model (eplb.num_redundant_experts 3),
showed the CPU figure only on its last line, had no per-role figure for a P/D file, and took the file as an
argument where serve-bench took --config. Nothing here loads weights: the plans read config.json only.
"""
import pytest
import yaml

from latentmoe_lab.cli import main
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.server.loading import resolve_service

SERVICE = {"model": {"preset": "tiny", "max_model_len": 512},
           "memory": {"max_num_seqs": 32, "block_size": 16, "cache_bytes": 4_000_000}}


def _write(tmp_path, service: dict, name: str = "service.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(service))
    return str(path)


@pytest.fixture
def bigger_checkpoint(tmp_path):
    """A checkpoint directory (config.json is all a plan reads) of a larger model than the preset."""
    directory = tmp_path / "mini-run"
    directory.mkdir()
    ModelConfig.from_preset("mini").to_json(directory / "config.json")
    return directory


def test_the_checkpoint_serve_would_run_is_planned_by_all_three(tmp_path, bigger_checkpoint, capsys):
    path = _write(tmp_path, SERVICE | {"model": SERVICE["model"] | {"checkpoint_if_present": str(bigger_checkpoint)}})
    with pytest.raises(ValueError, match=r"memory\.cache_bytes: 4000000 bytes cannot hold"):
        resolve_service(path)
    for argv in (["plan-service", path], ["serve-bench", "--config", path, "--requests", "1"]):
        assert main(argv) == 2
        assert "memory.cache_bytes: 4000000 bytes cannot hold" in capsys.readouterr().err
    plain = _write(tmp_path, SERVICE, "plain.yaml")  # the preset alone fits: accepted, the preset planned
    config, _ = resolve_service(plain)
    assert config.model.preset == "tiny" and config.model.checkpoint is None


def test_plan_service_and_serve_bench_take_the_file_either_way(tmp_path, capsys):
    path = _write(tmp_path, SERVICE | {"eplb": {"enabled": True, "num_redundant_experts": 3},
                                       "parallel": {"expert_parallel_size": 2}})
    for argv in (["plan-service", path], ["plan-service", "--config", path], ["serve-bench", path]):
        assert main(argv) == 2  # refused by all alike, before any model is built
        assert "eplb.num_redundant_experts: moe.num_experts (8) + it must divide" in capsys.readouterr().err
    assert main(["plan-service", path, "--config", path]) == 2
    assert "give the service file once" in capsys.readouterr().err


def test_plan_service_shows_what_serve_holds_here_first_per_role(tmp_path, capsys):
    pd = SERVICE | {"disaggregation": {"prefill_instances": 1, "decode_instances": 1,
                                       "decode": {"memory": {"cache_bytes": 6_000_000}}}}
    assert main(["plan-service", _write(tmp_path, pd)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("here: prefill instances (1): on a CPU (serve, serve-bench): memory.cache_bytes "
                               "4.00 MB of cache pools per rank -> ")
    assert lines[1].startswith("here: decode instances (1): on a CPU (serve, serve-bench): memory.cache_bytes "
                               "6.00 MB")
    assert "planning only" in lines[2]
