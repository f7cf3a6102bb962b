"""The reference path of `latentmoe-lab verify`: the model alone, no engine, no cache reuse (docs/design.md §19).

For each prompt, the greedy tokens come from `model.generate` (one prefill, then token by token over the
contiguous HybridCache), and the logprob of every generated token from ONE full forward over prompt +
those tokens (no cache at all). Two independent computations, so a bug shared by the engine and the
reference cache would still show up as a gap between the engine's logprobs and the full forward's.

    reference_outputs(model, prompts, max_tokens) -> [Reference(tokens [n], logprobs [n])]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Reference:
    """What the engine must reproduce for one prompt: greedy tokens and their logprobs (fp32 full forward)."""

    tokens: list[int]
    logprobs: list[float]


@torch.no_grad()
def reference_outputs(model, prompts: list[list[int]], max_tokens: int) -> list[Reference]:
    """prompts: token-id lists (any lengths) -> one Reference per prompt, `max_tokens` greedy tokens each."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1 to compare generated tokens, got {max_tokens}")
    references = []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.int64)
        tokens = model.generate(ids, max_new_tokens=max_tokens)[0, len(prompt):].tolist()
        references.append(Reference(tokens, full_forward_logprobs(model, prompt, tokens)))
    return references


@torch.no_grad()
def full_forward_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """log p(tokens[i] | prompt + tokens[:i]) for every i, from one forward without a cache: [len(tokens)]."""
    ids = torch.tensor([prompt + tokens], dtype=torch.int64)
    logits = model(ids).logits[0, len(prompt) - 1: len(prompt) + len(tokens) - 1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
