"""`train --resume` continues exactly or refuses (issue 24 item 3, the outside review's D4 and the resume cases
of D9): changed flags, disagreeing step counters and damaged trainer files are one-line errors naming the
flag or the file and field, raised before the corpus is read when the checkpoint's JSON alone shows them;
--allow-changed-flags applies a change and records it; an unchanged resume stays bit-exact."""
import importlib
import json
import shutil
import sysconfig

import pytest
import torch
from safetensors.torch import load_file, save_file

from latentmoe_lab import cli
from latentmoe_lab.training import lm
from latentmoe_lab.training.lm import warmup_cosine

RUN_FLAGS = ["--preset", "tiny", "--steps", "4", "--batch", "4", "--seq-len", "32", "--lr", "0.003", "--warmup", "2",
             "--eval-every", "2", "--eval-rows", "4", "--sample-tokens", "0", "--threads", "1",
             "--corpus-root", sysconfig.get_paths()["stdlib"] + "/json", "--held-out-fraction", "0.3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"whole": a 4-step run, "stopped": the same run stopped after step 2} (output directories)."""
    root = tmp_path_factory.mktemp("runs")
    assert cli.main(["train", *RUN_FLAGS, "--out", str(root / "whole")]) == 0
    assert cli.main(["train", *RUN_FLAGS, "--out", str(root / "stopped"), "--stop-at", "2"]) == 0
    return {"whole": root / "whole", "stopped": root / "stopped"}


@pytest.fixture
def stopped(runs, tmp_path):
    """A private copy of the run stopped at step 2."""
    return shutil.copytree(runs["stopped"], tmp_path / "run")


@pytest.fixture
def no_corpus(monkeypatch):
    """Fail the test if the run gets as far as reading the corpus."""
    def refuse(*args, **kwargs):
        raise AssertionError("the corpus was loaded before the resume was checked")

    monkeypatch.setattr(lm, "load_corpus", refuse)


def _refused(argv: list[str], capsys) -> str:
    """Run the CLI, expect exit 2 with a single error line and no traceback; return that line."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("latentmoe-lab train: error: ")
    return lines[0]


def _trainer_json(run) -> dict:
    return json.loads((run / "checkpoint" / "trainer.json").read_text())


CHANGED_FLAGS = {
    "lr": (["--lr", "0.01"], "--lr: 0.01 differs from the run's 0.003"),
    "batch": (["--batch", "2"], "--batch: 2 differs from the run's 4"),
    "seed": (["--seed", "1"], "--seed: 1 differs from the run's 0"),
    "seq-len": (["--seq-len", "16"], "--seq-len: 16 differs from the run's 32"),
    "steps": (["--steps", "6"], "--steps: 6 differs from the run's 4"),
    "eval-rows": (["--eval-rows", "8"], "--eval-rows: 8 differs from the run's 4"),
}


@pytest.mark.parametrize("name", CHANGED_FLAGS)
def test_a_changed_flag_is_refused_naming_it_before_the_corpus_is_read(name, stopped, no_corpus, capsys):
    flags, message = CHANGED_FLAGS[name]
    before = (stopped / "checkpoint" / "trainer.json").read_bytes()
    line = _refused(["train", "--out", str(stopped), "--resume", *flags], capsys)
    assert message in line and "--allow-changed-flags" in line
    assert (stopped / "checkpoint" / "trainer.json").read_bytes() == before


def test_the_model_cannot_change_even_when_changes_are_allowed(stopped, no_corpus, capsys):
    line = _refused(["train", "--out", str(stopped), "--resume", "--preset", "mini", "--allow-changed-flags"], capsys)
    assert "--preset: 'mini' differs from the run's 'tiny'" in line and "cannot change" in line


def test_an_allowed_change_is_applied_from_the_step_and_recorded(stopped, capsys):
    assert cli.main(["train", "--out", str(stopped), "--resume", "--lr", "0.01", "--allow-changed-flags",
                     "--stop-at", "3", "--eval-every", "3"]) == 0  # --stop-at and --eval-every are free
    assert "--lr 0.01 instead of the run's 0.003" in capsys.readouterr().err
    meta = _trainer_json(stopped)
    change = {"step": 2, "setting": "lr", "from": 0.003, "to": 0.01}
    assert meta["step"] == 3 and meta["changed_flags"] == [change] and meta["settings"]["lr"] == 0.01
    # a later resume without flags keeps the new value and the record; the lr follows the schedule from 0.01
    assert cli.main(["train", "--out", str(stopped), "--resume"]) == 0
    meta = _trainer_json(stopped)
    assert meta["step"] == 4 and meta["changed_flags"] == [change]
    assert meta["scheduler"]["base_lrs"] == [0.01, 0.01]
    assert meta["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.01 * warmup_cosine(2, 4, 0.1)(4))


def test_a_resume_with_no_flags_takes_the_runs_own_and_is_bit_exact(runs, stopped):
    assert cli.main(["train", "--out", str(stopped), "--resume", "--threads", "1"]) == 0
    whole = load_file(str(runs["whole"] / "checkpoint" / "model.safetensors"))
    resumed = load_file(str(stopped / "checkpoint" / "model.safetensors"))
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[name], resumed[name]) for name in whole)
    states = [json.loads((run / "trainer_state.json").read_text()) for run in (runs["whole"], stopped)]
    assert states[0]["train_loss"] == states[1]["train_loss"] and states[0]["eval"] == states[1]["eval"]
    assert _trainer_json(stopped)["changed_flags"] == []


def _set(meta: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for key in parents:
        meta = meta[key]
    meta[last] = value


COUNTER_EDITS = {
    "history.step 99": ({"history.step": 99}, "step is 2 but history.step is 99"),
    "history.step 1": ({"history.step": 1}, "step is 2 but history.step is 1"),
    "step -3": ({"step": -3}, "step must be an integer >= 0, got -3"),
    "step '5'": ({"step": "5"}, "step must be an integer >= 0, got '5'"),
    "last_epoch 3": ({"scheduler.last_epoch": 3}, "scheduler.last_epoch is 3"),
    "all at 9 of 4": ({"step": 9, "history.step": 9, "scheduler.last_epoch": 9, "history.train_loss": [1.0] * 9},
                      "step 9 is beyond --steps 4"),
}


@pytest.mark.parametrize("name", COUNTER_EDITS)
def test_disagreeing_or_impossible_step_counters_are_refused_naming_the_field(name, stopped, no_corpus, capsys):
    edits, message = COUNTER_EDITS[name]
    for path, value in edits.items():
        _edit_json(stopped, path, value)
    line = _refused(["train", "--out", str(stopped), "--resume"], capsys)
    assert "trainer.json: " in line and message in line


@pytest.mark.parametrize("argv, message", [
    (["--resume", "--stop-at", "2"], "--stop-at: 2 is not after the checkpoint's step 2"),
    (["--resume", "--out", "{empty}"], "no checkpoint at"),
    (["--allow-changed-flags", "--stop-at", "1"], "allow_changed_flags: only with resume"),
    (["--resume", "--corpus-root", "/nonexistent/dir"], "corpus_root: /nonexistent/dir is not a directory"),
    (["--resume", "--init-from", "/nonexistent/dir", "--tp", "2"], "--init-from: /nonexistent/dir is not a directory"),
])
def test_flag_and_path_errors_come_before_the_corpus(argv, message, stopped, tmp_path, no_corpus, capsys):
    (tmp_path / "empty").mkdir()
    argv = [word.replace("{empty}", str(tmp_path / "empty")) for word in argv]
    out = [] if "--out" in argv else ["--out", str(stopped)]
    assert message in _refused(["train", *out, *argv], capsys)


def _edit_tensors(run, change) -> None:
    path = run / "checkpoint" / "trainer_state.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def _edit_json(run, path: str, value) -> None:
    meta = _trainer_json(run)
    _set(meta, path, value)
    (run / "checkpoint" / "trainer.json").write_text(json.dumps(meta))


def _truncate(run) -> None:
    path = run / "checkpoint" / "trainer_state.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGED_FILES = {
    "rng.torch of another size": (lambda run: _edit_tensors(run, lambda t: t.update({"rng.torch": t["rng.torch"][:100]})),
                                  "trainer_state.safetensors: rng.torch must be torch's CPU generator state"),
    "exp_avg of another shape": (lambda run: _edit_tensors(run, lambda t: t.update({"optimizer.0.exp_avg": torch.zeros(3)})),
                                 "trainer_state.safetensors: optimizer.0.exp_avg is torch.float32 [3], its parameter"),
    "exp_avg missing": (lambda run: _edit_tensors(run, lambda t: t.pop("optimizer.0.exp_avg")),
                        "trainer_state.safetensors: optimizer.0 lacks exp_avg"),
    "optimizer at another step": (lambda run: _edit_tensors(run, lambda t: t["optimizer.0.step"].fill_(3)),
                                  "the optimizer state of parameter 0 is at step 3.0, trainer.json at step 2"),
    "truncated trainer_state.safetensors": (_truncate, "trainer_state.safetensors: not a readable safetensors file"),
    "invalid JSON in trainer.json": (lambda run: (run / "checkpoint" / "trainer.json").write_text('{"step": 2,'),
                                     "trainer.json: not valid JSON"),
    "scheduler state of another kind": (lambda run: _edit_json(run, "scheduler.lr_lambdas", [5]),
                                        "trainer.json: scheduler: does not fit a LambdaLR"),
    "unknown history field": (lambda run: _edit_json(run, "history.epochs", 3),
                              "trainer.json: history: History.__init__() got an unexpected keyword argument 'epochs'"),
}


@pytest.mark.parametrize("name", DAMAGED_FILES)
def test_damaged_trainer_files_are_one_line_errors_naming_the_file(name, stopped, capsys):
    damage, message = DAMAGED_FILES[name]
    damage(stopped)
    model_before = (stopped / "checkpoint" / "model.safetensors").read_bytes()
    assert message in _refused(["train", "--out", str(stopped), "--resume"], capsys)
    assert (stopped / "checkpoint" / "model.safetensors").read_bytes() == model_before  # nothing was saved


def test_torchs_engine_checks_a_resume_with_the_same_rules_before_launching(stopped, monkeypatch):
    from latentmoe_lab.native.layout import NativeLayout
    from latentmoe_lab.native.run import train_native

    launch = importlib.import_module("latentmoe_lab.parallel.launch")  # the package re-exports the function
    monkeypatch.setattr(launch, "launch", lambda *a, **k: (_ for _ in ()).throw(AssertionError("launched")))
    recorded = _trainer_json(stopped)["settings"]
    settings = lm.TrainSettings(**{**recorded, "resume": True, "stop_at": None, "nproc": 2})
    with pytest.raises(ValueError, match=r"^lr: 0.01 differs from the run's 0.003"):
        train_native(lm.TrainSettings(**{**settings.__dict__, "lr": 0.01}), NativeLayout(tp=2))
    with pytest.raises(ValueError, match=r"^param_dtype: 'bf16' differs from the run's 'fp32'"):
        train_native(settings, NativeLayout(tp=2, param_dtype="bf16"))
