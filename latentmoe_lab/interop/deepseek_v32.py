"""DeepSeek-V3.2 (transformers' model_type deepseek_v32) <-> our ModelConfig and state dict (docs/design.md §17).

What a deepseek_v32 checkpoint is, in our switches:
  - every layer is MLA with the lightning indexer: layer_types all "dsa", dsa.use_indexer, one indexer per layer;
  - MLA with a query LoRA, no output gate (mla.output_gate False), q_norm / kv_norm at eps 1e-6;
  - RoPE on the rope dims (mla.rope "rope", or "yarn" with the checkpoint's YaRN parameters): the MLA rope
    dims pair up interleaved (2i, 2i + 1), the indexer rotates the first qk_rope_head_dim dims of its heads
    half-split (i, i + rope / 2), as transformers' DeepseekV32Attention / DeepseekV32Indexer do;
  - the first first_k_dense_replace layers (mlp_layer_types "dense") have a dense SwiGLU of intermediate_size;
  - MoE without a latent projection (moe.latent_projection False): sigmoid router with e_score_correction_bias,
    group-limited top-k (n_group, topk_group), norm_topk_prob, routed_scaling_factor, one shared SwiGLU of
    n_shared_experts x moe_intermediate_size (our num_shared_experts shared experts, summed).
Anything else a config.json asks for (another activation, biases, GQA, partial rotary, another RoPE type, an
rms_norm_eps other than the 1e-6 transformers hard-codes in the MLA and indexer norms) is refused by its key.
"""
from __future__ import annotations

from typing import Any

from latentmoe_lab.config import DSA, ModelConfig
from latentmoe_lab.config_fields import describe
from latentmoe_lab.interop.detect import hf_value
from latentmoe_lab.interop.names import TensorMapping, Unexpressible, mapping

MODEL_TYPE = "deepseek_v32"
ARCHITECTURE = "DeepseekV32ForCausalLM"
FIXED_NORM_EPS = 1e-6  # transformers' q_a_layernorm, kv_a_layernorm and indexer k_norm ignore rms_norm_eps
_YARN_KEYS = {"factor": "yarn_factor", "original_max_position_embeddings": "yarn_original_max_position",
              "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow", "mscale": "yarn_mscale",
              "mscale_all_dim": "yarn_mscale_all_dim", "attention_factor": "yarn_attention_factor",
              "truncate": "yarn_truncate"}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A deepseek_v32 config.json (parsed) -> the ModelConfig of the same model; ValueError naming the key of
    anything our layers cannot run."""
    _require(hf_value(hf, "hidden_act", default="silu") == "silu", "hidden_act", "must be 'silu' (SwiGLU)", hf)
    for key in ("attention_bias", "mlp_bias"):
        _require(not hf_value(hf, key, default=False), key, "biases are not supported (our projections have none)", hf)
    heads = hf_value(hf, "num_attention_heads")
    _require(hf_value(hf, "num_key_value_heads", default=heads) == heads, "num_key_value_heads",
             f"must equal num_attention_heads ({heads}): MLA expands one latent to every head", hf)
    _require(hf_value(hf, "q_lora_rank") is not None, "q_lora_rank",
             "deepseek_v32 needs a query LoRA (its indexer reads the normed query latent)", hf)
    eps = hf_value(hf, "rms_norm_eps", default=FIXED_NORM_EPS)
    _require(eps == FIXED_NORM_EPS, "rms_norm_eps",
             f"must be {FIXED_NORM_EPS}: transformers fixes that eps in the MLA and indexer norms", hf)
    _require(hf_value(hf, "scoring_func", default="sigmoid") == "sigmoid", "scoring_func",
             "only the sigmoid router is supported", hf)
    _require(hf.get("quantization_config") is None, "quantization_config",
             "quantized checkpoints (the published FP8 block-scaled weights) must be dequantized first", hf)
    layers = hf_value(hf, "num_hidden_layers", "num_layers")
    kinds = hf_value(hf, "layer_types", default=None) or ["indexed_attention"] * layers
    _require(all(kind == "indexed_attention" for kind in kinds) and len(kinds) == layers, "layer_types",
             f"must be {layers} x 'indexed_attention'", hf)
    dense = _dense_prefix(hf, layers)
    experts = hf_value(hf, "n_routed_experts", "num_local_experts", "num_experts")
    return ModelConfig(
        name=MODEL_TYPE, vocab_size=hf_value(hf, "vocab_size"),
        hidden_size=hf_value(hf, "hidden_size"), num_layers=layers,
        max_position_embeddings=hf_value(hf, "max_position_embeddings"), first_dense_layers=dense,
        dense_intermediate_size=hf_value(hf, "intermediate_size"), dsa_interval=1, final_layer_dsa=True,
        layer_types=[DSA] * layers, rms_norm_eps=eps, initializer_range=hf_value(hf, "initializer_range", default=0.02),
        tie_word_embeddings=bool(hf_value(hf, "tie_word_embeddings", default=False)), mtp_depth=0, vision=None,
        mla=dict(num_heads=heads, q_lora_rank=hf_value(hf, "q_lora_rank"), kv_lora_rank=hf_value(hf, "kv_lora_rank"),
                 qk_nope_head_dim=hf_value(hf, "qk_nope_head_dim"), qk_rope_head_dim=hf_value(hf, "qk_rope_head_dim"),
                 v_head_dim=hf_value(hf, "v_head_dim"), output_gate=False, latent_norm_eps=None, **_rope_from_hf(hf)),
        indexer=dict(num_heads=hf_value(hf, "index_n_heads"), head_dim=hf_value(hf, "index_head_dim"),
                     topk=hf_value(hf, "index_topk")),
        dsa=dict(index_share_every=1, use_indexer=True),
        moe=dict(num_experts=experts, top_k=hf_value(hf, "num_experts_per_tok"),
                 num_shared_experts=hf_value(hf, "n_shared_experts", default=1),
                 expert_intermediate_size=hf_value(hf, "moe_intermediate_size"),
                 latent_size=hf_value(hf, "hidden_size"),
                 latent_projection=False, n_group=hf_value(hf, "n_group", default=8),
                 topk_group=hf_value(hf, "topk_group", default=4),
                 routed_scaling_factor=float(hf_value(hf, "routed_scaling_factor", default=2.5)),
                 norm_topk_prob=bool(hf_value(hf, "norm_topk_prob", default=True))),
    )


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """Our ModelConfig -> a deepseek_v32 config.json dict; Unexpressible naming the first feature it lacks."""
    _refuse_unexpressible(config)
    mla, moe, idx = config.mla, config.moe, config.indexer
    dense = config.first_dense_layers
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.dense_intermediate_size, "moe_intermediate_size": moe.expert_intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": mla.num_heads,
        "num_key_value_heads": mla.num_heads, "n_shared_experts": moe.num_shared_experts,
        "n_routed_experts": moe.num_experts, "routed_scaling_factor": moe.routed_scaling_factor,
        "kv_lora_rank": mla.kv_lora_rank, "q_lora_rank": mla.q_lora_rank, "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim, "qk_nope_head_dim": mla.qk_nope_head_dim,
        "head_dim": mla.qk_rope_head_dim, "n_group": moe.n_group, "topk_group": moe.topk_group,
        "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.norm_topk_prob, "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings, "initializer_range": config.initializer_range,
        "rms_norm_eps": config.rms_norm_eps, "tie_word_embeddings": config.tie_word_embeddings,
        "rope_parameters": _rope_to_hf(config), "first_k_dense_replace": dense,
        "mlp_layer_types": ["dense"] * dense + ["sparse"] * (config.num_layers - dense),
        "layer_types": ["indexed_attention"] * config.num_layers,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "index_topk": idx.topk, "index_head_dim": idx.head_dim, "index_n_heads": idx.num_heads,
    }


def name_table(config: ModelConfig) -> list[TensorMapping]:
    """Every tensor of our state dict once, in its order, with its deepseek_v32 checkpoint name(s)."""
    table = [mapping("embed_tokens.weight", "model.embed_tokens.weight")]
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        table.append(mapping(ours + "attn_norm.weight", theirs + "input_layernorm.weight"))
        table += [mapping(f"{ours}attn.{our_name}", f"{theirs}self_attn.{their_name}")
                  for our_name, their_name in _ATTENTION_NAMES]
        table.append(mapping(ours + "ffn_norm.weight", theirs + "post_attention_layernorm.weight"))
        if config.is_moe_layer(i):
            table += _moe_names(ours + "ffn.", theirs + "mlp.", config.moe.num_experts, config.moe.num_shared_experts)
        else:
            table += [mapping(f"{ours}ffn.{our_name}", f"{theirs}mlp.{their_name}") for our_name, their_name in _GLU]
    table.append(mapping("norm.weight", "model.norm.weight"))
    if not config.tie_word_embeddings:
        table.append(mapping("lm_head.weight", "lm_head.weight"))
    return table


_ATTENTION_NAMES = (
    ("wq_a.weight", "q_a_proj.weight"), ("q_norm.weight", "q_a_layernorm.weight"), ("wq_b.weight", "q_b_proj.weight"),
    ("wkv_a.weight", "kv_a_proj_with_mqa.weight"), ("kv_norm.weight", "kv_a_layernorm.weight"),
    ("wkv_b.weight", "kv_b_proj.weight"),
    ("indexer.wq.weight", "indexer.wq_b.weight"), ("indexer.wk.weight", "indexer.wk.weight"),
    ("indexer.k_norm.weight", "indexer.k_norm.weight"), ("indexer.k_norm.bias", "indexer.k_norm.bias"),
    ("indexer.w_heads.weight", "indexer.weights_proj.weight"),
    ("wo.weight", "o_proj.weight"),
)
_GLU = (("w1.weight", "gate_proj.weight"), ("w3.weight", "up_proj.weight"), ("w2.weight", "down_proj.weight"))


def _moe_names(ours: str, theirs: str, experts: int, shared: int) -> list[TensorMapping]:
    """Correction bias, router, packed experts (gate | up joined, down), and the shared SwiGLU."""
    table = [mapping(ours + "correction_bias", theirs + "gate.e_score_correction_bias"),
             mapping(ours + "router.weight", theirs + "gate.weight"),
             mapping(ours + "experts.w13", [f"{theirs}experts.{e}.gate_proj.weight" for e in range(experts)]
                     + [f"{theirs}experts.{e}.up_proj.weight" for e in range(experts)], "experts_glu"),
             mapping(ours + "experts.w2", [f"{theirs}experts.{e}.down_proj.weight" for e in range(experts)], "experts")]
    if shared:
        table += [mapping(f"{ours}shared.{our_name}", f"{theirs}shared_experts.{their_name}")
                  for our_name, their_name in _GLU]
    return table


# ------------------------------------------------------------------------------------------------- helpers
def _require(ok: bool, key: str, rule: str, hf: dict[str, Any]) -> None:
    if not ok:
        raise ValueError(f"{key}: {rule} (deepseek_v32 config.json has {describe(hf.get(key))})")


def _dense_prefix(hf: dict[str, Any], layers: int) -> int:
    """How many leading layers are dense: mlp_layer_types when given (it must be a dense prefix), else
    first_k_dense_replace (transformers' default 3)."""
    kinds = hf_value(hf, "mlp_layer_types", default=None)
    if kinds is None:
        return min(hf_value(hf, "first_k_dense_replace", default=3), layers)
    dense = next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))
    _require(len(kinds) == layers and all(kind == "sparse" for kind in kinds[dense:]), "mlp_layer_types",
             f"must be {layers} entries, 'dense' first then 'sparse' (our dense layers are a prefix)", hf)
    return dense


def _rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_parameters (or the older rope_scaling + rope_theta) -> our mla.rope* / mla.yarn_* fields."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = params.pop("rope_type", params.pop("type", "default"))
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    _require(kind in ("default", "yarn"), "rope_parameters",
             f"rope_type must be 'default' or 'yarn', got {describe(kind)}", hf)
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    _require(partial in (None, 1, 1.0), "partial_rotary_factor", "must be 1 (all qk_rope_head_dim dims rotate)", hf)
    unknown = sorted(set(params) - (set(_YARN_KEYS) if kind == "yarn" else set()))
    _require(not unknown, "rope_parameters", f"keys {unknown} are not read by {kind} RoPE", hf)
    fields: dict[str, Any] = {"rope": "rope" if kind == "default" else "yarn", "rope_theta": theta}
    if kind == "default":
        return fields
    # as transformers: a top-level original_max_position_embeddings wins, then the rope dict's, then the context
    original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") \
        or hf_value(hf, "max_position_embeddings")
    factor = params.get("factor") or hf_value(hf, "max_position_embeddings") / original
    # transformers reads beta_fast / beta_slow with `or`: a 0 there means the default
    fields.update(yarn_factor=float(factor), yarn_original_max_position=int(original),
                  yarn_beta_fast=float(params.get("beta_fast") or 32.0),
                  yarn_beta_slow=float(params.get("beta_slow") or 1.0),
                  yarn_mscale=params.get("mscale"), yarn_mscale_all_dim=params.get("mscale_all_dim"),
                  yarn_attention_factor=params.get("attention_factor"),
                  yarn_truncate=bool(params.get("truncate", True)))
    return fields


def _rope_to_hf(config: ModelConfig) -> dict[str, Any]:
    mla = config.mla
    if mla.rope == "rope":
        return {"rope_type": "default", "rope_theta": mla.rope_theta}
    params = {"rope_type": "yarn", "rope_theta": mla.rope_theta}
    for their_key, our_key in _YARN_KEYS.items():
        value = getattr(mla, our_key)
        if value is not None:
            params[their_key] = value
    return params


def _refuse_unexpressible(config: ModelConfig) -> None:
    """Unexpressible naming the first feature of `config` that a deepseek_v32 checkpoint cannot hold."""
    mla, moe = config.mla, config.moe
    checks = [
        (all(kind == DSA for kind in config.layer_types), "KDA layers (layer_types has 'kda'): every deepseek_v32 "
                                                          "layer is MLA with an indexer"),
        (config.dsa.use_indexer, "dense MLA without an indexer (dsa.use_indexer=False)"),
        (config.dsa.index_share_every == 1, "index sharing (dsa.index_share_every > 1)"),
        (not moe.latent_projection, "latent experts (moe.latent_projection=True): deepseek_v32 has no latent "
                                    "projection"),
        (not mla.output_gate, "the gated DSA output gate (mla.output_gate=True)"),
        (mla.rope != "none", "NoPE MLA (mla.rope='none'): deepseek_v32 always rotates the rope dims"),
        (mla.q_lora_rank is not None, "MLA without a query LoRA (mla.q_lora_rank=None)"),
        (config.vision is None, "the vision tower (config.vision)"),
        (config.mtp_depth == 0, "our MTP head (mtp_depth > 0)"),
        (moe.activation_clamp is None, "the SwiGLU activation clamp (moe.activation_clamp)"),
        (config.rms_norm_eps == FIXED_NORM_EPS and mla.latent_norm_eps in (None, FIXED_NORM_EPS),
         f"norm eps other than {FIXED_NORM_EPS} (rms_norm_eps / mla.latent_norm_eps)"),
    ]
    for ok, feature in checks:
        if not ok:
            raise Unexpressible(f"{feature} cannot be expressed in {MODEL_TYPE}")
