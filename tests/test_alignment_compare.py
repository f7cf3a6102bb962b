"""compare(): zero error for identical models, an injected one-layer bug named and bisected, the report."""
import copy
import math

import plotly.graph_objects as go
import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.alignment import (BackendCandidate, bisect_layers, cast_candidate, compare, record,
                                     compare_recordings, tap_points)
from latentmoe_lab.cli import main


@pytest.fixture
def model(tiny_config):
    return LatentMoEForCausalLM(tiny_config).eval()


@pytest.fixture
def ids(tiny_config):
    return torch.randint(0, tiny_config.vocab_size, (2, 33))


def test_identical_models_give_zero_error_everywhere(model, ids, tiny_config):
    report = compare(model, copy.deepcopy(model), ids)
    assert [r.name for r in report.rows] == [p.name for p in tap_points(tiny_config)]
    assert report.first_divergence is None
    for row in report.rows:
        if row.kind == "experts":
            assert row.routing_flips == 0.0 and row.weight_max_abs == 0.0
            continue
        assert row.rel_l2 == 0.0 and row.max_abs == 0.0 and row.rel_diff == 0.0, row.name
        assert row.cosine == pytest.approx(1.0) and row.sqnr_db == math.inf
    logits = report.row("logits")
    assert logits.kl_mean == 0.0 and logits.top1_agreement == 1.0 and logits.bpb_delta == 0.0
    # the same model through the backend wrapper ("torch" = what "auto" picks on CPU) is identical too
    assert compare(model, BackendCandidate(model, "torch"), ids).row("logits").max_abs == 0.0


def test_an_injected_one_layer_bug_is_the_first_divergence_and_found_by_bisection(model, ids):
    buggy = copy.deepcopy(model)
    with torch.no_grad():
        buggy.layers[2].attn.o_proj.weight.mul_(3.0)  # a wrong scale on one block's output projection
    report = compare(model, buggy, ids)
    first = report.first_divergence
    assert first is not None and first.name == "layers.2.attn" and "rel_l2" in first.exceeded
    assert first.rel_l2 == pytest.approx(2.0, rel=1e-4)  # 3x the output: |3y - y| / |y| = 2
    before = [r for r in report.rows[:report.rows.index(first)] if r.kind != "experts"]
    assert all(r.max_abs == 0.0 for r in before)  # nothing upstream of the bug moved
    assert report.row("logits").kl_mean > 0
    result = bisect_layers(model, buggy, ids)
    assert result.culprit == "layers.2"
    assert result.alone["layers.2"] == pytest.approx(result.total, rel=1e-6)
    assert result.share_fixed("layers.2") == pytest.approx(1.0)
    assert all(result.alone[u] == 0.0 for u in result.alone if u != "layers.2")
    assert "culprit: layers.2" in result.table()


def test_a_bf16_candidate_is_close_but_not_equal_and_bisects_through_casts(model, ids):
    candidate = cast_candidate(model, torch.bfloat16)
    assert candidate.layers[1].ffn.correction_bias.dtype == torch.float32
    report = compare(model, candidate, ids)
    logits = report.row("logits")
    assert 0 < logits.rel_l2 < 0.1 and 0 < logits.kl_mean < 1e-3
    result = bisect_layers(model, candidate, ids)
    assert set(result.alone) == {"embed_tokens", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "lm_head"}
    assert all(v > 0 for v in result.alone.values())  # every unit rounds in bf16
    assert next(model.parameters()).dtype == torch.float32  # the swaps were undone
    assert compare(model, copy.deepcopy(model), ids).first_divergence is None


def test_thresholds_decide_the_first_divergence_and_nan_always_diverges(model, ids):
    candidate = cast_candidate(model, torch.float16)
    loose = compare(model, candidate, ids, thresholds={"rel_l2": 10.0, "routing_flips": 1.0, "kl_mean": 1.0})
    assert loose.first_divergence is None
    strict = compare(model, candidate, ids, thresholds={"rel_l2": 1e-6})
    assert strict.first_divergence.name == "embed"  # fp16 rounds the embeddings already
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.layers[2].attn.o_proj.weight[0, 0] = float("nan")
    nan_report = compare(model, broken, ids, thresholds={"rel_l2": 10.0})
    row = nan_report.first_divergence
    assert row.name == "layers.2.attn" and row.exceeded[0] == "nonfinite"
    # the NaN reaches the router of layer 2, which refuses it: the report keeps the taps before that
    assert "logits: contains NaN" in nan_report.candidate_error and nan_report.rows[-1].name == "layers.2.attn"
    assert "forward stopped after tap layers.2.attn" in nan_report.summary()
    with pytest.raises(ValueError, match="thresholds: unknown metric 'cos'"):
        compare(model, candidate, ids, thresholds={"cos": 0.9})


def test_same_route_error_separates_arithmetic_from_flips(model, ids):
    ref = record(model, ids)
    cand = record(cast_candidate(model, torch.bfloat16), ids)
    rows = {r.name: r for r in compare_recordings(ref, cand, ids)}
    for i in (1, 2, 3):
        ffn = rows[f"layers.{i}.ffn"]
        assert ffn.rel_l2_same_route is not None and ffn.rel_l2_same_route <= ffn.rel_l2 + 1e-12
    assert rows["layers.0.ffn"].rel_l2_same_route is None  # dense layer: nothing to flip


def test_report_table_figure_and_html(model, ids, tmp_path):
    buggy = copy.deepcopy(model)
    with torch.no_grad():
        buggy.layers[1].ffn.router.weight.mul_(-1.0)  # flips the routing of layer 1
    report = compare(model, buggy, ids, name="flipped-router")
    assert report.first_divergence.name == "layers.1.moe.router_logits"
    assert report.row("layers.1.moe.experts").routing_flips > 0.5
    lines = report.table().splitlines()
    assert len(lines) == 2 + len(report.rows) and lines[2 + report.rows.index(report.first_divergence)].startswith("!")
    fig = report.figure()
    assert isinstance(fig, go.Figure)
    bars = [t for t in fig.data if isinstance(t, go.Bar)][0]
    assert list(bars.x) == ["layer 1", "layer 2", "layer 3"] and bars.y[0] > 0.5
    path = report.to_html(tmp_path / "align.html", extra=["bisection goes here"])
    text = path.read_text()
    assert "flipped-router" in text and "layers.1.moe.router_logits" in text and "bisection goes here" in text


def test_cli_align_writes_the_report_and_prints_the_first_divergence(tmp_path, capsys):
    path = tmp_path / "align-fp16.html"
    assert main(["align", "--candidate", "fp16", "--seq-len", "24", "--bisect", "--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "first divergence:" in out and "culprit:" in out and path.exists()
    text = tmp_path / "held_out.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    assert main(["align", "--candidate", "bf16", "--text", str(text), "--batch", "2", "--seq-len", "40",
                 "--threshold", "rel_l2=0.5", "--report", str(tmp_path / "b.html")]) == 0
    assert "bits/byte delta" in capsys.readouterr().out
    assert main(["align", "--candidate", "bf16", "--threshold", "rel_l2"]) == 2
    assert "METRIC=NUMBER" in capsys.readouterr().err


def test_cli_align_loads_a_checkpoint(model, tmp_path, capsys):
    model.save_pretrained(tmp_path / "ckpt")
    path = tmp_path / "align-ep2.html"
    assert main(["align", "--checkpoint", str(tmp_path / "ckpt"), "--candidate", "ep2", "--seq-len", "16",
                 "--report", str(path)]) == 0
    assert "first divergence: none" in capsys.readouterr().out and path.exists()
    assert main(["align", "--checkpoint", str(tmp_path / "nowhere"), "--candidate", "bf16"]) == 2
    assert "is not a directory" in capsys.readouterr().err
