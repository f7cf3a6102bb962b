"""`latentmoe-lab train --fsdp/--ep/--tp/--pp`: torch's engine follows the plain run, resumes, exports."""
import json
import math
import sysconfig

import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.cli import main
from latentmoe_lab.native.layout import NativeLayout
from latentmoe_lab.native.run import train_native
from latentmoe_lab.training.lm import TrainSettings, train

SMALL_CORPUS = dict(corpus_root=sysconfig.get_paths()["stdlib"] + "/json", held_out_fraction=0.3)


def _settings(**changes) -> TrainSettings:
    base = dict(preset="tiny", steps=4, batch=4, seq_len=32, lr=3e-3, warmup=2, eval_every=2, eval_rows=4,
                sample_tokens=0, threads=1, timeout_s=300, **SMALL_CORPUS)
    return TrainSettings(**{**base, **changes})


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """The weights the plain run starts from (seed 0), as a save_pretrained directory."""
    directory = tmp_path_factory.mktemp("start") / "weights"
    torch.manual_seed(0)
    LatentMoEForCausalLM(_settings().model_config()).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def plain():
    """The plain one-process run (accelerate) that both native runs must follow."""
    return train(_settings())


def test_fsdp_x_ep_training_follows_the_plain_run_and_exports(tmp_path, start, plain):
    native = train_native(_settings(nproc=4, out=str(tmp_path)), NativeLayout(dp_shard=2, ep=2), init_from=start)
    assert native.train_loss == pytest.approx(plain.train_loss, abs=1e-4, rel=0)
    assert [row[1] for row in native.eval] == pytest.approx([row[1] for row in plain.eval], abs=1e-4, rel=0)
    assert native.expert_load == plain.expert_load  # the same routing counts, summed over the data ranks
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert state["step"] == 4 and all(math.isfinite(x) for x in state["train_loss"])
    exported = LatentMoEForCausalLM.from_pretrained(tmp_path / "export")
    assert exported.generate(torch.tensor([[105, 109]]), max_new_tokens=3).shape == (1, 5)
    assert (tmp_path / "report.html").exists()


def test_resume_under_another_layout_continues_the_run(tmp_path, start, plain):
    train_native(_settings(nproc=2, out=str(tmp_path / "split"), stop_at=2), NativeLayout(dp_shard=2),
                 init_from=start)
    assert LatentMoEForCausalLM.from_pretrained(tmp_path / "split" / "export")  # the export the CLI announces
    resumed = train_native(_settings(nproc=2, out=str(tmp_path / "split"), resume=True), NativeLayout(tp=2))
    assert resumed.step == 4
    assert resumed.train_loss == pytest.approx(plain.train_loss, abs=1e-4, rel=0)  # as if never interrupted


def test_the_cli_flags(tmp_path, capsys):
    args = ["train", "--preset", "tiny", "--steps", "2", "--batch", "4", "--seq-len", "32", "--eval-every", "2",
            "--eval-rows", "4", "--threads", "1", "--corpus-root", SMALL_CORPUS["corpus_root"],
            "--held-out-fraction", "0.3", "--sample-tokens", "0", "--out", str(tmp_path)]
    assert main(args + ["--pp", "2", "--schedule", "1f1b"]) == 0
    assert "export (safetensors)" in capsys.readouterr().out
    assert LatentMoEForCausalLM.from_pretrained(tmp_path / "export")  # the stages' export is the whole model
    for bad, message in [(["--tp", "3"], "tp: 3 must divide"), (["--fsdp", "3"], "batch"),
                         (["--fsdp", "2", "--nproc", "4"], "nproc"), (["--init-from", str(tmp_path)], "init_from")]:
        assert main(args + bad) == 2
        assert message in capsys.readouterr().err


def test_a_failed_parallel_run_is_one_line_and_a_bad_group_timeout_is_refused(tmp_path, capsys, monkeypatch):
    """RankFailure already names every rank and collective: the CLI prints it alone (exit 1), no traceback."""
    from latentmoe_lab.parallel.launch import RankFailure

    report = ("parallel run failed: rank 1 raised CollectiveTimeout: rank 1: all_to_all_single in _all_to_all "
              "(expert.py:47) did not return within the group timeout")

    def fails(*args, **kwargs):
        raise RankFailure(report)

    monkeypatch.setattr("latentmoe_lab.native.run.train_native", fails)
    args = ["train", "--preset", "tiny", "--fsdp", "2", "--ep", "2", "--out", str(tmp_path)]
    assert main(args) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [f"latentmoe-lab train: error: {report}"]
    assert "torch threads: " in captured.out  # the thread choice is said before the run
    assert main(args + ["--group-timeout", "0"]) == 2
    assert "group_timeout_s: must be a number of seconds in (0, 3600], got 0.0" in capsys.readouterr().err
