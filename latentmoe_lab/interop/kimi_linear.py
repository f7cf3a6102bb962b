"""kimi_linear (Kimi-Linear: KDA + NoPE MLA + MoE) <-> our ModelConfig and state dict (docs/design.md §17).

How their model is ours with switches:
- KDA layers ("linear_attention"): softplus forget gate with a rank-head_dim f_a/f_b projection, a rank-head_dim
  output gate g_a/g_b, d_k = d_v = head_dim, the three short convs stored apart (q_conv1d, k_conv1d, v_conv1d),
  A_log stored [1, 1, H, 1].
- MLA layers ("full_attention"): NoPE (the rope part is carried, never rotated), dense causal attention (no
  indexer), no output gate, q LoRA optional, and q_a / kv_a layernorms at eps 1e-6 whatever rms_norm_eps is.
- MoE: no latent projection, sigmoid router with e_score_correction_bias, group-limited top-k, norm_topk_prob,
  routed_scaling_factor, n_shared_experts experts summed into one SwiGLU; experts stored one Linear each.
- Layer lists in the published config are 1-based (linear_attn_config.kda_layers / full_attn_layers).
- Embeddings: transformers' KimiLinearForCausalLM ties nothing (its _tied_weights_keys is empty), whatever
  tie_word_embeddings says; lm_head.weight is always its own tensor, so ours is untied too.
"""
from __future__ import annotations

from typing import Any

from latentmoe_lab.config import DSA, KDA, ModelConfig
from latentmoe_lab.interop.detect import hf_value
from latentmoe_lab.interop.names import TensorMapping, Unexpressible, mapping

MODEL_TYPE = "kimi_linear"
ARCHITECTURE = "KimiLinearForCausalLM"
LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with their default eps
# Published checkpoints keep the dense FFN under ".mlp."; transformers' save_pretrained writes every FFN under
# ".block_sparse_moe." (its conversion mapping reversed). Checkpoint names are canonicalised to the latter.
LEGACY_NAMES = [(".mlp.", ".block_sparse_moe.")]
_ATTENTION_TYPES = {"linear_attention": KDA, "full_attention": DSA}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A kimi_linear config.json dict -> the equivalent ModelConfig; what our layers cannot run -> ValueError."""
    _require(hf, "hidden_act", "silu")
    _require(hf, "attention_bias", False)
    _require(hf, "moe_router_activation_func", "sigmoid")
    if hf.get("quantization_config") is not None:
        raise ValueError("quantization_config: quantized transformers checkpoints are not supported; "
                         "use an unquantized (bf16 / fp32) checkpoint")
    layers = hf_value(hf, "num_hidden_layers")
    linear = hf.get("linear_attn_config") or {}
    if not isinstance(linear, dict):
        raise ValueError(f"linear_attn_config: expected a JSON object, got {type(linear).__name__}")
    head_dim = linear.get("head_dim", hf.get("linear_head_dim", 128))
    max_positions = hf_value(hf, "max_position_embeddings", "model_max_length", default=1048576)
    hidden = hf_value(hf, "hidden_size")
    return ModelConfig(
        name=str(hf.get("_name_or_path") or MODEL_TYPE)[-200:], vocab_size=hf_value(hf, "vocab_size"),
        hidden_size=hidden, num_layers=layers, max_position_embeddings=max_positions,
        first_dense_layers=_dense_prefix(hf, layers), dense_intermediate_size=hf_value(hf, "intermediate_size"),
        layer_types=_layer_types(hf, linear, layers), rms_norm_eps=hf_value(hf, "rms_norm_eps", default=1e-5),
        initializer_range=hf_value(hf, "initializer_range", default=0.02),
        tie_word_embeddings=False, mtp_depth=0, vision=None,  # transformers' kimi_linear never ties (see below)
        kda=dict(num_heads=linear.get("num_heads", hf.get("linear_num_heads", 32)), head_dim_k=head_dim,
                 head_dim_v=head_dim, conv_kernel=linear.get("short_conv_kernel_size",
                                                             hf.get("linear_conv_kernel_dim", 4)),
                 gate_rank=head_dim, gate_form="softplus", output_gate_rank=head_dim),
        mla=dict(num_heads=hf_value(hf, "num_attention_heads"), q_lora_rank=hf_value(hf, "q_lora_rank", default=None),
                 kv_lora_rank=hf_value(hf, "kv_lora_rank", default=512),
                 qk_nope_head_dim=hf_value(hf, "qk_nope_head_dim", default=128),
                 qk_rope_head_dim=hf_value(hf, "qk_rope_head_dim", default=64),
                 v_head_dim=hf_value(hf, "v_head_dim", default=128), output_gate=False,
                 latent_norm_eps=LATENT_NORM_EPS),
        indexer=dict(topk=min(2048, max_positions)), dsa=dict(use_indexer=False),
        moe=dict(num_experts=hf_value(hf, "num_local_experts", "num_experts", default=256),
                 top_k=hf_value(hf, "num_experts_per_tok", "num_experts_per_token", default=8),
                 num_shared_experts=hf_value(hf, "n_shared_experts", "num_shared_experts", default=1),
                 expert_intermediate_size=hf_value(hf, "moe_intermediate_size", default=1024),
                 latent_size=hidden, latent_projection=False,
                 n_group=hf_value(hf, "n_group", "num_expert_group", default=1),
                 topk_group=hf_value(hf, "topk_group", default=1),
                 routed_scaling_factor=hf_value(hf, "routed_scaling_factor", default=2.446),
                 norm_topk_prob=hf_value(hf, "norm_topk_prob", "moe_renormalize", default=True)),
    )


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """Our config -> a kimi_linear config.json dict; a feature kimi_linear cannot express -> Unexpressible."""
    _refuse_unexpressible(config)
    kda_layers = [i + 1 for i, kind in enumerate(config.layer_types) if kind == KDA]
    full_layers = [i + 1 for i, kind in enumerate(config.layer_types) if kind == DSA]
    mla, moe, kda = config.mla, config.moe, config.kda
    return {
        "model_type": MODEL_TYPE, "architectures": [ARCHITECTURE], "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.dense_intermediate_size,
        "moe_intermediate_size": moe.expert_intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": mla.num_heads, "num_key_value_heads": mla.num_heads,
        "kv_lora_rank": mla.kv_lora_rank, "q_lora_rank": mla.q_lora_rank,
        "qk_rope_head_dim": mla.qk_rope_head_dim, "qk_nope_head_dim": mla.qk_nope_head_dim,
        "v_head_dim": mla.v_head_dim, "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "n_group": moe.n_group, "topk_group": moe.topk_group, "norm_topk_prob": moe.norm_topk_prob,
        "routed_scaling_factor": moe.routed_scaling_factor, "n_shared_experts": moe.num_shared_experts,
        "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": False, "initializer_range": config.initializer_range,
        "first_k_dense_replace": config.first_dense_layers,
        "mlp_layer_types": ["dense" if i < config.first_dense_layers else "sparse" for i in range(config.num_layers)],
        "layer_types": ["linear_attention" if kind == KDA else "full_attention" for kind in config.layer_types],
        "linear_attn_config": {"head_dim": kda.head_dim_k, "num_heads": kda.num_heads,
                               "short_conv_kernel_size": kda.conv_kernel, "kda_layers": kda_layers,
                               "full_attn_layers": full_layers},
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None, "dtype": "float32",
    }


def name_table(config: ModelConfig) -> list[TensorMapping]:
    """Every tensor of our state dict with its kimi_linear name(s), in our order (never tied, see above)."""
    table = [mapping("embed_tokens.weight", "model.embed_tokens.weight")]
    for i, kind in enumerate(config.layer_types):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        table.append(mapping(ours + "attn_norm.weight", theirs + "input_layernorm.weight"))
        table += _kda(config, ours + "attn.", theirs + "self_attn.") if kind == KDA else \
            _mla(config, ours + "attn.", theirs + "self_attn.")
        table.append(mapping(ours + "ffn_norm.weight", theirs + "post_attention_layernorm.weight"))
        table += _moe(config, ours + "ffn.", theirs + "block_sparse_moe.") if config.is_moe_layer(i) else \
            _swiglu(ours + "ffn.", theirs + "block_sparse_moe.")
    table.append(mapping("norm.weight", "model.norm.weight"))
    table.append(mapping("lm_head.weight", "lm_head.weight"))
    return table


# ------------------------------------------------------------------------------------------- tables
def _kda(config: ModelConfig, ours: str, theirs: str) -> list[TensorMapping]:
    kda = config.kda
    key_width, value_width = kda.num_heads * kda.head_dim_k, kda.num_heads * kda.head_dim_v
    return [
        mapping(ours + "q_proj.weight", theirs + "q_proj.weight"),
        mapping(ours + "k_proj.weight", theirs + "k_proj.weight"),
        mapping(ours + "v_proj.weight", theirs + "v_proj.weight"),
        mapping(ours + "conv.weight", [theirs + f"{p}_conv1d.weight" for p in "qkv"], "concat",
                parts=(key_width, key_width, value_width)),
        mapping(ours + "b_proj.weight", theirs + "b_proj.weight"),
        mapping(ours + "f_down.weight", theirs + "f_a_proj.weight"),
        mapping(ours + "f_up.weight", theirs + "f_b_proj.weight"),
        mapping(ours + "A_log", theirs + "A_log", "reshape", their_shape=(1, 1, kda.num_heads, 1)),
        mapping(ours + "dt_bias", theirs + "dt_bias"),
        mapping(ours + "g_proj.0.weight", theirs + "g_a_proj.weight"),
        mapping(ours + "g_proj.1.weight", theirs + "g_b_proj.weight"),
        mapping(ours + "o_norm.weight", theirs + "o_norm.weight"),
        mapping(ours + "o_proj.weight", theirs + "o_proj.weight"),
    ]


def _mla(config: ModelConfig, ours: str, theirs: str) -> list[TensorMapping]:
    if config.mla.q_lora_rank is None:
        query = [mapping(ours + "wq.weight", theirs + "q_proj.weight")]
    else:
        query = [mapping(ours + "wq_a.weight", theirs + "q_a_proj.weight"),
                 mapping(ours + "q_norm.weight", theirs + "q_a_layernorm.weight"),
                 mapping(ours + "wq_b.weight", theirs + "q_b_proj.weight")]
    return query + [
        mapping(ours + "wkv_a.weight", theirs + "kv_a_proj_with_mqa.weight"),
        mapping(ours + "kv_norm.weight", theirs + "kv_a_layernorm.weight"),
        mapping(ours + "wkv_b.weight", theirs + "kv_b_proj.weight"),
        mapping(ours + "wo.weight", theirs + "o_proj.weight"),
    ]


def _swiglu(ours: str, theirs: str) -> list[TensorMapping]:
    return [mapping(ours + "w1.weight", theirs + "gate_proj.weight"),
            mapping(ours + "w3.weight", theirs + "up_proj.weight"),
            mapping(ours + "w2.weight", theirs + "down_proj.weight")]


def _moe(config: ModelConfig, ours: str, theirs: str) -> list[TensorMapping]:
    experts = range(config.moe.num_experts)
    table = [
        mapping(ours + "router.weight", theirs + "gate.weight"),
        mapping(ours + "correction_bias", theirs + "gate.e_score_correction_bias"),
        mapping(ours + "experts.w13", [theirs + f"experts.{e}.w1.weight" for e in experts]
                + [theirs + f"experts.{e}.w3.weight" for e in experts], "experts_glu"),
        mapping(ours + "experts.w2", [theirs + f"experts.{e}.w2.weight" for e in experts], "experts"),
    ]
    if config.moe.num_shared_experts:
        table += _swiglu(ours + "shared.", theirs + "shared_experts.")
    return table


# ------------------------------------------------------------------------------------------- checks
def _require(hf: dict[str, Any], key: str, value: Any) -> None:
    if key in hf and hf[key] != value:
        raise ValueError(f"{key}: {hf[key]!r} is not supported (kimi_linear models here use {value!r})")


def _layer_types(hf: dict[str, Any], linear: dict[str, Any], layers: int) -> list[str]:
    """Attention type per layer, with transformers' precedence: layer_types, then the 1-based
    linear_attn_config lists, then its default (full attention at 0-based layers 4, 8, ...)."""
    if hf.get("layer_types") is not None:
        given = hf["layer_types"]
        bad = sorted({str(t) for t in given} - set(_ATTENTION_TYPES)) if isinstance(given, list) else [str(given)]
        if bad or len(given) != layers:
            raise ValueError(f"layer_types: expected {layers} entries of {sorted(_ATTENTION_TYPES)}, got {given!r}")
        return [_ATTENTION_TYPES[t] for t in given]
    if "kda_layers" in linear and "full_attn_layers" in linear:
        types: list[str | None] = [None] * layers
        for key, kind in (("kda_layers", KDA), ("full_attn_layers", DSA)):
            for layer in linear[key]:
                if not isinstance(layer, int) or not 1 <= layer <= layers or types[layer - 1] is not None:
                    raise ValueError(f"linear_attn_config.{key}: {layer!r} is not a free 1-based layer in "
                                     f"1..{layers}")
                types[layer - 1] = kind
        if None in types:
            raise ValueError(f"linear_attn_config.kda_layers: layer {types.index(None) + 1} (1-based) is in "
                             "neither kda_layers nor full_attn_layers")
        return types
    return [DSA if i and i % 4 == 0 else KDA for i in range(layers)]


def _dense_prefix(hf: dict[str, Any], layers: int) -> int:
    """first_dense_layers from mlp_layer_types (a dense prefix only) or first_k_dense_replace."""
    kinds = hf.get("mlp_layer_types")
    if kinds is None:
        return min(hf_value(hf, "first_k_dense_replace", default=1), layers)
    if not isinstance(kinds, list) or len(kinds) != layers or set(kinds) - {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types: expected {layers} entries of 'dense' / 'sparse', got {kinds!r}")
    dense = kinds.count("dense")
    if kinds[:dense] != ["dense"] * dense:
        raise ValueError(f"mlp_layer_types: dense layers must come first (a dense prefix, first_dense_layers); "
                         f"got {kinds}")
    return dense


def _refuse_unexpressible(config: ModelConfig) -> None:
    """One Unexpressible naming the first feature of `config` a kimi_linear checkpoint cannot hold."""
    kda, mla, moe = config.kda, config.mla, config.moe
    latent_eps = config.rms_norm_eps if mla.latent_norm_eps is None else mla.latent_norm_eps
    refusals = [
        (config.vision is not None, "the vision tower (config.vision): kimi_linear is text-only"),
        (config.tie_word_embeddings, "tied embeddings (tie_word_embeddings=True): transformers' kimi_linear "
                                     "always has its own LM head"),
        (config.mtp_depth > 0, f"the MTP head (mtp_depth={config.mtp_depth}): kimi_linear has none"),
        (moe.latent_projection, "latent experts (moe.latent_projection=True): kimi_linear's MoE has no latent "
                                "projection"),
        (mla.output_gate and config.num_dsa_layers > 0,
         "the gated DSA output gate (mla.output_gate=True): kimi_linear's MLA has no output gate"),
        (mla.rope != "none" and config.num_dsa_layers > 0,
         f"RoPE on the MLA rope dims (mla.rope={mla.rope!r}): kimi_linear's MLA is NoPE"),
        (config.dsa.use_indexer and config.num_dsa_layers > 0,
         "the DSA lightning indexer (dsa.use_indexer=True): kimi_linear's MLA attends densely"),
        (kda.gate_form != "softplus", f"the {kda.gate_form} KDA forget gate (kda.gate_form): kimi_linear's is softplus"),
        (kda.head_dim_k != kda.head_dim_v, "kda.head_dim_v different from kda.head_dim_k: kimi_linear has one head_dim"),
        (kda.gate_rank != kda.head_dim_k, "kda.gate_rank different from the KDA head dim: kimi_linear's f_a_proj has "
                                          "rank head_dim"),
        (kda.output_gate_rank != kda.head_dim_k, "kda.output_gate_rank different from the KDA head dim: kimi_linear's "
                                                 "g_a_proj has rank head_dim"),
        (moe.num_shared_experts == 0, "an MoE without shared experts (moe.num_shared_experts=0): kimi_linear always "
                                      "has them"),
        (moe.activation_clamp is not None, "the SwiGLU activation clamp (moe.activation_clamp)"),
        (latent_eps != LATENT_NORM_EPS, f"MLA latent norms at eps {latent_eps} (mla.latent_norm_eps): kimi_linear's "
                                        f"are {LATENT_NORM_EPS}"),
    ]
    for refused, feature in refusals:
        if refused:
            raise Unexpressible(f"{MODEL_TYPE} cannot express {feature}")
