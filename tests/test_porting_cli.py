"""`latentmoe-lab ops`: the operator inventory from the command line, its JSON / CSV forms and its errors."""
import json

import pytest
import torch

from latentmoe_lab.cli import main


def test_ops_command_prints_json_and_csv(capsys):
    assert main(["ops", "--preset", "tiny", "--phase", "decode", "--tokens", "2", "--context", "9", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rows"] and abs(report["flops_per_token"] / report["expected_flops_per_token"] - 1) < 0.02
    assert {"latentmoe.kda_decode_step", "latentmoe.sparse_attention"} <= {r["op"] for r in report["rows"]}
    assert main(["ops", "--preset", "tiny", "--tokens", "5", "--csv"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("layer_type,op,kind,count,flops,bytes_read,bytes_written")


def test_ops_bad_flags_are_one_line_errors(capsys):
    assert main(["ops", "--preset", "tiny", "--tokens", "5", "--context", str(10 ** 9)]) == 2
    assert "ops: error: context:" in capsys.readouterr().err
    for flags in (["--preset", "nope"], ["--phase", "train"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["ops", *flags])
        assert exit_info.value.code == 2


def test_align_takes_the_simulated_device_profiles_as_candidates(tmp_path, capsys):
    report = tmp_path / "sim.html"
    assert main(["align", "--preset", "tiny", "--candidate", "sim-bf16-accum-fp32", "--batch", "1", "--seq-len", "16",
                 "--threshold", "rel_l2=0.001", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "first divergence: layers.0.attn" in out and report.exists()


def test_align_exits_1_when_the_candidate_stops_with_nan(tmp_path, capsys, monkeypatch):
    from latentmoe_lab.alignment import cli as align_cli
    from latentmoe_lab.alignment.candidates import cast_candidate

    def poisoned(name, reference, calibration):  # layer 1's attention output turns NaN
        candidate = cast_candidate(reference, torch.float32)
        with torch.no_grad():
            next(candidate.layers[1].attn.parameters()).fill_(float("nan"))
        return candidate

    monkeypatch.setattr(align_cli, "build_candidate", poisoned)
    report = tmp_path / "nan.html"
    assert main(["align", "--preset", "tiny", "--candidate", "bf16", "--batch", "1", "--seq-len", "16",
                 "--report", str(report)]) == 1
    captured = capsys.readouterr()
    assert "the candidate's forward stopped" in captured.out and report.exists()
    assert "align: the candidate bf16 stopped before the logits" in captured.err
