"""Logprobs of chosen tokens and their most likely alternatives (docs/design.md §6.6).

The logprob of token t at a position is log_softmax(logits)[t] of the raw model logits there (fp32),
before the request's temperature, penalties, bias and top-k / top-p: what the public OpenAI-compatible
servers return by default, and what an evaluation harness needs to score text.

    generated token i   the logits row the engine sampled it from
    prompt token j >= 1 the logits at prompt position j - 1 (the prompt's first token has none)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there, its logprob, and the k most likely (id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """logits [R, vocab] (any float dtype), token_ids [R] -> one TokenLogprob per row, with k alternatives."""
    if logits.shape[0] == 0:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(token_ids, dtype=torch.int64, device=logp.device)[:, None])[:, 0].tolist()
    if k == 0:
        return [TokenLogprob(t, lp) for t, lp in zip(token_ids, chosen)]
    values, indices = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    return [TokenLogprob(t, lp, tuple(zip(ids, vals)))
            for t, lp, ids, vals in zip(token_ids, chosen, indices.tolist(), values.tolist())]
