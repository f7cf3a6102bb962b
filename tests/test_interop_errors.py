"""What a transformers checkpoint load or export refuses, each in one line naming it, with nothing half-loaded or
half-written; and loading never holds two copies of the weights (peak RSS in a subprocess). docs/design.md §17."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from interop_cases import save_kimi
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.interop import kimi_linear
from latentmoe_lab.interop.detect import supported_types
from latentmoe_lab.interop.export import check_round_trip, export_transformers
from latentmoe_lab.interop.names import Unexpressible
from latentmoe_lab.model import LatentMoEForCausalLM

pytest.importorskip("transformers")
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("kimi")
    save_kimi("kda-mla-kda", directory)
    return directory


def edited_copy(saved: Path, tmp_path: Path, edit_tensors=None, edit_config=None) -> Path:
    """A copy of the saved checkpoint with its tensors dict and / or config dict edited in place."""
    out = tmp_path / "edited"
    out.mkdir()
    tensors = load_file(str(saved / WEIGHTS))
    config = json.loads((saved / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, str(out / WEIGHTS))
    (out / "config.json").write_text(json.dumps(config))
    return out


def load_error(path: Path) -> str:
    with pytest.raises(ValueError) as caught:
        LatentMoEForCausalLM.from_pretrained(path)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_missing_tensor_is_named(saved, tmp_path):
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    message = load_error(edited_copy(saved, tmp_path, lambda t: t.pop(name)))
    assert f"missing tensor {name!r}" in message


def test_an_extra_tensor_is_named(saved, tmp_path):
    name = "model.layers.0.self_attn.extra_proj.weight"
    message = load_error(edited_copy(saved, tmp_path, lambda t: t.update({name: torch.zeros(2, 2)})))
    assert f"unexpected tensor {name!r}" in message


def test_a_shape_mismatch_is_named(saved, tmp_path):
    name = "model.layers.2.block_sparse_moe.experts.3.w2.weight"
    message = load_error(edited_copy(saved, tmp_path, lambda t: t.update({name: torch.zeros(32, 17)})))
    assert f"shape mismatch: {name} has shape [32, 17], the config gives [32, 16]" in message


def test_an_unknown_model_type_names_the_supported_ones(saved, tmp_path):
    message = load_error(edited_copy(saved, tmp_path, edit_config=lambda c: c.update(model_type="llama")))
    assert message == f"model_type: 'llama' is not supported; supported: {supported_types()}"
    assert {"deepseek_v32", "kimi_linear"} <= set(supported_types().split(", "))


@pytest.mark.parametrize("key, value", [("hidden_act", "gelu"), ("moe_router_activation_func", "softmax"),
                                        ("attention_bias", True)])
def test_a_setting_our_layers_cannot_run_is_named(saved, tmp_path, key, value):
    message = load_error(edited_copy(saved, tmp_path, edit_config=lambda c: c.update({key: value})))
    assert message.startswith(f"{key}: {value!r} is not supported")


def test_a_mlp_pattern_other_than_a_dense_prefix_is_named(saved, tmp_path):
    message = load_error(edited_copy(saved, tmp_path,
                                     edit_config=lambda c: c.update(mlp_layer_types=["sparse", "dense", "sparse"])))
    assert message.startswith("mlp_layer_types: dense layers must come first")


@pytest.mark.parametrize("change, feature", [
    (dict(), "the vision tower"),  # the tiny preset as it is: vision first
    (dict(vision=None), "latent experts (moe.latent_projection=True)"),
    (dict(vision=None, moe=dict(latent_projection=False, latent_size=64)), "the gated DSA output gate"),
    (dict(vision=None, mtp_depth=1), "the MTP head"),
])
def test_export_refuses_what_kimi_linear_cannot_say_before_writing(tmp_path, change, feature):
    config = ModelConfig.from_preset("tiny")
    data = config.to_dict()
    for key, value in change.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    model = LatentMoEForCausalLM(ModelConfig.from_dict(data))
    with pytest.raises(Unexpressible) as caught:
        export_transformers(model, tmp_path / "out", "kimi_linear")
    assert str(caught.value).startswith(f"kimi_linear cannot express {feature}")
    assert not (tmp_path / "out").exists()


def test_the_round_trip_check_names_a_field_the_format_drops(saved):
    config = LatentMoEForCausalLM.from_pretrained(saved).config
    check_round_trip(config, kimi_linear.config_from_hf(kimi_linear.config_to_hf(config)), "kimi_linear")
    unused = config.replace(name="renamed", kda={**config.to_dict()["kda"], "gate_lower_bound": -3.0})
    check_round_trip(unused, config, "kimi_linear")  # a name, and a bound the softplus gate never reads: fine
    dropped = config.replace(kda={**config.to_dict()["kda"], "conv_kernel": 3})
    with pytest.raises(Unexpressible, match=r"^kimi_linear cannot express kda.conv_kernel=3 \(it reads back as 4\)$"):
        check_round_trip(dropped, config, "kimi_linear")


MEASURE = textwrap.dedent("""
    import sys
    from latentmoe_lab.model import LatentMoEForCausalLM
    def status(key):  # kB -> bytes; VmHWM is this process's own peak (ru_maxrss would carry the parent's over exec)
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))
    LatentMoEForCausalLM.from_pretrained(sys.argv[2])  # warm-up: every lazy import done
    before = status("VmRSS:")
    model = LatentMoEForCausalLM.from_pretrained(sys.argv[1])
    print(before, status("VmHWM:"), sum(p.numel() * p.element_size() for p in model.parameters()))
""")


def test_loading_does_not_double_peak_memory(saved, tmp_path):
    hf = json.loads((saved / "config.json").read_text())
    hf.update(vocab_size=16_000, hidden_size=384, intermediate_size=256, moe_intermediate_size=128,
              num_local_experts=16)
    torch.manual_seed(0)
    big = LatentMoEForCausalLM(kimi_linear.config_from_hf(hf))
    export_transformers(big, tmp_path / "big", "kimi_linear")
    model_bytes = sum(p.numel() * p.element_size() for p in big.parameters())
    del big
    result = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "big"), str(saved)],
                            capture_output=True, text=True, timeout=300, check=True)
    before, peak, loaded = (int(v) for v in result.stdout.split())
    assert loaded == model_bytes > 55e6
    assert peak - before <= 1.3 * model_bytes + 16e6, (peak - before) / model_bytes
