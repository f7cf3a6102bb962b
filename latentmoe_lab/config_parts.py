"""The nested parts of ModelConfig (docs/design.md §1): one dataclass per mechanism, with its defaults.

ModelConfig (config.py) holds one of each and checks them together in validate(); a part on its own is not
validated, since most of its rules relate it to the whole model (latent_size <= hidden_size, ...).
"""
from __future__ import annotations

from dataclasses import dataclass

GATE_FORMS = ("lower_bound", "softplus")
# The chunked KDA form pads T up to whole chunks and does O(C^2) work per chunk (C x C decay and score
# matrices, a C-row triangular solve), so the cost per token grows with C; the state hand-off it saves
# costs O(d_k d_v / C) per token. Past a few hundred the quadratic part dominates (4096 made a 40-token
# forward take 8 s), and the Triton kernel tiles at most 128 anyway (ops/kda.py).
MAX_KDA_CHUNK_SIZE = 256


@dataclass
class KDAConfig:
    """Kimi Delta Attention (docs/design.md §1.3)."""

    num_heads: int = 96
    head_dim_k: int = 128
    head_dim_v: int = 128
    conv_kernel: int = 4
    gate_rank: int = 128  # low-rank forget gate: hidden -> gate_rank -> heads * head_dim_k
    gate_form: str = "lower_bound"  # "lower_bound": lb * sigmoid(.) ; "softplus": -exp(A) softplus(.)
    gate_lower_bound: float = -5.0
    output_gate_rank: int | None = None  # None = full-rank output gate
    chunk_size: int = 64


@dataclass
class MLAConfig:
    """Multi-head latent attention inside Gated DSA (docs/design.md §1.4)."""

    num_heads: int = 96
    q_lora_rank: int | None = 1536  # None: one query projection hidden -> heads * (nope + rope), no q LoRA
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # NoPE model: this part is carried but never rotated
    v_head_dim: int = 128
    output_gate: bool = True  # False: plain MLA output W_o attn, no sigmoid gate (docs/design.md §17)
    latent_norm_eps: float | None = None  # eps of the q / kv latent RMSNorms; None = rms_norm_eps
    # Rotary positions on the rope dims (ops/rotary.py, docs/design.md §17): "none" (NoPE), "rope", or "yarn"
    # (RoPE with YaRN, the yarn_* fields; None = transformers' default for that field).
    rope: str = "none"
    rope_theta: float = 10000.0
    yarn_factor: float = 1.0
    yarn_original_max_position: int | None = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float | None = None
    yarn_mscale_all_dim: float | None = None
    yarn_attention_factor: float | None = None
    yarn_truncate: bool = True


@dataclass
class IndexerConfig:
    """Lightning indexer and top-k selection of DSA (docs/design.md §1.4)."""

    num_heads: int = 64
    head_dim: int = 128
    topk: int = 2048


@dataclass
class DSAConfig:
    """Gated DSA layer options beyond MLA and the indexer (docs/design.md §15.2)."""

    # DSA layers per lightning indexer: 1 = every DSA layer runs its own; k > 1 = of every k consecutive DSA
    # layers only the first has an indexer, the next k - 1 reuse its top-k selection (no indexer weights and
    # no index-key cache of their own).
    index_share_every: int = 1
    # False: dense causal MLA in every DSA layer, no indexer weights and no index keys (docs/design.md §17)
    use_indexer: bool = True


MOE_ACTIVATIONS = ("swiglu", "situ")  # moe.activation (docs/design.md §18)
BIAS_UPDATES = ("sign", "quantile")  # moe.bias_update


@dataclass
class MoEConfig:
    """Stable LatentMoE (docs/design.md §1.2)."""

    num_experts: int = 896
    top_k: int = 16
    num_shared_experts: int = 2
    expert_intermediate_size: int = 3072
    latent_size: int = 3584
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    bias_update_rate: float = 1e-3
    aux_loss_alpha: float = 0.0
    z_loss_coef: float = 0.0
    activation_clamp: float | None = None
    # False: no W_down / latent RMSNorm / W_up, the experts run at the hidden width (latent_size = hidden_size);
    # the plain DeepSeek-style MoE of transformers checkpoints (docs/design.md §17)
    latent_projection: bool = True
    norm_topk_prob: bool = True  # False: the top-k sigmoid scores are not renormalised to sum to 1
    # K3's published choices (docs/design.md §18), off by default:
    activation: str = "swiglu"  # routed and shared experts: "swiglu" or "situ" (ops.activations.situ)
    situ_beta_gate: float = 4.0  # SiTU's b1 (K3 config.json: activation_situ_beta)
    situ_beta_up: float = 25.0  # SiTU's b2 (K3 config.json: activation_situ_linear_beta)
    bias_update: str = "sign"  # correction-bias rule: "sign" steps or the "quantile" rule (ops.balancing)


@dataclass
class VisionConfig:
    """ViT-style vision tower (docs/design.md §1.5). Sizes follow a SigLIP-so400m-class encoder."""

    patch_size: int = 14
    in_channels: int = 3
    hidden_size: int = 1152
    num_layers: int = 27
    num_heads: int = 16
    intermediate_size: int = 4304
    merge_size: int = 2  # 2x2 patch merger
    # Token ids the text side uses for an image span: start, one placeholder per merged patch, end.
    # The defaults are the byte tokenizer's first free ids (latentmoe_lab.tokenizer.SPECIAL_TOKENS).
    image_token_id: int = 256
    image_start_id: int = 257
    image_end_id: int = 258
