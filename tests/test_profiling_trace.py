"""Chrome traces of the tiny model: every component label is recorded, the file follows the trace schema."""
import json

import pytest

from latentmoe_lab.cli import main
from latentmoe_lab.profiling import LABELS, label_seconds, load_chrome_trace, trace, validate_chrome_trace
from latentmoe_lab.profiling.cli import build_step
from latentmoe_lab.profiling.summary import trace_summary

MODEL_LABELS = set(LABELS)


def test_prefill_trace_has_every_label_and_valid_schema(model, tmp_path):
    path = trace(build_step(model, "prefill", 2, 40), tmp_path / "prefill.json")
    data = json.loads(path.read_text())
    validate_chrome_trace(data)
    names = {e["name"] for e in data["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "user_annotation"}
    assert MODEL_LABELS <= names, MODEL_LABELS - names
    seconds = label_seconds(data["traceEvents"])
    assert all(seconds[label] > 0 for label in MODEL_LABELS)
    summary = trace_summary(data)
    # exclusive times never exceed the recorded call, and the aten ops it ran are there
    assert sum(seconds.values()) <= summary["wall_s"] * 1.01
    assert any(name.startswith("aten::") for name, _ in summary["top_ops"])
    assert summary["memory"]["CPU"]


@pytest.mark.parametrize("mode", ["decode", "train", "engine"])
def test_other_modes_trace(model, tmp_path, mode):
    model.train(mode == "train")
    try:
        data = load_chrome_trace(trace(build_step(model, mode, 2, 20), tmp_path / f"{mode}.json"))
    finally:
        model.eval()
    seconds = label_seconds(data["traceEvents"])
    assert {"attn.kda", "attn.dsa", "moe.experts", "moe.route"} <= set(seconds)


def test_label_seconds_is_exclusive():
    events = [{"ph": "X", "name": "moe", "ts": 0.0, "dur": 100.0, "pid": 1, "tid": 1},
              {"ph": "X", "name": "moe.route", "ts": 10.0, "dur": 30.0, "pid": 1, "tid": 1},
              {"ph": "X", "name": "moe.experts", "ts": 50.0, "dur": 40.0, "pid": 1, "tid": 1},
              {"ph": "X", "name": "aten::mm", "ts": 55.0, "dur": 10.0, "pid": 1, "tid": 1},  # not a label
              {"ph": "X", "name": "moe.route", "ts": 0.0, "dur": 20.0, "pid": 1, "tid": 2}]  # other thread
    seconds = label_seconds(events)
    assert seconds == pytest.approx({"moe": 30e-6, "moe.route": 50e-6, "moe.experts": 40e-6})


@pytest.mark.parametrize("data, rule", [
    ({"events": []}, "traceEvents"),
    ({"traceEvents": []}, "empty"),
    ({"traceEvents": [{"ph": "Q", "name": "x", "ts": 0}]}, "ph"),
    ({"traceEvents": [{"ph": "X", "name": "x", "ts": 0}]}, "dur"),
    ({"traceEvents": [{"ph": "X", "name": "x", "ts": "0", "dur": 1}]}, "ts"),
    ({"traceEvents": [{"ph": "i", "name": 3, "ts": 0}]}, "name"),
])
def test_validate_rejects_bad_traces(data, rule):
    with pytest.raises(ValueError, match=rule):
        validate_chrome_trace(data)


def test_trace_rejects_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="fn"):
        trace(None, tmp_path / "x.json")
    with pytest.raises(ValueError, match="warmup"):
        trace(lambda: None, tmp_path / "x.json", warmup=-1)


def test_profile_command_writes_trace_and_html(tmp_path, capsys):
    assert main(["profile", "--preset", "tiny", "--mode", "decode", "--prompt-len", "16", "--out", str(tmp_path)]) == 0
    load_chrome_trace(tmp_path / "tiny-decode.trace.json")
    html = (tmp_path / "tiny-decode.html").read_text()
    assert "Time by component" in html and "Allocated memory" in html and "attn.kda" in html
    assert main(["profile", "--batch", "0", "--out", str(tmp_path)]) == 2
