"""Small random transformers checkpoints for the interop tests: built with transformers' own classes, given O(1)
weights (its 0.02 init makes every logit nearly equal, so a wrong mapping would hide), saved with save_pretrained.
"""
from __future__ import annotations

import math

import torch

VOCAB = 97

# Several kimi_linear layer patterns: 1-based KDA / full-attention lists, dense prefix, q LoRA, and the
# tie_word_embeddings flag (which transformers' kimi_linear ignores: it always keeps its own LM head).
KIMI_CASES = {
    "kda-mla-kda": dict(kda=[1, 3], full=[2], first_dense=1, q_lora=None, tie=False, n_group=2, topk_group=1),
    "mla-first": dict(kda=[2, 3], full=[1, 4], first_dense=0, q_lora=12, tie=False, n_group=1, topk_group=1),
    "mla-last-tie-flag": dict(kda=[1, 2], full=[3], first_dense=2, q_lora=None, tie=True, n_group=1, topk_group=1),
}


def kimi_config(case: str):
    from transformers import KimiLinearConfig

    c = KIMI_CASES[case]
    layers = len(c["kda"]) + len(c["full"])
    return KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=c["q_lora"], qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, num_local_experts=6, num_experts_per_tok=2, n_group=c["n_group"],
        topk_group=c["topk_group"], n_shared_experts=1, routed_scaling_factor=1.7, tie_word_embeddings=c["tie"],
        linear_attn_config={"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 4, "kda_layers": c["kda"],
                            "full_attn_layers": c["full"]},
        first_k_dense_replace=c["first_dense"], pad_token_id=None, bos_token_id=None, eos_token_id=None,
        max_position_embeddings=512)


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """O(1) activations: matrices ~ N(0, 1/fan_in), norm weights near 1, routing biases of a few tenths.
    A_log and dt_bias keep transformers' initialisation (the decay rates it trains from)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not tensor.is_floating_point() or "A_log" in name or "dt_bias" in name:
                continue
            if "e_score_correction_bias" in name:
                tensor.copy_(0.3 * torch.randn(tensor.shape, generator=g))
            elif tensor.dim() == 1:
                tensor.copy_(1 + 0.2 * torch.randn(tensor.shape, generator=g))
            elif "embed_tokens" in name:
                tensor.copy_(torch.randn(tensor.shape, generator=g))
            else:
                # the last dim is the input width of Linear weights, packed experts and the depthwise conv alike
                tensor.copy_(torch.randn(tensor.shape, generator=g) / math.sqrt(tensor.shape[-1]))
    return model


def save_kimi(case: str, directory, seed: int = 0):
    """A random kimi_linear model of `case`, saved by transformers into `directory`; returns the model (fp32, eval)."""
    from transformers import KimiLinearForCausalLM

    torch.manual_seed(seed)
    model = randomize(KimiLinearForCausalLM(kimi_config(case)), seed).eval()
    model.save_pretrained(directory)
    return model


def ragged_batch(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids [B, max(lengths)] and their attention mask (1 on real tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=g)
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def assert_relative_close(ours: torch.Tensor, theirs: torch.Tensor, rtol: float = 1e-5) -> None:
    """max |ours - theirs| <= rtol * max |theirs|."""
    error = (ours.double() - theirs.double()).abs().max().item()
    scale = theirs.double().abs().max().item()
    assert error <= rtol * scale, f"max error {error:.3g} > {rtol} x max |logit| {scale:.3g}"
