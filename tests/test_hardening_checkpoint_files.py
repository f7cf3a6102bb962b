"""Checkpoint files from the outside reliability review: no writer loses a user's files (D1, D2), no damaged
checkpoint loads silently or hangs (D3, D7), every damaged file is a one-line error naming it (D9, D12)."""
import json
import os
import signal
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from latentmoe_lab import cli
from latentmoe_lab.checkpoint import save_checkpoint
from latentmoe_lab.checkpoint_dir import MARKER_NAME
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.native.build import NativeModel
from latentmoe_lab.native.checkpoint import export_safetensors, save_sharded
from latentmoe_lab.native.layout import NativeLayout
from latentmoe_lab.quant import quantize_model
from latentmoe_lab.quant.checkpoint import load_quantized, save_quantized

IDS = torch.arange(12).reshape(1, 12) * 7 % 512


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every entry under root: file -> its bytes, directory -> None."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


@pytest.fixture
def scratch(tmp_path, tiny_config, monkeypatch):
    """tmp_path/outer/scratch full of user files (and a checkpoint, ckpt), the working directory."""
    outer = tmp_path / "outer"
    scratch = outer / "scratch"
    (scratch / "project").mkdir(parents=True)
    (outer / "parent_file.txt").write_text("the parent's file")
    for k in range(1, 6):
        (scratch / f"notes_{k}.txt").write_text(f"note {k}\n" * k)
    (scratch / "project" / "main.py").write_text("print('hello')\n")
    (scratch / "project" / "config.json").write_text('{"user": true}')
    torch.manual_seed(0)
    LatentMoEForCausalLM(tiny_config).save_pretrained(scratch / "ckpt")
    monkeypatch.chdir(scratch)
    return scratch


FORBIDDEN = ["", ".", "./", "..", "project/..", "ckpt/..", "/", "project", "notes_1.txt", "{cwd}", "{parent}"]


def test_save_pretrained_refuses_every_path_that_would_touch_user_files(scratch, tiny_config):
    model = LatentMoEForCausalLM(tiny_config)
    before = snapshot(scratch.parent.parent)
    for _ in range(2):  # the review's second run deleted what the first had moved
        for target in FORBIDDEN:
            target = target.format(cwd=scratch, parent=scratch.parent)
            with pytest.raises(ValueError, match=r"^path: ") as error:
                model.save_pretrained(target)
            assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"^path: '\.' names no directory"):
        save_quantized(quantize_model(model, "fp8-experts", progress=False), ".")
    assert snapshot(scratch.parent.parent) == before


def test_quantize_cli_refuses_out_before_loading_anything(scratch, capsys, monkeypatch, tiny_config):
    import latentmoe_lab.training.corpus as corpus

    monkeypatch.setattr(corpus, "load_corpus", lambda *a, **k: pytest.fail("the corpus was loaded"))
    save_quantized(quantize_model(LatentMoEForCausalLM(tiny_config), "fp8-experts", progress=False), "q")
    before = snapshot(scratch.parent.parent)
    for out in FORBIDDEN + ["ckpt", str(scratch / "ckpt")]:  # the last two: --out is the source (D2)
        out = out.format(cwd=scratch, parent=scratch.parent)
        assert cli.main(["quantize", "--checkpoint", "ckpt", "--recipe", "fp8-experts", "--out", out]) == 2
        message = capsys.readouterr().err
        assert message.count("\n") == 1 and "--out" in message, message
    assert cli.main(["quantize", "--checkpoint", "missing", "--recipe", "fp8-experts", "--out", "new"]) == 2
    assert "--checkpoint: no checkpoint directory at missing" in capsys.readouterr().err
    assert cli.main(["quantize", "--checkpoint", "q", "--recipe", "fp8-experts", "--out", "new"]) == 2
    assert "--checkpoint: q is already quantized" in capsys.readouterr().err
    (scratch / "ckpt" / "model.safetensors").write_bytes(b"\x80\x04 not a safetensors file")
    assert cli.main(["quantize", "--checkpoint", "ckpt", "--recipe", "fp8-experts", "--out", "new"]) == 2
    assert "ckpt/model.safetensors: not a safetensors file" in capsys.readouterr().err
    before["outer/scratch/ckpt/model.safetensors"] = (scratch / "ckpt" / "model.safetensors").read_bytes()
    assert snapshot(scratch.parent.parent) == before  # nothing moved, nothing leaked (no temporary either)


def test_train_cli_refuses_out_before_loading_anything(scratch, capsys):
    before = snapshot(scratch.parent.parent)
    for out in FORBIDDEN:
        out = out.format(cwd=scratch, parent=scratch.parent)
        assert cli.main(["train", "--preset", "tiny", "--steps", "1", "--out", out]) == 2
        message = capsys.readouterr().err
        assert message.count("\n") == 1 and "--out" in message, message
    assert cli.main(["train", "--preset", "tiny", "--fsdp", "2", "--init-from", "ckpt", "--out", "ckpt/.."]) == 2
    assert snapshot(scratch.parent.parent) == before


def test_distributed_writers_use_the_same_rule(scratch, tiny_config):
    native = NativeModel(LatentMoEForCausalLM(tiny_config), NativeLayout(), mesh=None, stage_layers=[])
    before = snapshot(scratch.parent.parent)
    for target in (".", "..", "project", str(scratch)):
        with pytest.raises(ValueError, match="^directory: "):
            save_sharded(native, target)  # refused before any collective
        with pytest.raises(ValueError, match="^out_dir: "):
            export_safetensors("ckpt", target)
    with pytest.raises(ValueError, match="^out_dir: .*is or contains the source"):
        export_safetensors("ckpt", "ckpt")
    assert snapshot(scratch.parent.parent) == before


def _finished_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_temporaries_are_ours_by_marker_and_user_directories_survive(tmp_path, tiny_config):
    model = LatentMoEForCausalLM(tiny_config)
    path = model.save_pretrained(tmp_path / "c")
    (path / "README.md").write_text("mine")  # carried over by the next save
    dead_pid, other_dead_pid = _finished_pid(), _finished_pid()
    user_dir = tmp_path / f".c.latentmoe-tmp-{dead_pid}"  # the right name but no marker: not provably ours
    user_dir.mkdir()
    (user_dir / "keep.txt").write_text("keep")
    old_style = tmp_path / ".c.tmp-1"  # the name the review's cleanup matched
    old_style.mkdir()
    (old_style / "keep.txt").write_text("keep")
    ours = tmp_path / f".c.latentmoe-tmp-{other_dead_pid}"
    ours.mkdir()
    (ours / MARKER_NAME).write_text(json.dumps({"format": "latentmoe-save-temporary-v1", "pid": other_dead_pid}))
    model.save_pretrained(path)
    assert not ours.exists() and (user_dir / "keep.txt").exists() and (old_style / "keep.txt").exists()
    assert (path / "README.md").read_text() == "mine" and not (path / MARKER_NAME).exists()
    with pytest.raises(TypeError):  # a save that fails part way removes its temporary
        save_checkpoint(model, path, extra_json={"note.json": object()})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["c", user_dir.name, old_style.name])
    foreign_previous = tmp_path / "c.previous"
    foreign_previous.mkdir()
    (foreign_previous / "thesis.tex").write_text("years of work")
    with pytest.raises(ValueError, match="c.previous exists and is not a checkpoint"):
        model.save_pretrained(path)
    assert (foreign_previous / "thesis.tex").read_text() == "years of work"


# ---------------------------------------------------------------------------------------------- loading
def read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def write_header(path: Path, header: dict, data: bytes) -> None:
    """Keeps the file's header length (padded with spaces, as safetensors pads), so only the edit differs."""
    length = struct.unpack("<Q", path.read_bytes()[:8])[0]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.fixture
def saved(tmp_path, tiny_config):
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(tiny_config).eval()
    return model.save_pretrained(tmp_path / "c"), model(IDS).logits


def load_error(path, **kwargs) -> str:
    """The one-line ValueError from_pretrained raises (within 20 s: a hang fails the test)."""
    signal.alarm(20)
    try:
        with pytest.raises(ValueError) as error:
            LatentMoEForCausalLM.from_pretrained(path, **kwargs)
    finally:
        signal.alarm(0)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_dtype_flip_swapped_offsets_and_flipped_bytes_are_refused(saved):
    path, _ = saved
    weights = path / "model.safetensors"
    header, data = read_header(weights)
    name = "layers.1.attn.o_proj.weight"
    header[name]["dtype"] = "I32"  # same width: only the dtype check sees it
    write_header(weights, header, data)
    assert f"dtype mismatches [{name}: checkpoint I32 in model.safetensors vs model float32]" in load_error(
        path, verify_checksums=False)
    header[name]["dtype"] = "F32"
    same_shape = [k for k, v in header.items() if k != name and v.get("shape") == header[name]["shape"]][0]
    header[name]["data_offsets"], header[same_shape]["data_offsets"] = (header[same_shape]["data_offsets"],
                                                                        header[name]["data_offsets"])
    write_header(weights, header, data)
    assert "starts at data byte" in load_error(path, verify_checksums=False)
    header[name]["data_offsets"], header[same_shape]["data_offsets"] = (header[same_shape]["data_offsets"],
                                                                        header[name]["data_offsets"])
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x40  # one exponent bit of one weight
    write_header(weights, header, bytes(flipped))
    assert "model.safetensors: its SHA-256 differs" in load_error(path)
    LatentMoEForCausalLM.from_pretrained(path, verify_checksums=False)  # the documented way to skip it


def test_a_checkpoint_without_checksums_still_loads_with_a_warning(saved):
    path, logits = saved
    (path / "checksums.json").unlink()
    with pytest.warns(UserWarning, match="no checksums.json, so its files are not checked"):
        loaded = LatentMoEForCausalLM.from_pretrained(path)
    assert torch.equal(loaded(IDS).logits, logits)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # verify_checksums=False asked for no check: nothing to warn about
        LatentMoEForCausalLM.from_pretrained(path, verify_checksums=False)


def test_stale_single_file_beside_shards_is_refused(saved, tmp_path, tiny_config):
    path, _ = saved
    sharded = LatentMoEForCausalLM(tiny_config).save_pretrained(tmp_path / "s", max_shard_size="300KB")
    (sharded / "model.safetensors.index.json").unlink()
    os.replace(path / "model.safetensors", sharded / "model.safetensors")
    assert "model.safetensors: beside shard files" in load_error(sharded)


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev-zero", "fifo-index", "index-json"])
def test_non_regular_files_and_bad_index_are_refused_at_once(saved, tmp_path, tiny_config, kind):
    path, _ = saved
    if kind.endswith("index") or kind == "index-json":
        path = LatentMoEForCausalLM(tiny_config).save_pretrained(tmp_path / "s", max_shard_size="300KB")
    target = path / ("model.safetensors.index.json" if "index" in kind else "model.safetensors")
    target.unlink()
    {"fifo": os.mkfifo, "fifo-index": os.mkfifo, "directory": os.mkdir,
     "dev-zero": lambda p: os.symlink("/dev/zero", p), "index-json": lambda p: p.write_text("{'weight_map':")}[kind](
        target)
    message = load_error(path)
    assert str(target) in message
    assert ("not valid JSON" if kind == "index-json" else "not a regular file") in message


@pytest.mark.parametrize("damage", ["truncated", "appended", "length-0", "length-2^62", "pickle", "header-garbage"])
def test_damaged_safetensors_are_one_line_errors_naming_the_file(saved, damage):
    path, _ = saved
    weights = path / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes({
        "truncated": raw[:-1000], "appended": raw + b"\0" * 64, "length-0": struct.pack("<Q", 0) + raw[8:],
        "length-2^62": struct.pack("<Q", 2**62) + raw[8:], "header-garbage": raw[:8] + b"\xff" * 40 + raw[48:],
        "pickle": b"\x80\x04\x95" + raw[3:200]}[damage])
    assert f"checkpoint file {weights}:" in load_error(path, verify_checksums=False)


@pytest.mark.parametrize("field,value", [("weights", ["fp8"]), ("weights", None), ("percentile", "99"),
                                         ("smooth_alpha", "x")])
def test_tampered_quantization_config_names_the_field(tmp_path, tiny_config, field, value):
    model = quantize_model(LatentMoEForCausalLM(tiny_config), "int8-w8a8-smooth", batches=[IDS], progress=False)
    path = save_quantized(model, tmp_path / "q")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"][field] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"config.json: quantization_config.{field}: ") as error:
        load_quantized(path)
    assert "\n" not in str(error.value)
