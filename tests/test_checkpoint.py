"""safetensors checkpoints: round trips, shards, dtype, device maps, bad files, pickle refused, interrupted saves."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.checkpoint import parse_size


@pytest.fixture
def trained_like(tiny_config):
    """A tiny model whose routing bias moved (a buffer that must survive the round trip)."""
    model = LatentMoEForCausalLM(tiny_config).eval()
    with torch.no_grad():
        model.layers[1].ffn.correction_bias.copy_(torch.linspace(-0.05, 0.05, tiny_config.moe.num_experts))
    return model


def _ids(config, seed=1):
    return torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(seed))


def test_save_then_load_gives_identical_logits(trained_like, tmp_path):
    path = trained_like.save_pretrained(tmp_path / "ckpt")
    assert sorted(os.listdir(path)) == ["checksums.json", "config.json", "model.safetensors", "special_tokens_map.json",
                                       "tokenizer.json", "tokenizer_config.json"]
    loaded = LatentMoEForCausalLM.from_pretrained(path)
    ids = _ids(trained_like.config)
    assert not loaded.training
    assert torch.equal(loaded(ids).logits, trained_like(ids).logits)
    assert torch.equal(loaded.layers[1].ffn.correction_bias, trained_like.layers[1].ffn.correction_bias)


def test_saved_files_get_the_users_default_modes(trained_like, tmp_path):
    """safetensors writes 0600; a checkpoint's files are 0666 less the umask, like any file the user makes."""
    old = os.umask(0o022)
    try:
        path = trained_like.save_pretrained(tmp_path / "ckpt")
    finally:
        os.umask(old)
    modes = {entry.name: entry.stat().st_mode & 0o777 for entry in path.iterdir()}
    assert modes and set(modes.values()) == {0o644}, modes


def test_sharded_save_writes_an_index_and_loads_back(trained_like, tmp_path):
    path = trained_like.save_pretrained(tmp_path / "ckpt", max_shard_size="200KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (path / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(trained_like.state_dict())
    for shard in shards:  # each shard within the limit unless it holds a single larger tensor
        tensors = load_file(str(path / shard))
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 200_000
    ids = _ids(trained_like.config)
    assert torch.equal(LatentMoEForCausalLM.from_pretrained(path)(ids).logits, trained_like(ids).logits)


def test_dtype_keeps_the_routing_bias_fp32(trained_like, tmp_path):
    loaded = LatentMoEForCausalLM.from_pretrained(trained_like.save_pretrained(tmp_path / "c"), dtype=torch.bfloat16)
    assert loaded.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.layers[1].ffn.correction_bias.dtype == torch.float32
    assert torch.equal(loaded.layers[1].ffn.correction_bias, trained_like.layers[1].ffn.correction_bias)


def test_tied_embeddings_are_stored_once_and_retied(tiny_config, tmp_path):
    model = LatentMoEForCausalLM(tiny_config.replace(tie_word_embeddings=True)).eval()
    path = model.save_pretrained(tmp_path / "tied")
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    loaded = LatentMoEForCausalLM.from_pretrained(path)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    ids = _ids(tiny_config)
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_device_map_with_disk_offload(trained_like, tmp_path):
    path = trained_like.save_pretrained(tmp_path / "c", max_shard_size="300KB")
    device_map = {"embed_tokens": "cpu", "layers.0": "cpu", "layers.1": "disk", "layers.2": "cpu",
                  "layers.3": "disk", "norm": "cpu", "lm_head": "cpu", "vision": "cpu"}
    loaded = LatentMoEForCausalLM.from_pretrained(path, device_map=device_map, offload_folder=tmp_path / "offload")
    assert loaded.layers[1].ffn.experts.w13.device.type == "meta"  # really on disk until its block runs
    ids = _ids(trained_like.config)
    assert torch.equal(loaded(ids).logits, trained_like(ids).logits)


def test_missing_unexpected_and_mismatched_tensors_are_named(trained_like, tmp_path):
    path = trained_like.save_pretrained(tmp_path / "c")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["layers.2.attn.q_proj.weight"]
    tensors["layers.9.extra"] = torch.zeros(3)
    tensors["norm.weight"] = torch.ones(5)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError) as error:
        LatentMoEForCausalLM.from_pretrained(path)
    message = str(error.value)
    assert "missing tensors [layers.2.attn.q_proj.weight]" in message
    assert "unexpected tensors [layers.9.extra]" in message
    assert "norm.weight: checkpoint [5] in model.safetensors vs model [64]" in message


def test_pickle_files_are_refused(trained_like, tmp_path):
    path = trained_like.save_pretrained(tmp_path / "c")
    torch.save(trained_like.state_dict(), path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pickle.*pytorch_model\.bin|pytorch_model\.bin.*pickle"):
        LatentMoEForCausalLM.from_pretrained(path)
    bad_index = tmp_path / "idx"
    bad_index.mkdir()
    (bad_index / "config.json").write_text(trained_like.config.to_json())
    (bad_index / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "weights.pt.zip"}}))
    with pytest.raises(ValueError, match="non-safetensors"):
        LatentMoEForCausalLM.from_pretrained(bad_index)


def test_bad_arguments(trained_like, tmp_path):
    with pytest.raises(FileNotFoundError, match="path"):
        LatentMoEForCausalLM.from_pretrained(tmp_path / "nothing")
    with pytest.raises(ValueError, match="max_shard_size"):
        trained_like.save_pretrained(tmp_path / "c", max_shard_size="lots")
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1MiB") == 2**20 and parse_size(10) == 10


# A child process that saves `model` (seed 1) over `path`, and hangs at a chosen point of the save so the
# test can kill -9 it there: "write" inside the second shard file, "rename" between the two renames.
_CHILD = textwrap.dedent("""
    import os, sys, time, torch
    import latentmoe_lab.checkpoint as ck
    from latentmoe_lab import ModelConfig, LatentMoEForCausalLM
    path, where = sys.argv[1], sys.argv[2]
    torch.manual_seed(1)
    model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny"))
    real_save, real_rename, calls = ck.save_file, os.rename, []
    def hang(note):
        print(note, flush=True)
        time.sleep(600)
    def save_file(tensors, file, metadata=None):
        calls.append(file)
        if where == "write" and len(calls) == 2:
            with open(file, "wb") as handle:
                handle.write(b"half a shard")
            hang("HANGING")
        real_save(tensors, file, metadata=metadata)
    def rename(src, dst):
        real_rename(src, dst)
        if where == "rename" and str(dst).endswith(".previous"):
            hang("HANGING")
    ck.save_file, os.rename = save_file, rename  # os.rename: the swap (checkpoint_dir) renames through it
    model.save_pretrained(path, max_shard_size="200KB")
""")


@pytest.mark.parametrize("where", ["write", "rename"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(trained_like, tmp_path, where):
    path = tmp_path / "ckpt"
    trained_like.save_pretrained(path, max_shard_size="200KB")
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), where], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        line = child.stdout.readline()
        assert line.strip() == "HANGING" and time.monotonic() < deadline
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    ids = _ids(trained_like.config)
    if where == "rename":
        assert not path.exists() and (tmp_path / "ckpt.previous").exists()
        with pytest.warns(UserWarning, match="interrupted"):
            loaded = LatentMoEForCausalLM.from_pretrained(path)
    else:
        assert any(entry.name.startswith(".ckpt.latentmoe-tmp-") for entry in tmp_path.iterdir())
        loaded = LatentMoEForCausalLM.from_pretrained(path)
    assert torch.equal(loaded(ids).logits, trained_like(ids).logits)
    trained_like.save_pretrained(path)  # the next save cleans up after the killed one
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["ckpt"]
