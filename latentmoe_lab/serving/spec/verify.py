"""Verification: which drafts a sequence keeps after a verify step, and the token after them (docs/design.md §12).

A verify step ran a sequence's newest token x0 and its drafts d_1 .. d_k through the target in one forward;
rows [k + 1, vocab] are the target's logits there: row t follows x0, d_1 .. d_t. The step emits the
accepted drafts and then one token more, so at least one token per step whatever the drafts:

  greedy    d_{t+1} is accepted while it equals the target's pick at row t; the pick at the first
            mismatch (or at row k once all are accepted: the bonus token) is emitted too. The tokens are
            exactly those of plain decoding, one pick per row.
  sampling  the speculative sampling rule (Leviathan et al. 2023; Chen et al. 2023): accept d ~ q with
            probability min(1, p(d) / q(d)); on a rejection draw from norm(max(0, p - q)) and stop; after
            k acceptances draw the bonus from row k. Every emitted token is then distributed as the
            target's own sampling would give it (tests/test_spec_engine_sampling.py checks it with chi-square).

p is serving/sampling.target_probs of the row, with the penalties over the request's generated tokens and
the ones emitted before it in this step; draws use the request's own generator. Both drafters here are
greedy, so q is one-hot at the draft: accept with probability p(d), the residual is p without d.
"""
from __future__ import annotations

import torch

from latentmoe_lab.serving.sampling import SamplingParams, greedy_token, target_probs


def verify_drafts(rows: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator,
                  generated: list[int]) -> list[int]:
    """rows [len(drafts) + 1, vocab] fp32 -> the emitted tokens: the accepted drafts, then one more.

    With no drafts this is one ordinary sample (the same draws as sample_token)."""
    if rows.dim() != 2 or rows.shape[0] != len(drafts) + 1:
        raise ValueError(f"rows: expected [len(drafts) + 1 = {len(drafts) + 1}, vocab], got {tuple(rows.shape)}")
    history, emitted = list(generated), []
    for t, row in enumerate(rows):
        if params.greedy:
            token = greedy_token(row, params, history)
            accepted = t < len(drafts) and token == drafts[t]
        else:
            p = target_probs(row, params, history)
            if t == len(drafts):
                token, accepted = int(torch.multinomial(p, 1, generator=generator)), False
            else:
                token, accepted = rejection_step(p, one_hot(drafts[t], p.shape[-1]), drafts[t], generator)
        emitted.append(token)
        if not accepted:
            return emitted
        history.append(token)
    raise AssertionError("unreachable: the last row never accepts")


def rejection_step(p: torch.Tensor, q: torch.Tensor, draft: int, generator: torch.Generator) -> tuple[int, bool]:
    """p, q [vocab]: the target's and the drafter's distributions, draft drawn from q -> (token, accepted).

    Accepted with probability min(1, p(d) / q(d)): the draft itself. Otherwise a draw from
    norm(max(0, p - q)). Over the draft's randomness the token is distributed as p."""
    if not q[draft] > 0:
        raise ValueError(f"draft: token {draft} has probability {float(q[draft])} under q; a draft must be drawn "
                         "from q")
    if float(torch.rand((), generator=generator)) * float(q[draft]) < float(p[draft]):
        return draft, True
    residual = (p - q).clamp_min(0)
    if not float(residual.sum()) > 0:  # p <= q everywhere means p == q: the rejection has probability 0
        residual = p
    return int(torch.multinomial(residual / residual.sum(), 1, generator=generator)), False


def one_hot(token: int, vocab: int) -> torch.Tensor:
    """A deterministic drafter's q [vocab] fp32: all mass on its draft."""
    q = torch.zeros(vocab, dtype=torch.float32)
    q[token] = 1.0
    return q
