"""Tie-aware comparison of greedy tokens between a layout and the single-process reference.

Two runs whose logits agree to float rounding can still pick different greedy tokens when the
reference's two best tokens are nearly tied: logits within eps of each other elementwise can only
swap an argmax whose margin is below 2 * eps. Near-ties in the indexer's top-k make this happen at
long prompts (thousands of tokens), and even in one process when the batch size changes, because
the partial sums are added in another order.

So the check finds, per row, the first generated position where the two disagree, and reads the
reference's own logits there (the ones that chose its token):

    margin = reference_logit[reference token] - reference_logit[layout token]    (>= 0 for greedy)

A difference counts as a tie when margin <= tie_margin (a stated tolerance, in logit units), and the
rest of that row is not compared (the two continuations have different prefixes from there on).
Tokens "match" when every row is equal or differs first at a tie.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TIE_MARGIN = 1e-4  # logits agree to ~1e-5 in these checks; 1e-4 leaves room for decode steps


@dataclass(frozen=True)
class TokenDifference:
    """The first generated position where a row differs, and the reference's margin between the two tokens."""

    row: int
    step: int  # 0-based index among the generated tokens
    reference_token: int
    layout_token: int
    margin: float
    is_tie: bool

    def describe(self) -> str:
        verdict = "a tie" if self.is_tie else "not a tie"
        return (f"row {self.row} step {self.step}: token {self.layout_token} instead of {self.reference_token}, "
                f"reference margin {self.margin:.2e} ({verdict})")


def first_differences(reference_tokens: torch.Tensor, tokens: torch.Tensor, step_logits: torch.Tensor,
                      prompt_len: int, tie_margin: float = TIE_MARGIN) -> list[TokenDifference]:
    """Per row, the first generated token that differs; rows that are equal give nothing.

    reference_tokens, tokens: [B, prompt_len + n] int64 (prompt + greedy tokens).
    step_logits: [B, n, vocab], the reference's logits that chose generated token j at [:, j].
    """
    if reference_tokens.shape != tokens.shape:
        raise ValueError(f"tokens: expected shape {tuple(reference_tokens.shape)} like the reference, "
                         f"got {tuple(tokens.shape)}")
    generated = reference_tokens.shape[1] - prompt_len
    if step_logits.dim() != 3 or tuple(step_logits.shape[:2]) != (reference_tokens.shape[0], generated):
        raise ValueError(f"step_logits: expected [B={reference_tokens.shape[0]}, n={generated}, vocab], "
                         f"got {tuple(step_logits.shape)}")
    if not tie_margin >= 0:
        raise ValueError(f"tie_margin: must be >= 0, got {tie_margin!r}")
    differences = []
    differs = reference_tokens[:, prompt_len:] != tokens[:, prompt_len:]
    for row in differs.any(dim=1).nonzero().flatten().tolist():
        step = int(differs[row].nonzero()[0])
        ref_token, got_token = int(reference_tokens[row, prompt_len + step]), int(tokens[row, prompt_len + step])
        logits = step_logits[row, step].float()
        margin = float(logits[ref_token] - logits[got_token])
        differences.append(TokenDifference(row, step, ref_token, got_token, margin, margin <= tie_margin))
    return differences


@torch.no_grad()
def reference_step_logits(model, reference_tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[B, n, vocab]: one teacher-forced forward over prompt + generated tokens, the logits before each one."""
    logits = model(reference_tokens[:, :-1]).logits
    return logits[:, prompt_len - 1:]


def parity_line(differences: list[dict] | list[TokenDifference], tie_margin: float) -> str:
    """'generated tokens equal: True' or the first difference and whether it is within the tie tolerance."""
    items = [d if isinstance(d, TokenDifference) else TokenDifference(**d) for d in differences]
    if not items:
        return "generated tokens equal: True"
    real = [d for d in items if not d.is_tie]
    head = "differ" if real else "equal up to near-ties"
    shown = (real or items)[0]
    return (f"generated tokens {head} (tie-aware check: a difference is a tie when the reference's logit margin "
            f"between the two tokens is <= {tie_margin:.0e}; {len(items)} row(s) differ, {len(real)} not at a tie; "
            f"{shown.describe()})")
