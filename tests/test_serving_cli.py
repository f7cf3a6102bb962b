"""`latentmoe-lab plan-service` and `latentmoe-lab serve-bench` end to end, small and fast."""
import yaml

from latentmoe_lab.cli import main


def write(tmp_path, data):
    path = tmp_path / "service.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_plan_service_prints_a_per_device_plan(tmp_path, capsys):
    path = write(tmp_path, {"model": {"name": "m", "max_model_len": 65536, "dtype": "fp8"},
                            "parallel": {"tensor_parallel_size": 2, "expert_parallel_size": 2,
                                         "pipeline_parallel_size": 2},
                            "memory": {"kv_cache_dtype": "fp8", "max_num_seqs": 8, "device": "H100-80GB"}})
    assert main(["plan-service", path, "--preset", "small"]) == 0
    out = capsys.readouterr().out
    assert out.count("stage layers") == 2 and "dsa_index" in out and "4 running" in out
    assert "GQA example" in out and "sequences of model.max_model_len" in out


def test_serve_bench_runs_a_small_workload(tmp_path, capsys):
    path = write(tmp_path, {"model": {"preset": "tiny", "max_model_len": 256},
                            "memory": {"cache_bytes": 2_000_000, "block_size": 16, "max_num_seqs": 4,
                                       "prefix_cache": {}},
                            "scheduler": {"prefill_chunk_size": 64, "max_batch_size": 16}})
    report = tmp_path / "serve.html"
    code = main(["serve-bench", "--config", path, "--requests", "6", "--rate", "50", "--max-prompt", "48",
                 "--max-tokens", "4", "--image-fraction", "0.5", "--report", str(report)])
    out = capsys.readouterr().out
    assert code == 0
    assert "6 requests (0 failed)" in out
    for metric in ("queue_time", "ttft", "tpot", "itl", "e2e", "p99"):
        assert metric in out
    assert "blocks_used 0, slots_used 0" in out
    html = report.read_text()
    assert "plotly" in html and "KDA slots used" in html and "ttft" in html


def test_serve_bench_reports_a_bad_config_in_one_line(tmp_path, capsys):
    path = write(tmp_path, {"scheduler": {"prefill_chunk_size": 0}})
    assert main(["serve-bench", "--config", path]) == 2
    assert "scheduler.prefill_chunk_size: must be a positive integer" in capsys.readouterr().err
