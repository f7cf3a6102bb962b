"""The published Kimi K3 checkpoint (model_type "kimi_k3"): its config.json both ways and its tensor names.

The K3 release (moonshotai/Kimi-K3, docs/design.md §18) is a transformers-style directory: config.json holds the
text model under "text_config" (model_type "kimi_linear" with K3's extra fields), the weights are 96 safetensors
shards named language_model.model.layers.N..., language_model.lm_head, and vision_tower.* / mm_projector.*
(a MoonViT tower this package does not model: the reader skips those, see k3_checkpoint.py).

Config facts read here (every one from the published config.json):
    linear_attn_config.kda_layers / full_attn_layers   1-based lists that partition 1..num_hidden_layers
    linear_attn_config.num_heads / head_dim             KDA heads and d_k = d_v; the forget gate's rank is head_dim
    use_full_rank_gate true                             full-rank KDA output gate g_proj [H*d, hidden]
    hidden_act "situ" + activation_situ_beta / _linear_beta   SiTU experts (4.0 / 25.0)
    attn_res_block_size                                 Block AttnRes (12)
    routed_expert_hidden_size, latent_moe_use_norm      the LatentMoE latent width and its RMSNorm
    mla_use_nope / mla_use_output_gate                  NoPE MLA with a sigmoid output gate; no DSA indexer
Storage rules (A_log padding, MXFP4 experts, the dtype of each tensor) live in k3_storage.py.
"""
from __future__ import annotations

import functools
from typing import Any

from latentmoe_lab.config import DSA, KDA, ModelConfig
from latentmoe_lab.config_fields import describe
from latentmoe_lab.interop.detect import hf_value
from latentmoe_lab.interop.names import TensorMapping, Unexpressible, mapping

MODEL_TYPE = "kimi_k3"
TEXT_MODEL_TYPE = "kimi_linear"
ARCHITECTURE = "KimiK3ForConditionalGeneration"
PREFIX = "language_model.model."
HEAD = "language_model.lm_head.weight"
ACTIVATIONS = {"situ": "situ", "silu": "swiglu"}  # hidden_act -> moe.activation
# q_a_layernorm / kv_a_layernorm eps: the K3 repo ships kimi_linear's modeling code, whose MLA builds these
# norms at its default 1e-6 whatever rms_norm_eps is (an assumption for K3, see docs/design.md §18).
LATENT_NORM_EPS = 1e-6


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(hf, dict):
        raise TypeError(f"hf: expected the parsed config.json (a dict), got {type(hf).__name__}")
    if hf.get("model_type") != MODEL_TYPE:
        raise ValueError(f"model_type: expected {MODEL_TYPE!r}, got {describe(hf.get('model_type'))}")
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"text_config: a {MODEL_TYPE} config.json holds the text model there, got {describe(text)}")
    if text.get("model_type", TEXT_MODEL_TYPE) != TEXT_MODEL_TYPE:
        raise ValueError(f"text_config.model_type: expected {TEXT_MODEL_TYPE!r}, got {describe(text['model_type'])}")
    return text


def _require(ok: bool, key: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"{key}: {rule}")


def layer_types_from_lists(kda_layers: Any, full_attn_layers: Any, num_layers: int) -> list[str]:
    """1-based kda_layers / full_attn_layers -> our 0-based layer_types; they must partition 1..num_layers."""
    for key, layers in (("linear_attn_config.kda_layers", kda_layers),
                        ("linear_attn_config.full_attn_layers", full_attn_layers)):
        _require(isinstance(layers, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in layers),
                 key, f"must be a list of 1-based layer numbers, got {describe(layers)}")
        _require(all(1 <= i <= num_layers for i in layers), key,
                 f"holds a layer outside 1..{num_layers} (the lists are 1-based), got {describe(layers)}")
    both = set(kda_layers) & set(full_attn_layers)
    _require(not both, "linear_attn_config.full_attn_layers", f"layers {sorted(both)} are also in kda_layers")
    missing = set(range(1, num_layers + 1)) - set(kda_layers) - set(full_attn_layers)
    _require(not missing, "linear_attn_config.kda_layers", f"layers {sorted(missing)} are in neither list")
    _require(len(set(kda_layers)) == len(kda_layers) and len(set(full_attn_layers)) == len(full_attn_layers),
             "linear_attn_config.kda_layers", "a layer is listed twice")
    dsa = set(full_attn_layers)
    return [DSA if i + 1 in dsa else KDA for i in range(num_layers)]


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A K3 config.json (top level, model_type "kimi_k3") -> ModelConfig. What our layers cannot run is refused
    with a ValueError naming the key. bias_update is not in the file: it is set to K3's quantile rule (report
    Eq. 14); the vision tower (MoonViT) is not modelled: vision=None."""
    text = _text_config(hf)
    value = functools.partial(hf_value, text)
    linear = value("linear_attn_config")
    _require(isinstance(linear, dict), "linear_attn_config", f"must be an object, got {describe(linear)}")
    num_layers = value("num_hidden_layers")
    _require(isinstance(num_layers, int) and num_layers >= 1, "num_hidden_layers",
             f"must be a positive integer, got {describe(num_layers)}")
    layer_types = layer_types_from_lists(hf_value(linear, "kda_layers"), hf_value(linear, "full_attn_layers"),
                                         num_layers)
    _require(value("moe_layer_freq", default=1) == 1, "moe_layer_freq",
             "must be 1: every layer from first_k_dense_replace on is MoE (the only pattern our model has)")
    _require(value("num_nextn_predict_layers", default=0) == 0, "num_nextn_predict_layers",
             "must be 0: the K3 release ships no MTP weights, and our MTP head has no K3 names")
    _require(value("mla_use_nope", default=True) is True, "mla_use_nope",
             "must be true: K3's MLA layers are NoPE (the rope part is carried but never rotated)")
    _require(hf_value(linear, "use_full_rank_gate", default=True) is True, "linear_attn_config.use_full_rank_gate",
             "must be true: the K3 format names one full-rank KDA output gate (g_proj)")
    heads = value("num_attention_heads")
    _require(value("num_key_value_heads", default=heads) == heads, "num_key_value_heads",
             f"must equal num_attention_heads ({heads}): MLA has one key/value head per query head")
    _require(value("latent_moe_use_norm", default=True) is True, "latent_moe_use_norm",
             "must be true: our LatentMoE always normalises the latent expert sum")
    _require(value("moe_router_activation_func", default="sigmoid") == "sigmoid", "moe_router_activation_func",
             "must be 'sigmoid' (our router)")
    _require(value("topk_method", default="noaux_tc") == "noaux_tc", "topk_method",
             "must be 'noaux_tc' (sigmoid scores + correction bias for selection)")
    act = value("hidden_act", default="silu")
    _require(act in ACTIVATIONS, "hidden_act", f"must be one of {sorted(ACTIVATIONS)}, got {describe(act)}")
    grouped = value("use_grouped_topk", default=False)
    head_dim = hf_value(linear, "head_dim")
    moe = dict(num_experts=value("num_experts", "n_routed_experts"),
               top_k=value("num_experts_per_token", "num_experts_per_tok"),
               num_shared_experts=value("num_shared_experts", "n_shared_experts", default=0),
               expert_intermediate_size=value("moe_intermediate_size"),
               latent_size=value("routed_expert_hidden_size"),
               n_group=value("num_expert_group", "n_group", default=1) if grouped else 1,
               topk_group=value("topk_group", default=1) if grouped else 1,
               routed_scaling_factor=value("routed_scaling_factor", default=1.0),
               norm_topk_prob=value("moe_renormalize", "norm_topk_prob", default=True),
               activation=ACTIVATIONS[act], bias_update="quantile")
    if act == "situ":
        moe.update(situ_beta_gate=value("activation_situ_beta"), situ_beta_up=value("activation_situ_linear_beta"))
    return ModelConfig(
        name=MODEL_TYPE, vocab_size=value("vocab_size"), hidden_size=value("hidden_size"), num_layers=num_layers,
        max_position_embeddings=value("max_position_embeddings", "model_max_length"),
        first_dense_layers=value("first_k_dense_replace", default=0),
        dense_intermediate_size=value("intermediate_size"), dense_activation=ACTIVATIONS[act], layer_types=layer_types,
        rms_norm_eps=value("rms_norm_eps"), tie_word_embeddings=hf.get("tie_word_embeddings",
                                                                       value("tie_word_embeddings", default=False)),
        attn_res_block_size=value("attn_res_block_size", default=None), mtp_depth=0, vision=None,
        kda=dict(num_heads=hf_value(linear, "num_heads"), head_dim_k=head_dim, head_dim_v=head_dim,
                 conv_kernel=hf_value(linear, "short_conv_kernel_size"), gate_rank=head_dim,
                 gate_form="lower_bound", gate_lower_bound=hf_value(linear, "gate_lower_bound"),
                 output_gate_rank=None),
        mla=dict(num_heads=heads, q_lora_rank=value("q_lora_rank"), kv_lora_rank=value("kv_lora_rank"),
                 qk_nope_head_dim=value("qk_nope_head_dim"), qk_rope_head_dim=value("qk_rope_head_dim"),
                 v_head_dim=value("v_head_dim"), output_gate=value("mla_use_output_gate", default=True),
                 latent_norm_eps=LATENT_NORM_EPS),
        dsa=dict(use_indexer=False), moe=moe)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The K3 config.json for `config`; what the K3 format cannot say is refused (Unexpressible names it)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
    k, mla, moe = config.kda, config.mla, config.moe
    latent_eps = config.rms_norm_eps if mla.latent_norm_eps is None else mla.latent_norm_eps
    refusals = [
        (config.vision is not None, "a vision tower (vision): the K3 format's tower is MoonViT (vision_tower.*), "
                                    "not ours; export a config with vision=None"),
        (config.mtp_depth > 0, "an MTP head (mtp_depth > 0): the K3 release names no MTP weights"),
        (config.dsa.use_indexer, "a DSA indexer (dsa.use_indexer=True): K3's attention is dense gated MLA"),
        (mla.rope != "none", f"rotary positions (mla.rope={mla.rope!r}): K3's MLA is NoPE"),
        (latent_eps != LATENT_NORM_EPS, f"MLA latent norms at eps {latent_eps} (mla.latent_norm_eps): the K3 "
                                        f"format's are {LATENT_NORM_EPS}"),
        (mla.q_lora_rank is None, "a query without LoRA (mla.q_lora_rank=None): K3 names q_a_proj / q_b_proj"),
        (not moe.latent_projection, "experts at full width (moe.latent_projection=False): K3 has a latent"),
        (k.gate_form != "lower_bound", f"KDA gate_form {k.gate_form!r}: K3's forget gate is the lower-bound form"),
        (k.output_gate_rank is not None, "a low-rank KDA output gate (kda.output_gate_rank): K3's is full rank"),
        (k.gate_rank != k.head_dim_k, f"a KDA forget-gate rank {k.gate_rank} other than head_dim "
                                      f"{k.head_dim_k}: the K3 config has no field for it"),
        (k.head_dim_k != k.head_dim_v, "KDA head_dim_k != head_dim_v: the K3 config has one head_dim"),
        (moe.activation_clamp is not None, "an activation clamp (moe.activation_clamp): K3 has none"),
        (config.first_dense_layers > 0 and config.dense_activation != moe.activation,
         f"a dense FFN with {config.dense_activation} beside {moe.activation} experts (dense_activation): "
         f"K3's one hidden_act covers every MLP"),
    ]
    for refused, feature in refusals:
        if refused:
            raise Unexpressible(feature)
    dsa_layers = [i + 1 for i, kind in enumerate(config.layer_types) if kind == DSA]
    text = {
        "model_type": TEXT_MODEL_TYPE, "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers, "max_position_embeddings": config.max_position_embeddings,
        "first_k_dense_replace": config.first_dense_layers, "moe_layer_freq": 1,
        "intermediate_size": config.dense_intermediate_size, "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings, "num_nextn_predict_layers": 0,
        "attn_res_block_size": config.attn_res_block_size,
        "linear_attn_config": {
            "kda_layers": [i + 1 for i, kind in enumerate(config.layer_types) if kind == KDA],
            "full_attn_layers": dsa_layers, "num_heads": k.num_heads, "head_dim": k.head_dim_k,
            "short_conv_kernel_size": k.conv_kernel, "gate_lower_bound": k.gate_lower_bound,
            "use_full_rank_gate": True},
        "num_attention_heads": mla.num_heads, "num_key_value_heads": mla.num_heads,
        "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim, "mla_use_nope": True, "mla_use_output_gate": mla.output_gate,
        "num_experts": moe.num_experts, "num_experts_per_token": moe.top_k,
        "num_shared_experts": moe.num_shared_experts, "moe_intermediate_size": moe.expert_intermediate_size,
        "routed_expert_hidden_size": moe.latent_size, "latent_moe_use_norm": True,
        "moe_renormalize": moe.norm_topk_prob, "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc",
        "use_grouped_topk": True, "num_expert_group": moe.n_group, "topk_group": moe.topk_group,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "hidden_act": "situ" if moe.activation == "situ" else "silu",
    }
    if moe.activation == "situ":
        text.update(activation_situ_beta=moe.situ_beta_gate, activation_situ_linear_beta=moe.situ_beta_up)
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
            "tie_word_embeddings": config.tie_word_embeddings, "text_config": text}


def _kda_entries(ours: str, theirs: str, config: ModelConfig) -> list[TensorMapping]:
    width = config.kda.num_heads * config.kda.head_dim_k
    value_width = config.kda.num_heads * config.kda.head_dim_v
    names = [("A_log", "A_log"), ("dt_bias", "dt_bias"), ("q_proj.weight", "q_proj.weight"),
             ("k_proj.weight", "k_proj.weight"), ("v_proj.weight", "v_proj.weight")]
    entries = [mapping(ours + a, theirs + b) for a, b in names]
    entries.append(mapping(ours + "conv.weight", [theirs + f"{p}_conv1d.weight" for p in "qkv"], "concat",
                           parts=(width, width, value_width)))
    names = [("b_proj.weight", "b_proj.weight"), ("f_down.weight", "f_a_proj.weight"),
             ("f_up.weight", "f_b_proj.weight"), ("g_proj.weight", "g_proj.weight"),
             ("o_norm.weight", "o_norm.weight"), ("o_proj.weight", "o_proj.weight")]
    return entries + [mapping(ours + a, theirs + b) for a, b in names]


def _mla_entries(ours: str, theirs: str, config: ModelConfig) -> list[TensorMapping]:
    names = [("wq_a", "q_a_proj"), ("q_norm", "q_a_layernorm"), ("wq_b", "q_b_proj"),
             ("wkv_a", "kv_a_proj_with_mqa"), ("kv_norm", "kv_a_layernorm"), ("wkv_b", "kv_b_proj")]
    names += [("w_gate", "g_proj")] if config.mla.output_gate else []
    return [mapping(f"{ours}{a}.weight", f"{theirs}{b}.weight") for a, b in names + [("wo", "o_proj")]]


def _ffn_entries(ours: str, theirs: str, config: ModelConfig, moe: bool) -> list[TensorMapping]:
    if not moe:
        return [mapping(f"{ours}{a}.weight", f"{theirs}mlp.{b}.weight")
                for a, b in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))]
    block = theirs + "block_sparse_moe."
    experts = range(config.moe.num_experts)
    entries = [mapping(ours + "correction_bias", block + "gate.e_score_correction_bias"),
               mapping(ours + "router.weight", block + "gate.weight"),
               mapping(ours + "down.weight", block + "routed_expert_down_proj.weight"),
               mapping(ours + "experts.w13", [f"{block}experts.{e}.w1.weight" for e in experts]
                       + [f"{block}experts.{e}.w3.weight" for e in experts], "experts_glu"),
               mapping(ours + "experts.w2", [f"{block}experts.{e}.w2.weight" for e in experts], "experts"),
               mapping(ours + "latent_norm.weight", block + "routed_expert_norm.weight"),
               mapping(ours + "up.weight", block + "routed_expert_up_proj.weight")]
    if config.moe.num_shared_experts:
        entries += [mapping(f"{ours}shared.{a}.weight", f"{block}shared_experts.{b}.weight")
                    for a, b in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))]
    return entries


def _depth_mix(ours: str, theirs: str, config: ModelConfig) -> list[TensorMapping]:
    """One Block AttnRes mix: our query [hidden] is K3's `..._proj.weight` [1, hidden] (a Linear(hidden, 1)),
    our RMSNorm weight its `..._norm.weight`."""
    return [mapping(ours + "query", theirs + "proj.weight", "reshape", their_shape=(1, config.hidden_size)),
            mapping(ours + "norm_weight", theirs + "norm.weight")]


def name_table(config: ModelConfig) -> list[TensorMapping]:
    """Every tensor of our state dict once (a tied lm_head left out), with its K3 name(s) in the logical layout:
    experts as `...experts.{e}.w1|w2|w3.weight` (k3_storage.py turns each into the MXFP4 weight_packed /
    weight_scale pair the release stores) and A_log as [num_heads] (stored zero-padded, k3_storage.py)."""
    entries = [mapping("embed_tokens.weight", PREFIX + "embed_tokens.weight")]
    for i, kind in enumerate(config.layer_types):
        ours, theirs = f"layers.{i}.", f"{PREFIX}layers.{i}."
        entries.append(mapping(ours + "attn_norm.weight", theirs + "input_layernorm.weight"))
        attention = _kda_entries if kind == KDA else _mla_entries
        entries += attention(ours + "attn.", theirs + "self_attn.", config)
        entries.append(mapping(ours + "ffn_norm.weight", theirs + "post_attention_layernorm.weight"))
        entries += _ffn_entries(ours + "ffn.", theirs, config, config.is_moe_layer(i))
        if config.attn_res_block_size is not None:
            entries += _depth_mix(ours + "attn_res.attn.", theirs + "self_attention_res_", config)
            entries += _depth_mix(ours + "attn_res.mlp.", theirs + "mlp_res_", config)
    entries.append(mapping("norm.weight", PREFIX + "norm.weight"))
    if config.attn_res_block_size is not None:
        entries += _depth_mix("attn_res_final.", PREFIX + "output_attn_res_", config)
    if not config.tie_word_embeddings:
        entries.append(mapping("lm_head.weight", HEAD))
    return entries
