"""A short soak: mixed requests through the openai client, zero errors, blocks == slots == 0 after the drain,
the RSS slope and drift table computed, the HTML report written (docs/design.md §10)."""
import math

import psutil
import pytest

from latentmoe_lab.cli import main
from latentmoe_lab.server.soak import run_soak, soak_report
from latentmoe_lab.server.threaded import start_service

SERVICE = {"model": {"name": "tiny-soak", "preset": "tiny", "max_model_len": 512},
           "parallel": {"forward_process": True},  # as configs/service-cpu.yaml
           "memory": {"max_num_seqs": 8, "block_size": 16, "cache_bytes": 1_000_000, "prefix_cache": {}},
           "scheduler": {"max_batch_size": 32, "prefill_chunk_size": 128}}


def test_short_soak_has_no_errors_and_drains_to_zero(tmp_path):
    with start_service(SERVICE) as (served, _worker):
        result = run_soak(served.url, "tiny-soak", duration_s=10, concurrency=8, sample_s=1.0, seed=1)
    assert result.errors == []
    assert result.drained["blocks"] == 0 and result.drained["slots"] == 0
    assert result.drained["running"] == 0 and result.drained["waiting"] == 0
    assert result.ok
    assert len(result.requests) >= 16 and len(result.samples) >= 6
    assert max(s["blocks"] for s in result.samples) > 0  # the sampler saw the load
    assert math.isfinite(result.rss_slope_mib_per_min(0.25))
    # the sampled RSS is the service's: this (server) process plus its forward process
    assert result.samples[-1]["rss"] > psutil.Process().memory_info().rss + 50 * 2**20
    rows = result.drift_table(0.25)
    assert len(rows) == 4 and sum(r["requests"] for r in rows) > 0
    path = soak_report(result, 0.25, tmp_path / "soak.html")
    text = path.read_text()
    assert "RSS slope after warm-up" in text and "plotly" in text


def test_soak_refuses_unbounded_or_remote_runs(tmp_path, capsys):
    config = tmp_path / "service.yaml"
    config.write_text("model: {preset: tiny, max_model_len: 512}\nmemory: {cache_bytes: 1000000}\n")
    assert main(["soak", "--config", str(config), "--minutes", "0"]) == 2
    assert "--minutes" in capsys.readouterr().err
    assert main(["soak", "--config", str(config), "--minutes", "1", "--concurrency", "0"]) == 2
    with pytest.raises(ValueError, match="loopback"):
        run_soak("http://10.1.2.3:8000", "m", 1, 1)
