"""The trained-model default (latentmoe_lab/trained_model.py): export of a train run, and what `serve` picks.

Independent of checkpoints/mini-stdlib: every path here is a temporary one.
"""
import dataclasses
import json
import sysconfig

import pytest
import torch
from safetensors import safe_open

from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.server.loading import source_line, with_checkpoint
from latentmoe_lab.server.settings import load_service_file, split_service_dict
from latentmoe_lab.trained_model import DEMO_PROMPT, demo, export, main
from latentmoe_lab.training.lm import TrainSettings, train


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(a 3-step tiny train run on the json package, its export) -> (run dir, exported dir)."""
    run = tmp_path_factory.mktemp("run") / "tiny"
    train(TrainSettings(preset="tiny", steps=3, batch=2, seq_len=32, warmup=1, eval_every=3, eval_rows=2,
                        out=str(run), threads=1, sample_tokens=8, held_out_fraction=0.3,
                        corpus_root=sysconfig.get_paths()["stdlib"] + "/json"))
    return run, export(run, tmp_path_factory.mktemp("checkpoints") / "tiny-json")


def test_export_writes_bf16_weights_with_the_training_report(exported):
    run, directory = exported
    for name in ("training.json", "trainer_state.json", "report.html", "tokenizer.json", "config.json"):
        assert (directory / name).is_file(), name
    training = json.loads((directory / "training.json").read_text())
    history = json.loads((run / "trainer_state.json").read_text())
    assert training["steps_done"] == 3 and training["held_out"]["bits_per_byte"] == history["eval"][-1][2]
    trained = LatentMoEForCausalLM.from_pretrained(run / "checkpoint").state_dict()
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        stored = {name: handle.get_tensor(name) for name in handle.keys()}
    assert stored["embed_tokens.weight"].dtype == torch.bfloat16
    for name, tensor in stored.items():  # the trained weights rounded to bf16 (fp32 buffers kept), nothing else
        assert tensor.dtype in (torch.bfloat16, torch.float32) and torch.equal(tensor, trained[name].to(tensor.dtype))
    assert LatentMoEForCausalLM.from_pretrained(directory).config == LatentMoEForCausalLM.from_pretrained(
        run / "checkpoint").config


def test_serve_runs_the_trained_checkpoint_when_present(exported, tmp_path):
    _, directory = exported
    config, _ = load_service_file("configs/service-cpu.yaml")
    assert config.model.checkpoint_if_present == "checkpoints/mini-stdlib" and config.model.preset == "tiny"
    absent = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                   checkpoint_if_present=str(tmp_path / "none")))
    assert with_checkpoint(absent, None) == absent
    assert source_line(absent) == f"no trained checkpoint at {tmp_path / 'none'}: random tiny model; run make model"
    present = dataclasses.replace(config, model=dataclasses.replace(config.model, checkpoint_if_present=str(directory)))
    served = with_checkpoint(present, None)
    assert (served.model.checkpoint, served.model.preset, served.model.name) == (str(directory), None, "tiny-json")
    bits = json.loads((directory / "training.json").read_text())["held_out"]["bits_per_byte"]
    assert source_line(served) == (f"serving {directory} (trained 3 steps of the tiny preset on "
                                   f"{sysconfig.get_paths()['stdlib']}/json, held-out {bits:.2f} bits/byte)")
    explicit = with_checkpoint(present, str(tmp_path / "other"))  # --checkpoint wins, named after its directory
    assert (explicit.model.checkpoint, explicit.model.name) == (str(tmp_path / "other"), "other")


def test_demo_says_what_it_runs(exported, tmp_path):
    _, directory = exported
    line, completion = demo(directory, 4).split(":\n", 1)
    assert line.startswith(f"greedy completion by {directory} (trained 3 steps")
    assert completion.startswith(DEMO_PROMPT) and len(completion) <= len(DEMO_PROMPT) + 4  # 4 bytes at most
    # without a trained model: one line with the command that makes one, not a random model's byte noise
    absent = demo(tmp_path / "none", 4)
    assert absent == (f"no trained model at {tmp_path / 'none'} yet: `make model` trains one (~6 min on 2 cores), "
                      f"then `make demo` shows its completion of {DEMO_PROMPT!r}")


@pytest.mark.parametrize("model,message", [
    ({"checkpoint_if_present": "x"}, "model.checkpoint_if_present: needs model.preset"),
    ({"preset": "tiny", "checkpoint_if_present": ""}, "model.checkpoint_if_present: must not be empty"),
])
def test_checkpoint_if_present_is_checked(model, message):
    with pytest.raises(ValueError, match=message):
        split_service_dict({"model": model})


def test_export_refuses_a_directory_that_is_no_train_run(tmp_path, capsys):
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert f"run_dir: {tmp_path} is not a finished `latentmoe-lab train --out` run" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
