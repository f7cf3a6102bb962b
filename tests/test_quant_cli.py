"""`latentmoe-lab quantize` end to end on a tiny saved model and a small corpus directory."""
import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.cli import main
from latentmoe_lab.meta import recipe_bytes
from latentmoe_lab.quant import held_bytes
from latentmoe_lab.quant.checkpoint import load_quantized


@pytest.fixture
def corpus_root(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(12):
        (root / f"module_{i}.py").write_text(f"def function_{i}(x):\n    return x * {i} + 1\n" * 40)
    return root


@pytest.mark.parametrize("recipe", ["fp8-experts", "int8-w8a8-static"])
def test_quantize_prints_bytes_and_bits_per_byte_and_writes_a_loadable_checkpoint(recipe, tiny_config, tmp_path,
                                                                                  corpus_root, capsys):
    LatentMoEForCausalLM(tiny_config).save_pretrained(tmp_path / "plain")
    argv = ["quantize", "--checkpoint", str(tmp_path / "plain"), "--recipe", recipe, "--out", str(tmp_path / "q"),
            "--corpus-root", str(corpus_root), "--held-out-fraction", "0.5", "--seq-len", "64",
            "--eval-rows", "4", "--calib-rows", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "routed_experts" in out and "bytes after == meta.recipe_bytes" in out
    assert "held-out bits per byte" in out and "top-1 agreement" in out
    loaded = load_quantized(tmp_path / "q")
    assert held_bytes(loaded) == recipe_bytes(tiny_config, recipe, "fp32")["total"]
    assert torch.isfinite(loaded(torch.randint(0, 256, (1, 16))).logits).all()


def test_quantize_refuses_too_few_held_out_rows(tiny_config, tmp_path, corpus_root, capsys):
    LatentMoEForCausalLM(tiny_config).save_pretrained(tmp_path / "plain")
    assert main(["quantize", "--checkpoint", str(tmp_path / "plain"), "--recipe", "fp8-experts", "--out",
              str(tmp_path / "q"), "--corpus-root", str(corpus_root), "--held-out-fraction", "0.5",
              "--eval-rows", "10000"]) == 2
    assert "--eval-rows, --calib-rows: the held-out split has" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
