"""`latentmoe-lab convert` both ways, a checkpoint's own tokenizer.json carried along and used for text prompts,
and `serve`'s model loading of a transformers directory (docs/design.md §17)."""
from __future__ import annotations

import json

import pytest
import torch

from interop_cases import VOCAB, assert_relative_close, ragged_batch, save_kimi
from latentmoe_lab.cli import main
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.tokenizer import ByteTokenizer, FileTokenizer, load_tokenizer, tokenizer_of

pytest.importorskip("transformers")
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A transformers kimi_linear directory with a word-level tokenizer.json of its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = tmp_path_factory.mktemp("kimi")
    theirs = save_kimi("mla-first", directory)
    tokenizer = Tokenizer(models.WordLevel({w: 10 + i for i, w in enumerate(WORDS)} | {"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory, theirs


def test_convert_to_ours_and_back_keeps_weights_logits_and_tokenizer(saved, tmp_path, capsys):
    directory, theirs = saved
    assert main(["convert", str(directory), "--out", str(tmp_path / "ours")]) == 0
    assert "model_type" not in json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (tmp_path / "ours" / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
    assert main(["convert", str(tmp_path / "ours"), "--out", str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "kimi_linear"
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
    first, last = LatentMoEForCausalLM.from_pretrained(directory), LatentMoEForCausalLM.from_pretrained(tmp_path / "hf")
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), last.state_dict().values()))
    ids, mask = ragged_batch([17, 9], seed=5)
    with torch.no_grad():
        expected, got = theirs(ids, attention_mask=mask).logits, last(ids, attention_mask=mask).logits
    assert_relative_close(got[0, :17], expected[0, :17])
    assert_relative_close(got[1, :9], expected[1, :9])


def test_convert_refuses_in_one_line_and_writes_nothing(tmp_path, capsys):
    from latentmoe_lab.config import ModelConfig

    LatentMoEForCausalLM(ModelConfig.from_preset("tiny")).save_pretrained(tmp_path / "tiny")
    assert main(["convert", str(tmp_path / "tiny"), "--out", str(tmp_path / "hf"), "--to", "hf"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == "latentmoe-lab convert: error: kimi_linear cannot express the vision tower (config.vision): " \
                    "kimi_linear is text-only"
    assert not (tmp_path / "hf").exists()


def test_a_checkpoints_tokenizer_encodes_text_prompts(saved):
    from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig

    directory, theirs = saved
    model = LatentMoEForCausalLM.from_pretrained(directory)
    tokenizer = tokenizer_of(model)
    assert isinstance(tokenizer, FileTokenizer)
    assert tokenizer.encode("the cat sat").tolist() == [[10, 11, 12]]
    assert tokenizer.decode([13, 14]) == "on mat"
    assert isinstance(load_tokenizer(None, 300), ByteTokenizer)  # no checkpoint: bytes
    service = ServiceConfig.from_dict({"model": {"max_model_len": 128}, "memory": {"cache_bytes": 4 << 20}})
    output = Engine(model, service).generate(["the dog sat on a mat"], SamplingParams(max_tokens=4),
                                             use_tqdm=False)[0]
    assert output.prompt_token_ids == [10, 16, 12, 13, 15, 14]
    expected = theirs.generate(torch.tensor([output.prompt_token_ids]), max_new_tokens=4, do_sample=False,
                               pad_token_id=0)
    assert output.token_ids == expected[0, 6:].tolist()


def test_serve_loads_a_transformers_directory(saved):
    from latentmoe_lab.server.loading import load_model, with_checkpoint
    from latentmoe_lab.serving import ServiceConfig

    directory, theirs = saved
    config = with_checkpoint(ServiceConfig.from_dict({"model": {"max_model_len": 128}}), str(directory))
    model = load_model(config)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert_relative_close(model(ids).logits, theirs(ids).logits)
