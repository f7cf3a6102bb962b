"""serve-bench on a disaggregated service file (docs/design.md §13.2): the report holds both instances' step
timelines and the transfers between them, read back from the numbers embedded in the page (its Data section
and the plotly figure's traces), and the instance processes are gone afterwards."""
import json
import re

import psutil
import pytest
import yaml

from latentmoe_lab.cli import main
from latentmoe_lab.report import Data, html_report, read_report_data
from latentmoe_lab.server.disagg_report import DATA_NAME

SERVICE = {"model": {"name": "tiny-pd", "preset": "tiny", "max_model_len": 256},
           "parallel": {"forward_threads": 1},
           "memory": {"max_num_seqs": 8, "block_size": 16, "cache_bytes": 4_000_000},
           "scheduler": {"max_batch_size": 64, "prefill_chunk_size": 32},
           "disaggregation": {"prefill_instances": 1, "decode_instances": 1, "transport": "pipe",
                              "decode": {"memory": {"cache_bytes": 6_000_000}}}}
REQUESTS, NEW_TOKENS = 4, 4


def _service_file(tmp_path) -> str:
    path = tmp_path / "service-pd.yaml"
    path.write_text(yaml.safe_dump(SERVICE))
    return str(path)


def _figure_traces(page: str) -> dict[str, dict]:
    """The plotly figure's traces by name, decoded from the Plotly.newPlot call in the page."""
    match = re.search(r'Plotly\.newPlot\(\s*"[^"]+",\s*', page)
    assert match is not None, "no plotly figure in the report"
    traces, _ = json.JSONDecoder().raw_decode(page, match.end())
    return {trace["name"]: trace for trace in traces}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_serve_bench_disagg_reports_both_instances_and_every_transfer(tmp_path, capsys):
    report = tmp_path / "serve.html"
    code = main(["serve-bench", "--config", _service_file(tmp_path), "--requests", str(REQUESTS), "--rate", "40",
                 "--min-prompt", "8", "--max-prompt", "60", "--max-tokens", str(NEW_TOKENS), "--report", str(report)])
    out = capsys.readouterr().out
    assert code == 0, out
    page = report.read_text()
    data = read_report_data(page, DATA_NAME)

    requests = data["requests"]
    assert len(requests) == REQUESTS
    assert all(r["generated_tokens"] == NEW_TOKENS and r["reason"] == "length" and r["error"] is None
               for r in requests)
    assert set(data["instances"]) == {"prefill0", "decode0"}
    prefill, decode = data["instances"]["prefill0"]["steps"], data["instances"]["decode0"]["steps"]
    # the prefill instance ran every prompt token and no decode; the decode instance decoded tokens 2..n only
    assert sum(s["prefill_tokens"] for s in prefill) == sum(r["prompt_tokens"] for r in requests)
    assert sum(s["decode_tokens"] for s in prefill) == 0
    assert sum(s["prefill_tokens"] for s in decode) == sum(s["prefill_chunks"] for s in decode) == 0
    assert sum(s["decode_tokens"] for s in decode) == REQUESTS * (NEW_TOKENS - 1)
    assert sum(s["prefill_chunks"] for s in prefill) >= REQUESTS  # 32-token chunks: a 60-token prompt takes two

    transfers = data["transfers"]
    assert sorted(t["key"] for t in transfers) == sorted(r["key"] for r in requests)  # one per request
    by_key = {r["key"]: r for r in requests}
    for t in transfers:
        assert (t["source"], t["target"]) == ("prefill0", "decode0") and t["bytes"] > 0
        assert t["prompt_tokens"] == by_key[t["key"]]["prompt_tokens"]
        assert by_key[t["key"]]["submitted"] <= t["start"] <= t["start"] + t["seconds"] <= by_key[t["key"]]["end"]
    assert data["counts"]["transfers"] == REQUESTS and data["counts"]["recomputed"] == 0

    traces = _figure_traces(page)  # the figure draws the same steps and transfers
    for name, steps in (("prefill0", prefill), ("decode0", decode)):
        for kind in ("prefill", "decode"):
            bars = traces[f"{name} {kind} tokens"]
            assert len(bars["x"]) == len(steps)
            assert sum(bars["y"]) == sum(s[f"{kind}_tokens"] for s in steps)
    assert traces["transfers"]["x"].count(None) == REQUESTS

    assert "ttft prefill" in out and "tpot decode" in out
    for name, instance in data["instances"].items():
        assert _gone(instance["pid"]), f"{name} (pid {instance['pid']}) still runs after serve-bench"


def test_serve_bench_disagg_refuses_images(tmp_path, capsys):
    assert main(["serve-bench", "--config", _service_file(tmp_path), "--image-fraction", "0.5",
                 "--report", str(tmp_path / "r.html")]) == 2
    assert "--image-fraction" in capsys.readouterr().err


def test_report_data_round_trips_and_cannot_end_its_script():
    payload = {"text": "</script><script>alert(1)</script>", "values": [1, 2.5, None]}
    page = html_report("t", ["a text block", Data("numbers", payload)])
    assert read_report_data(page, "numbers") == payload
    assert page.count("</script>") == 1
    with pytest.raises(KeyError, match="other"):
        read_report_data(page, "other")
    with pytest.raises(ValueError, match="name:"):
        Data("no spaces", {})


def test_step_records_split_prefill_and_decode_tokens_as_the_engine_counts_them():
    """A step that finishes a prompt counts its tokens as prefill, not decode (the timelines draw them)."""
    from latentmoe_lab.server.loading import load_model
    from latentmoe_lab.server.settings import split_service_dict
    from latentmoe_lab.serving import Engine, SamplingParams

    config, _ = split_service_dict({k: v for k, v in SERVICE.items() if k != "disaggregation"})
    engine = Engine(load_model(config), config)
    engine.generate([[5] * 50, [6] * 10], SamplingParams(max_tokens=3), use_tqdm=False)
    steps, stats = list(engine.log.steps), engine.stats()
    assert sum(s.prefill_tokens for s in steps) == stats["prefill_tokens"] == 60
    assert sum(s.decode_tokens for s in steps) == stats["decode_tokens"] == 2 * 2
    assert [s.prefill_chunks for s in steps][:2] == [1, 2]  # 32 tokens of the first; 16 more and the second


def test_the_workload_has_the_same_prompts_with_or_without_a_vision_tower():
    """serve-bench on a disaggregated service (text only) runs the colocated run's prompts at --image-fraction 0."""
    from latentmoe_lab.serving.bench_workload import synthetic_workload

    runs = [synthetic_workload(12, 4.0, 8, 300, 4, 0.0, 256, seed=3, has_vision=vision) for vision in (True, False)]
    assert [(r.arrival, r.prompt) for r in runs[0]] == [(r.arrival, r.prompt) for r in runs[1]]
