"""The intra-chunk half of chunked KDA (ops/kda.py): the decays inside a chunk and the two C x C score matrices.

Everything here is batched over any leading dims ([N, B*H] in kda_chunked); its plain twin is the
per-token recurrence `kda_recurrent`, which tests compare it with.

Decays are products of exp(g_t), never exp() of a positive number: products keep fp32's relative
precision however deep the decay (a difference of two long cumsums would not), and a decay that
underflows to 0 is exact to 1e-38 (g = -1000 resets give exact zeros, never inf or NaN).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import einsum

# A block's own keys are grown by up to 1 / (the block's total decay); past this the block is halved.
SAFE_GROWTH = 1e20
# Blocks this small take every pair's decay directly ([s, s, K] per block) instead of halving further.
PAIRWISE_SIZE = 8


class ChunkDecays:
    """g: [..., C, K] log decays of each chunk (Gamma = their cumsum inside the chunk) ->

      steps        [..., C, K]  exp(g_i)
      from_start   [..., C, K]  exp(Gamma_i), from the chunk start through i
      to_end       [..., C, K]  exp(Gamma_C - Gamma_i), from after i to the chunk end
      whole_chunk  [..., K]     exp(Gamma_C)
    """

    def __init__(self, g: torch.Tensor):
        self.steps = g.exp()
        self.from_start = self.steps.cumprod(dim=-2)
        self.to_end = _exclusive_suffix_product(self.steps)
        self.whole_chunk = self.from_start[..., -1, :]


def intra_chunk_scores(q: torch.Tensor, k: torch.Tensor, beta: torch.Tensor,
                       decays: ChunkDecays) -> tuple[torch.Tensor, torch.Tensor]:
    """Aqk (j <= i) and diag(beta) A (j < i) of every chunk: [..., C, K] inputs, beta [..., C] -> two [..., C, C].

    Both are sum_d row_id k_jd exp(Gamma_id - Gamma_jd), with row = q for Aqk and beta k for A. A block
    of positions [a, b) takes all its pairs in one matrix product, factored through its start:
        row_i exp(Gamma_i - Gamma_a)  .  k_j / exp(Gamma_j - Gamma_a)
    The key side grows up to 1 / (the block's total decay), so that is done only where every channel
    keeps more than 1 / SAFE_GROWTH. Any other block is halved at m: its cross pairs (j < m <= i)
    factor through m with both sides <= 1, row_i exp(Gamma_i - Gamma_m) . k_j exp(Gamma_m - Gamma_j),
    and each half is handled the same way, down to PAIRWISE_SIZE tokens, where every pair's decay is
    formed directly. Mild gates cost one product per chunk; a hard reset, a few halvings around it.
    """
    *lead, chunk, dim = q.shape
    rows = torch.stack([q, k * beta[..., None]], dim=-3).reshape(-1, 2, chunk, dim)  # [F, 2, C, K]
    keys, steps = k.reshape(-1, chunk, dim), decays.steps.reshape(-1, chunk, dim)
    attn, safe = _grown_scores(rows, keys, decays.from_start.reshape(-1, chunk, dim))  # [F, (qk | A), C, C]
    # Blocks still to halve: (chunk ids [M], start, size). Their entries in attn are overwritten below.
    pending = [] if bool(safe.all()) else [((~safe).nonzero().squeeze(1), 0, chunk)]
    while pending:
        ids, start, size = pending.pop()
        half = size // 2
        block_rows, block_keys, block_steps = (t[ids][..., start:start + size, :] for t in (rows, keys, steps))
        rows_after = block_rows[:, :, half:] * block_steps[:, None, half:].cumprod(dim=-2)  # from m through i
        keys_before = block_keys[:, :half] * _exclusive_suffix_product(block_steps[:, :half])  # from after j to m
        cross = rows_after @ keys_before.transpose(-1, -2)[:, None]  # pairs j < m <= i
        attn[ids, :, start + half:start + size, start:start + half] = cross
        for first, stop in ((0, half), (half, size)):
            part_rows, part_keys = block_rows[:, :, first:stop], block_keys[:, first:stop]
            part_steps, where = block_steps[:, first:stop], slice(start + first, start + stop)
            if stop - first <= PAIRWISE_SIZE:  # small enough to form every pair's decay, exactly
                attn[ids, :, where, where] = _pairwise_scores(part_rows, part_keys, part_steps)
                continue
            scores, safe = _grown_scores(part_rows, part_keys, part_steps.cumprod(dim=-2))
            attn[ids[safe], :, where, where] = scores[safe]
            if not bool(safe.all()):
                pending.append((ids[~safe], start + first, stop - first))
    attn = attn.reshape(*lead, 2, chunk, chunk)
    return attn[..., 0, :, :], attn[..., 1, :, :]


def _grown_scores(rows: torch.Tensor, keys: torch.Tensor, within: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block per chunk, factored through its start: rows [M, 2, s, K], keys [M, s, K], within [M, s, K]
    (the decay from the block start through i) -> (masked scores [M, 2, s, s], safe [M] bool).

    Scores of blocks that are not safe (some channel decays past 1 / SAFE_GROWTH) are meaningless.
    """
    size = keys.shape[1]
    safe = within[:, -1].amin(dim=-1) >= 1.0 / SAFE_GROWTH
    grown = keys / within.clamp_min(1.0 / SAFE_GROWTH)  # the clamp only touches blocks that are not safe
    scores = torch.bmm((rows * within[:, None]).flatten(1, 2), grown.transpose(1, 2)).unflatten(1, (2, size))
    return _masked(scores), safe


def _pairwise_scores(rows: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """rows [M, 2, s, K], keys and steps [M, s, K] -> [M, 2, s, s] with the decay of every pair j <= i.

    decay[i, j] = prod_{j < t <= i} steps_t: a cumprod down i of steps_i placed where i > j (1 elsewhere).
    """
    size = steps.shape[1]
    index = torch.arange(size, device=steps.device)
    later = (index[:, None] > index[None, :])[..., None]  # [s(i), s(j), 1]
    decay = torch.where(later, steps[:, :, None, :], torch.ones_like(steps[:, :1, None, :])).cumprod(dim=1)
    return _masked(einsum(rows, decay, keys, "m x i d, m i j d, m j d -> m x i j"))


def _masked(scores: torch.Tensor) -> torch.Tensor:
    """[M, 2, s, s] diagonal-block scores, in place -> Aqk keeps j <= i, A keeps j < i."""
    size = scores.shape[-1]
    lower = torch.ones(size, size, dtype=torch.bool, device=scores.device).tril()
    keep = torch.stack([lower, lower.tril(-1)])  # [2, s, s]
    return scores.masked_fill_(~keep, 0.0)


def _exclusive_suffix_product(x: torch.Tensor) -> torch.Tensor:
    """[..., n, K] -> product of the rows after each row (1 for the last), along dim -2."""
    return F.pad(x.flip(-2)[..., :-1, :], (0, 0, 1, 0), value=1.0).cumprod(dim=-2).flip(-2)
