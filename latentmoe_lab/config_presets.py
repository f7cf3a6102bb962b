"""Named model sizes for ModelConfig.from_preset: tiny and mini for tests and CPU training, small for a few CPU
steps, k3-2.8t the full-scale table of docs/design.md §1.1 (every field at its default), k3-public the published
K3 beside it (docs/design.md §18)."""
from __future__ import annotations

from typing import Any

# Full scale: counted and planned on the meta device, never built with weights (smoke / align leave them out).
FULL_SCALE = ("k3-2.8t", "k3-public")

PRESETS: dict[str, dict[str, Any]] = {
    # Every mechanism on, small enough that a 256-token forward takes a fraction of a second.
    "tiny": dict(
        name="tiny", vocab_size=512, hidden_size=64, num_layers=4, max_position_embeddings=4096,
        first_dense_layers=1, dense_intermediate_size=128,
        kda=dict(num_heads=2, head_dim_k=16, head_dim_v=16, conv_kernel=4, gate_rank=8, chunk_size=16),
        mla=dict(num_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                 v_head_dim=16),
        indexer=dict(num_heads=2, head_dim=16, topk=32),
        moe=dict(num_experts=8, top_k=2, num_shared_experts=1, expert_intermediate_size=32, latent_size=32,
                 n_group=4, topk_group=2),
        vision=dict(patch_size=14, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64),
    ),
    # ~7M parameters (~2M active per token), every mechanism on: `latentmoe-lab train` on 2 CPU cores.
    # Byte vocabulary (256 bytes + the 4 specials, rounded up); chunk 32 keeps the KDA backward cheap.
    "mini": dict(
        name="mini", vocab_size=384, hidden_size=192, num_layers=4, max_position_embeddings=8192,
        first_dense_layers=1, dense_intermediate_size=576,
        kda=dict(num_heads=3, head_dim_k=64, head_dim_v=64, conv_kernel=4, gate_rank=32, chunk_size=32),
        mla=dict(num_heads=3, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                 v_head_dim=64),
        indexer=dict(num_heads=2, head_dim=32, topk=64),
        moe=dict(num_experts=16, top_k=2, num_shared_experts=1, expert_intermediate_size=384, latent_size=96,
                 n_group=4, topk_group=2),
        vision=dict(patch_size=14, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128),
    ),
    # 50-150M parameters: trainable for a few steps on a CPU.
    "small": dict(
        name="small", vocab_size=32768, hidden_size=512, num_layers=8, max_position_embeddings=65536,
        first_dense_layers=1, dense_intermediate_size=1536,
        kda=dict(num_heads=4, head_dim_k=128, head_dim_v=128, conv_kernel=4, gate_rank=32),
        mla=dict(num_heads=4, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
                 v_head_dim=64),
        indexer=dict(num_heads=4, head_dim=64, topk=256),
        moe=dict(num_experts=32, top_k=4, num_shared_experts=1, expert_intermediate_size=384, latent_size=256,
                 n_group=4, topk_group=2),
        vision=dict(patch_size=14, hidden_size=256, num_layers=4, num_heads=4, intermediate_size=768),
    ),
    # The full-scale table of docs/design.md §1.1.
    "k3-2.8t": dict(name="k3-2.8t"),
    # The published K3 (moonshotai/Kimi-K3 config.json, report arXiv 2607.24653): k3-2.8t's shapes with K3's
    # choices; the differences and where each comes from: docs/design.md §18 and the README.
    "k3-public": dict(
        name="k3-public", rms_norm_eps=1e-5, attn_res_block_size=12, vision=None, dense_activation="situ",
        mla=dict(latent_norm_eps=1e-6), dsa=dict(use_indexer=False),
        moe=dict(activation="situ", situ_beta_gate=4.0, situ_beta_up=25.0, bias_update="quantile"),
    ),
}
