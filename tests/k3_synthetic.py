"""Small synthetic checkpoints in the published K3 format, written without the package's K3 code.

The names come from tests/data/k3_public_tensors.json (the published layout: layer 0 gives a dense KDA layer,
layer 11 an MLA MoE layer, layer 1 one routed expert) with the layer and expert numbers replaced; each shape is
derived from the shrunk config.json below by the published rule for that tensor; the dtypes are the published
ones. A_log holds num_heads live values then zeros up to the next power of two (the release: 96 of 128).
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

DATA = Path(__file__).parent / "data"
DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}


def public_tensors() -> dict:
    return json.loads((DATA / "k3_public_tensors.json").read_text())


def public_config() -> dict:
    return json.loads((DATA / "k3_public_config.json").read_text())


def shrunk_config(attn_res: bool = True) -> dict:
    """The published config.json with every size shrunk; 5 layers: KDA 1-3, MLA 4-5 (1-based), layer 1 dense."""
    hf = public_config()
    text = hf["text_config"]
    text.update(hidden_size=64, intermediate_size=96, num_hidden_layers=5, vocab_size=128, num_attention_heads=2,
                num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, num_experts=4, num_experts_per_token=2, moe_intermediate_size=32,
                routed_expert_hidden_size=32, num_shared_experts=1, max_position_embeddings=4096,
                attn_res_block_size=2 if attn_res else None)
    text["linear_attn_config"].update(kda_layers=[1, 2, 3], full_attn_layers=[4, 5], num_heads=3, head_dim=16)
    return hf


def _template(names: dict, layer: int) -> dict:
    return {re.sub(r"\.layers\.\d+\.", f".layers.{layer}.", name): value for name, value in names.items()}


def layer_names(text: dict, layer: int) -> dict[str, str]:
    """{name: published dtype} of 0-based layer `layer`, from the published layer 0 / layer 11 / expert lists."""
    pub = public_tensors()
    kda_dense = _template(pub["layer_0_kda_dense"], layer)
    mla_moe = _template(pub["layer_11_mla_moe_without_routed_experts"], layer)
    is_kda = layer + 1 in text["linear_attn_config"]["kda_layers"]
    attention = {n: v for n, v in (kda_dense if is_kda else mla_moe).items() if ".self_attn." in n}
    common = {n: v for n, v in kda_dense.items() if ".self_attn." not in n and ".mlp." not in n}
    names = {**common, **attention}
    if layer < text["first_k_dense_replace"]:
        names.update({n: v for n, v in kda_dense.items() if ".mlp." in n})
    else:
        names.update({n: v for n, v in mla_moe.items() if ".block_sparse_moe." in n})
        expert = _template(pub["layer_1_expert_0"], layer)
        for e in range(text["num_experts"]):
            names.update({n.replace(".experts.0.", f".experts.{e}."): v for n, v in expert.items()})
    return {n: v[1] for n, v in names.items()}


def shape_of(name: str, text: dict) -> tuple[int, ...]:
    """The published shape rule of each tensor, with this config's sizes."""
    d, lin = text["hidden_size"], text["linear_attn_config"]
    kda = lin["num_heads"] * lin["head_dim"]
    mla_out = text["num_attention_heads"] * text["v_head_dim"]
    latent, inter = text["routed_expert_hidden_size"], text["moe_intermediate_size"]
    shared = text["num_shared_experts"] * inter
    layer = re.search(r"\.layers\.(\d+)\.", name)
    is_kda = layer is not None and int(layer.group(1)) + 1 in lin["kda_layers"]
    leaf = name.split(".layers.")[-1].split(".", 1)[-1]
    rules = {
        "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,), "mlp_res_norm.weight": (d,),
        "self_attention_res_norm.weight": (d,), "mlp_res_proj.weight": (1, d), "self_attention_res_proj.weight": (1, d),
        "mlp.gate_proj.weight": (text["intermediate_size"], d), "mlp.up_proj.weight": (text["intermediate_size"], d),
        "mlp.down_proj.weight": (d, text["intermediate_size"]),
        "self_attn.A_log": (1 << (lin["num_heads"] - 1).bit_length(),), "self_attn.dt_bias": (kda,),
        "self_attn.b_proj.weight": (lin["num_heads"], d), "self_attn.f_a_proj.weight": (lin["head_dim"], d),
        "self_attn.f_b_proj.weight": (kda, lin["head_dim"]), "self_attn.o_norm.weight": (lin["head_dim"],),
        "self_attn.g_proj.weight": (kda if is_kda else mla_out, d),
        "self_attn.o_proj.weight": (d, kda if is_kda else mla_out),
        "self_attn.q_a_proj.weight": (text["q_lora_rank"], d),
        "self_attn.q_a_layernorm.weight": (text["q_lora_rank"],),
        "self_attn.q_b_proj.weight": (text["num_attention_heads"] * (text["qk_nope_head_dim"]
                                                                     + text["qk_rope_head_dim"]), text["q_lora_rank"]),
        "self_attn.kv_a_proj_with_mqa.weight": (text["kv_lora_rank"] + text["qk_rope_head_dim"], d),
        "self_attn.kv_a_layernorm.weight": (text["kv_lora_rank"],),
        "self_attn.kv_b_proj.weight": (text["num_attention_heads"] * (text["qk_nope_head_dim"] + text["v_head_dim"]),
                                       text["kv_lora_rank"]),
        "block_sparse_moe.gate.weight": (text["num_experts"], d),
        "block_sparse_moe.gate.e_score_correction_bias": (text["num_experts"],),
        "block_sparse_moe.routed_expert_down_proj.weight": (latent, d),
        "block_sparse_moe.routed_expert_up_proj.weight": (d, latent),
        "block_sparse_moe.routed_expert_norm.weight": (latent,),
        "block_sparse_moe.shared_experts.gate_proj.weight": (shared, d),
        "block_sparse_moe.shared_experts.up_proj.weight": (shared, d),
        "block_sparse_moe.shared_experts.down_proj.weight": (d, shared),
    }
    for proj in "qkv":
        rules[f"self_attn.{proj}_proj.weight"] = (kda, d)
        rules[f"self_attn.{proj}_conv1d.weight"] = (kda, 1, lin["short_conv_kernel_size"])
    expert = re.search(r"experts\.\d+\.(w[123])\.weight_(packed|scale)$", name)
    if expert:
        out, inp = (latent, inter) if expert.group(1) == "w2" else (inter, latent)
        return (out, inp // 2) if expert.group(2) == "packed" else (out, inp // 32)
    top = {"embed_tokens.weight": (text["vocab_size"], d), "lm_head.weight": (text["vocab_size"], d),
           "norm.weight": (d,), "output_attn_res_norm.weight": (d,), "output_attn_res_proj.weight": (1, d)}
    return top[name.rsplit("model.", 1)[-1].replace("language_model.", "")] if ".layers." not in name else rules[leaf]


def write_synthetic(directory: Path, hf: dict, seed: int = 0, a_log_padding: float = 0.0,
                    extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Write a K3 directory (config.json, shards by layer like the release, index) with random values; returns
    {name: tensor} as written. a_log_padding: the value put past num_heads in every A_log (0 = well formed)."""
    gen = torch.Generator().manual_seed(seed)
    text = hf["text_config"]
    attn_res = text.get("attn_res_block_size") is not None
    heads = text["linear_attn_config"]["num_heads"]
    top = {n: v[1] for n, v in public_tensors()["top"].items() if attn_res or "attn_res" not in n}
    shards = [{} for _ in range(text["num_hidden_layers"] + 1)]
    for layer in range(text["num_hidden_layers"]):
        names = layer_names(text, layer)
        shards[layer] = {n: dt for n, dt in names.items() if attn_res or "_res_" not in n}
    shards[-1] = top
    written = {}
    for shard in shards:
        for name, dtype in list(shard.items()):
            shape = shape_of(name, text)
            if DTYPES[dtype] == torch.uint8:
                low, high = (0, 256) if name.endswith("packed") else (118, 130)
                value = torch.randint(low, high, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
            else:
                value = (torch.randn(shape, generator=gen) * 0.1).to(DTYPES[dtype])
            if name.endswith("A_log"):
                value = torch.full(shape, a_log_padding, dtype=torch.float32)
                value[:heads] = torch.empty(heads).uniform_(1, 16, generator=gen).log()
            shard[name] = value
            written[name] = value
    shards[-1].update(extra or {})
    written.update(extra or {})
    directory.mkdir(parents=True, exist_ok=True)
    files = [f"model-{i + 1:05d}-of-{len(shards):06d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards):
        save_file(shard, str(directory / file))
        weight_map.update(dict.fromkeys(shard, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(hf))
    return written


def with_text(hf: dict, **changes) -> dict:
    out = copy.deepcopy(hf)
    out["text_config"].update(changes)
    return out
