"""Flags that cannot work are refused in one line naming the flag and the rule, exit status 2, before a corpus
or a model is built: `ops --top`, train's MTP depth, weight and threads (issue 38, item 8)."""
import sysconfig
import time

import pytest

from latentmoe_lab import threads
from latentmoe_lab.cli import main

TRAIN = ["train", "--preset", "tiny", "--steps", "2", "--batch", "2", "--seq-len", "32", "--threads", "1",
         "--corpus-root", sysconfig.get_paths()["stdlib"] + "/json", "--held-out-fraction", "0.3",
         "--sample-tokens", "0"]


def _refused(argv, capsys) -> str:
    start = time.perf_counter()
    assert main(argv) == 2
    # nothing was built: 10**9 MTP depths once grew to 24 GB in 580 s (the bound leaves room for the first
    # import of the command's modules on a busy machine)
    assert time.perf_counter() - start < 30
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    return err


def test_ops_refuses_a_negative_top(capsys):
    assert "ops: error: --top: must be an integer >= 0" in _refused(["ops", "--preset", "tiny", "--top", "-1"], capsys)


@pytest.mark.parametrize("depth", ["31", "32", str(10 ** 9)])  # seq_len 32: depth 31 has no target left
def test_train_refuses_mtp_depths_without_a_target(depth, tmp_path, capsys):
    err = _refused([*TRAIN, "--out", str(tmp_path / "run"), "--mtp-depth", depth], capsys)
    assert "mtp_depth: must be at most seq_len - 2 = 30" in err and err.endswith(f"got {depth}")


def test_train_refuses_an_mtp_weight_without_a_head(tmp_path, capsys):
    err = _refused([*TRAIN, "--out", str(tmp_path / "run"), "--mtp-weight", "0.5"], capsys)
    assert "--mtp-weight: only with --mtp-depth N > 0" in err


@pytest.mark.parametrize("weight", ["1e30", "11", "inf", "nan", "-1"])
def test_train_refuses_an_absurd_mtp_weight(weight, tmp_path, capsys):
    err = _refused([*TRAIN, "--out", str(tmp_path / "run"), "--mtp-depth", "1", "--mtp-weight", weight], capsys)
    assert "mtp_weight: must be a number in [0, 10]" in err


def test_train_refuses_more_threads_than_cores_as_serve_does(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(threads, "affinity_cores", lambda: 2)
    argv = [a if a != "1" else "1000" for a in TRAIN]  # --threads 1000
    err = _refused([*argv, "--out", str(tmp_path / "run")], capsys)
    assert "--threads: 1000 exceeds the 2 cores this process may run on" in err
