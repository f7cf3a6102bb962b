"""Distributed checkpoints (latentmoe_lab.native.checkpoint): save under FSDP2xEP2, reshard on load, no pickle.

One 4-process run starts from a save_pretrained checkpoint, takes a NativeTrainer step (so the weights
are no longer the starting ones), records the logits of a fixed batch and saves. That checkpoint then
loads into one plain process, into TP2 (2 processes, with the optimizer state), into PP2 stages and
through the safetensors export; every one must give the saving run's logits.
"""
import json
import pickle
import shutil
import struct

import pytest
import torch
from torch.distributed.tensor import DTensor

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.native.build import NativeModel
from latentmoe_lab.native.checkpoint import export_safetensors, load_sharded, save_sharded
from latentmoe_lab.native.layout import NativeLayout
from latentmoe_lab.parallel.launch import launch

TIMEOUT_S = 120.0
LR = 1e-2


def batches(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return tuple(torch.randint(0, config.vocab_size, (4, 12), generator=generator) for _ in range(2))


def _build(layout: NativeLayout, checkpoint=None):
    from latentmoe_lab.native.build import build_native
    from latentmoe_lab.native.layout import build_mesh
    from latentmoe_lab.parallel.mesh import init_distributed

    if not torch.distributed.is_initialized():
        init_distributed(TIMEOUT_S / 2)
    return build_native(ModelConfig.from_preset("tiny"), layout, build_mesh(layout), checkpoint=checkpoint)


def _gathered_optimizer_state(trainer) -> dict:
    """{param name: {"exp_avg", "exp_avg_sq", "step": full tensors}} (collective: full_tensor)."""
    names = {p: n for n, p in trainer.native.module.named_parameters()}
    out = {}
    for param, state in trainer.optimizer.state.items():
        out[names[param]] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in state.items()}
    return out


def save_worker(start: str, directory: str) -> dict:
    from latentmoe_lab.native.forward import native_logits
    from latentmoe_lab.native.train import NativeTrainer

    native = _build(NativeLayout(dp_shard=2, ep=2), checkpoint=start)
    train_batch, eval_batch = batches(native.module.config)
    trainer = NativeTrainer(native, lr=LR)
    save_sharded(native, directory, extra_json={"old.json": {}})  # replaced as a whole by the save below
    trainer.step(train_batch)
    logits = native_logits(native, eval_batch)
    save_sharded(native, directory, optimizer=trainer.optimizer, extra_json={"trainer.json": {"step": 1}})
    return {"logits": logits, "optimizer": _gathered_optimizer_state(trainer)}


def tp_load_worker(directory: str, truncated: str) -> dict:
    from latentmoe_lab.native.forward import native_logits
    from latentmoe_lab.native.train import NativeTrainer

    native = _build(NativeLayout(tp=2))  # seeded weights, then overwritten by the load
    trainer = NativeTrainer(native, lr=1.0)  # lr too: the checkpoint's hyperparameters replace it
    try:  # a broken file: every rank raises the same ValueError before any collective, nobody hangs
        load_sharded(native, truncated)
        broken = "no error"
    except ValueError as error:
        broken = str(error)
    extra = load_sharded(native, directory, optimizer=trainer.optimizer)
    _, eval_batch = batches(native.module.config)
    result = {"logits": native_logits(native, eval_batch), "extra": extra, "broken": broken,
              "lr": trainer.optimizer.param_groups[0]["lr"], "optimizer": _gathered_optimizer_state(trainer)}
    stages = _build(NativeLayout(pp=2))  # pipeline stages: each loads only its own layers' names
    load_sharded(stages, directory)
    return result | {"pp_logits": native_logits(stages, eval_batch)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint dir, a copy with one shard truncated, the saving run's rank-0 result)."""
    root = tmp_path_factory.mktemp("native_ckpt")
    torch.manual_seed(0)
    LatentMoEForCausalLM(ModelConfig.from_preset("tiny")).save_pretrained(root / "start")
    results = launch(save_worker, 4, args=(str(root / "start"), str(root / "sharded")), timeout_s=TIMEOUT_S)
    truncated = root / "truncated"
    shutil.copytree(root / "sharded", truncated)
    shard = sorted((truncated / "model").iterdir())[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    return root / "sharded", truncated, results[0]


@pytest.fixture(scope="module")
def tp_results(saved):
    directory, truncated, _ = saved
    return launch(tp_load_worker, 2, args=(str(directory), str(truncated)), timeout_s=TIMEOUT_S)


def _eval_logits(model: LatentMoEForCausalLM) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(batches(model.config)[1]).logits


def test_load_into_one_plain_process(saved):
    directory, _, reference = saved
    start = LatentMoEForCausalLM.from_pretrained(directory.parent / "start")
    assert (_eval_logits(start) - reference["logits"]).abs().max() > 1e-3  # the training step changed the model
    model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny"))
    extra = load_sharded(model, directory)
    error = float((_eval_logits(model) - reference["logits"]).abs().max())
    print(f"FSDP2xEP2 save -> 1 process load: max |logit diff| = {error:.3g}")
    assert error <= 1e-5
    assert extra == {"trainer.json": {"step": 1}}


def test_load_under_tp2_with_the_optimizer_and_under_pp2(saved, tp_results):
    _, _, reference = saved
    for result in tp_results:
        error = float((result["logits"] - reference["logits"]).abs().max())
        pp_error = float((result["pp_logits"] - reference["logits"]).abs().max())
        print(f"FSDP2xEP2 save -> TP2 load: max |logit diff| = {error:.3g}; -> PP2 load: {pp_error:.3g}")
        assert error <= 1e-5 and pp_error <= 1e-5
        assert result["extra"] == {"trainer.json": {"step": 1}}
        assert result["lr"] == LR
        assert result["optimizer"].keys() == reference["optimizer"].keys()
        for name, state in reference["optimizer"].items():
            assert float(result["optimizer"][name]["step"]) == float(state["step"]) == 1.0
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(result["optimizer"][name][key], state[key]), (name, key)
        assert any(float(s["exp_avg"].abs().max()) > 0 for s in reference["optimizer"].values())


def test_truncated_file_fails_clearly_on_every_rank(saved, tp_results):
    _, truncated, _ = saved
    for result in tp_results:
        assert "truncated" in result["broken"] and "shard-" in result["broken"], result["broken"]
    with pytest.raises(ValueError, match="truncated"):
        load_sharded(LatentMoEForCausalLM(ModelConfig.from_preset("tiny")), truncated)


def test_garbled_header_fails_clearly(saved, tmp_path):
    directory, _, _ = saved
    broken = tmp_path / "garbled"
    shutil.copytree(directory, broken)
    shard = sorted((broken / "model").iterdir())[0]
    data = bytearray(shard.read_bytes())
    data[8:24] = b"\x00garbage-bytes!\x00"  # inside the JSON header
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{shard.name}.*(safetensors|garbled)"):
        load_sharded(LatentMoEForCausalLM(ModelConfig.from_preset("tiny")), broken)
    (broken / "model" / shard.name).unlink()  # a missing shard file is named too
    with pytest.raises(ValueError, match=f"{shard.name}.*missing"):
        load_sharded(LatentMoEForCausalLM(ModelConfig.from_preset("tiny")), broken)
    shutil.copy(directory / "model" / shard.name, broken / "model" / shard.name)
    shutil.copy(directory / "model" / shard.name, broken / "model" / "stray.safetensors")  # would be read as a shard
    with pytest.raises(ValueError, match="stray.safetensors.*not written by the save"):
        load_sharded(LatentMoEForCausalLM(ModelConfig.from_preset("tiny")), broken)


def test_a_flipped_data_byte_is_refused_by_its_checksum(saved, tmp_path):
    directory, _, reference = saved
    damaged = tmp_path / "damaged"
    shutil.copytree(directory, damaged)
    shard = sorted((damaged / "model").iterdir())[0]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40  # inside a tensor: the header and the size still hold
    shard.write_bytes(bytes(data))
    model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny"))
    with pytest.raises(ValueError, match=f"{shard.name}: its SHA-256 differs"):
        load_sharded(model, damaged)
    shutil.copy(directory / "model" / shard.name, shard)
    manifest = json.loads((damaged / "checkpoint.json").read_text())
    del manifest["sha256"]  # as saved before checksums existed: loads on the other checks
    (damaged / "checkpoint.json").write_text(json.dumps(manifest))
    load_sharded(model, damaged)
    assert float((_eval_logits(model) - reference["logits"]).abs().max()) <= 1e-5


def test_export_safetensors_then_from_pretrained(saved, tmp_path):
    directory, _, reference = saved
    for limit in ("2GB", 200_000):  # one file, and several shards with an index
        out = export_safetensors(directory, tmp_path / f"export-{limit}", max_shard_size=limit)
        model = LatentMoEForCausalLM.from_pretrained(out)
        error = float((_eval_logits(model) - reference["logits"]).abs().max())
        print(f"export ({limit}) -> from_pretrained: max |logit diff| = {error:.3g}")
        assert error <= 1e-5
    assert len(list((tmp_path / "export-200000").glob("model-*.safetensors"))) > 1
    assert (tmp_path / "export-2GB" / "tokenizer.json").is_file()  # like save_pretrained (tokenizer_files.py)


def test_every_file_is_safetensors_or_json_by_its_bytes(saved):
    directory, _, _ = saved
    files = [p for p in directory.rglob("*") if p.is_file()]
    shards = [p for p in files if p.parent.name in ("model", "optimizer")]
    assert len([p for p in shards if p.parent.name == "model"]) == 4  # every rank wrote its own shard
    for path in files:
        data = path.read_bytes()
        assert not data.startswith(b"\x80") and not data.startswith(b"PK\x03\x04"), f"{path} looks like a pickle"
        if path in shards:
            (length,) = struct.unpack("<Q", data[:8])
            header = json.loads(data[8:8 + length])
            assert 8 + length + max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__") \
                == len(data)
        else:
            json.loads(data)  # raises unless the whole file is JSON
    assert {p.name for p in files if p not in shards} == {"config.json", "checkpoint.json", "optimizer.json",
                                                          "trainer.json"}
    # the first save's files are gone with it, and the atomic swap left nothing behind
    assert not list(directory.parent.glob(".sharded.tmp-*")) and not (directory.parent / "sharded.previous").exists()


@pytest.mark.parametrize("name, write", [
    (".metadata", lambda path: path.write_bytes(pickle.dumps({"state_dict_metadata": {}}))),
    ("extra.pt", lambda path: torch.save({"x": torch.zeros(1)}, path)),
    ("notes.json", lambda path: torch.save({"x": torch.zeros(1)}, path)),
])
def test_a_pickle_in_the_directory_is_refused(saved, tmp_path, name, write):
    directory, _, _ = saved
    polluted = tmp_path / "polluted"
    shutil.copytree(directory, polluted)
    write(polluted / "model" / name)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_sharded(LatentMoEForCausalLM(ModelConfig.from_preset("tiny")), polluted)


def test_bad_arguments_are_refused_before_any_collective(saved, tmp_path):
    directory, _, _ = saved
    model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny"))
    with pytest.raises(TypeError, match="native"):
        save_sharded(model, tmp_path / "x")
    native = NativeModel(model, NativeLayout(), mesh=None, stage_layers=[])
    with pytest.raises(ValueError, match="extra_json"):
        save_sharded(native, tmp_path / "x", extra_json={"config.json": {}})
    with pytest.raises(TypeError, match="extra_json: 'state.json' is not JSON"):
        save_sharded(native, tmp_path / "x", extra_json={"state.json": {"t": torch.zeros(1)}})
    with pytest.raises(ValueError, match="not a sharded checkpoint"):
        save_sharded(native, directory.parent / "start")  # a save_pretrained directory is not replaced
    with pytest.raises(ValueError, match="checkpoint.json"):
        load_sharded(model, directory.parent / "start")
    wider = ModelConfig.from_preset("tiny")
    wider.vocab_size *= 2
    with pytest.raises(ValueError, match=r"embed_tokens.weight: checkpoint \[512, 64\] vs module \[1024, 64\]"):
        load_sharded(LatentMoEForCausalLM(wider), directory)


def test_optimizer_state_loads_into_a_plain_process(saved):
    directory, _, reference = saved
    model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny"))
    params = list(model.parameters())  # the param groups of NativeTrainer, which hyperparameters follow by position
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                                   {"params": [p for p in params if p.dim() < 2]}], lr=1.0, foreach=False)
    load_sharded(model, directory, optimizer=optimizer)
    names = {p: n for n, p in model.named_parameters()}
    assert optimizer.param_groups[0]["lr"] == LR
    assert {names[p] for p in optimizer.state} == set(reference["optimizer"])
    for param, state in optimizer.state.items():
        assert torch.equal(state["exp_avg_sq"], reference["optimizer"][names[param]]["exp_avg_sq"])
