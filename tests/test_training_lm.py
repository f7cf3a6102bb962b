"""The LM training loop: outputs, resume == uninterrupted, 2 processes == 1, the CLI, bad settings."""
import json
import math
import re
import sysconfig

import pytest
import torch
from safetensors.torch import load_file

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.cli import main
from latentmoe_lab.training.lm import TrainSettings, train, warmup_cosine

SMALL_CORPUS = dict(corpus_root=sysconfig.get_paths()["stdlib"] + "/json", held_out_fraction=0.3)


def _settings(**changes) -> TrainSettings:
    base = dict(preset="tiny", steps=4, batch=4, seq_len=32, lr=3e-3, warmup=2, eval_every=2, eval_rows=4,
                sample_tokens=0, threads=1, **SMALL_CORPUS)
    return TrainSettings(**{**base, **changes})


def test_a_run_writes_its_state_report_and_a_loadable_checkpoint(tmp_path):
    history = train(_settings(out=str(tmp_path), sample_tokens=8))
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert {"step", "train_loss", "eval", "tokens_seen", "seconds"} <= set(state)
    assert state["step"] == 4 and len(state["train_loss"]) == 4 and state["tokens_seen"] == 4 * 4 * 32
    assert [row[0] for row in state["eval"]] == [2, 4]
    assert all(math.isfinite(x) for x in state["train_loss"]) and state["train_loss"][-1] < math.log(512)
    assert state["eval"][-1][2] == pytest.approx(state["eval"][-1][1] / math.log(2))
    page = (tmp_path / "report.html").read_text()
    assert page.count("Plotly.newPlot") == 2 and not re.search(r"<script[^>]*\bsrc=", page)
    model = LatentMoEForCausalLM.from_pretrained(tmp_path / "checkpoint")
    assert history.sample.startswith("import os") and len(history.sample) > len("import os\n\n\ndef ")
    assert model.generate(torch.tensor([[105, 109]]), max_new_tokens=3).shape == (1, 5)
    assert json.loads((tmp_path / "checkpoint" / "trainer.json").read_text())["step"] == 4


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    whole = train(_settings(out=str(tmp_path / "whole")))
    train(_settings(out=str(tmp_path / "split"), stop_at=2))
    state = json.loads((tmp_path / "split" / "trainer_state.json").read_text())
    assert state["step"] == 2 and len(state["train_loss"]) == 2
    resumed = train(_settings(out=str(tmp_path / "split"), resume=True))
    assert resumed.step == 4
    assert resumed.train_loss == pytest.approx(whole.train_loss, abs=1e-6, rel=0)
    assert [row[1] for row in resumed.eval] == pytest.approx([row[1] for row in whole.eval], abs=1e-6, rel=0)
    a = load_file(str(tmp_path / "whole" / "checkpoint" / "model.safetensors"))
    b = load_file(str(tmp_path / "split" / "checkpoint" / "model.safetensors"))
    assert all(torch.allclose(a[name], b[name], atol=1e-6, rtol=0) for name in a)
    assert torch.equal(a["layers.1.ffn.correction_bias"], b["layers.1.ffn.correction_bias"])
    assert a["layers.1.ffn.correction_bias"].abs().sum() > 0  # the bias update did run


def test_two_processes_follow_one_process_with_the_same_global_batch():
    one = train(_settings(steps=3, eval_every=3))
    two = train(_settings(steps=3, eval_every=3, nproc=2, timeout_s=300))
    assert two.train_loss == pytest.approx(one.train_loss, abs=1e-5, rel=0)
    assert two.eval[-1][1] == pytest.approx(one.eval[-1][1], abs=1e-5, rel=0)
    assert [row[1] for row in two.expert_load] == [row[1] for row in one.expert_load]  # counts summed over ranks


def test_the_cli_trains_with_preset_defaults_overridden(tmp_path, capsys):
    assert main(["train", "--preset", "tiny", "--steps", "2", "--batch", "2", "--seq-len", "32", "--eval-every",
                 "2", "--eval-rows", "2", "--out", str(tmp_path), "--threads", "1",
                 "--corpus-root", SMALL_CORPUS["corpus_root"], "--held-out-fraction", "0.3", "--sample-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "bits per byte" in out and "tokens/s" in out and "greedy sample" in out
    assert json.loads((tmp_path / "trainer_state.json").read_text())["step"] == 2


def test_schedule_and_bad_settings():
    factor = warmup_cosine(warmup=4, total=20, min_ratio=0.1)
    assert factor(0) == pytest.approx(0.25) and factor(3) == pytest.approx(1.0)
    assert factor(20) == pytest.approx(0.1) and factor(12) == pytest.approx(0.55)
    for bad, message in [(dict(batch=3, nproc=2), "batch"), (dict(lr=float("nan")), "lr"),
                         (dict(stop_at=9), "stop_at"), (dict(resume=True), "out"), (dict(steps=0), "steps")]:
        with pytest.raises(ValueError, match=message):
            train(_settings(**bad))


def test_mini_preset_has_every_mechanism_on_at_5_to_20m_parameters():
    from latentmoe_lab.config import ModelConfig
    from latentmoe_lab.meta import count_parameters
    from latentmoe_lab.training.lm import PRESET_DEFAULTS

    config = ModelConfig.from_preset("mini")
    assert 5e6 <= count_parameters(config)["total"] <= 20e6
    assert config.first_dense_layers == 1 and config.layer_types == ["kda", "kda", "kda", "dsa"]
    assert config.indexer.topk < PRESET_DEFAULTS["mini"]["seq_len"]
    assert config.moe.latent_size < config.hidden_size
    assert config.moe.num_shared_experts >= 1 and config.moe.num_experts > config.moe.top_k
    assert config.moe.n_group > 1 and config.moe.topk_group < config.moe.n_group
