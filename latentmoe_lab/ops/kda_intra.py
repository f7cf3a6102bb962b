"""The intra-chunk half of chunked KDA (ops/kda.py): the decays inside a chunk and the two C x C score matrices.

Everything here is batched over any leading dims ([N, B*H] in kda_chunked) and has a plain twin: the
per-token recurrence `kda_recurrent`, which tests compare it with.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import einsum, rearrange

# A sub-chunk's own keys are grown by up to 1 / (its total decay); beyond this the pairwise form takes over.
SAFE_GROWTH = 1e20


class ChunkDecays:
    """Every decay the chunked form needs, as products of exp(g): no exp() of a positive number.

    g: [..., C, K] log decays per chunk, C = S sub-chunks of c tokens. Products keep fp32's relative
    precision at any depth of decay (a difference of two long cumsums would not), and a decay that
    underflows to 0 is exact to 1e-38. With Gamma the cumsum of g inside the chunk:

      within       [..., S, c, K]  exp(Gamma_i - Gamma_start(a)), from sub-chunk a's start through i (<= 1)
      after        [..., S, c, K]  exp(Gamma_end(a) - Gamma_i), from after i to the end of a (<= 1)
      totals       [..., S, K]     exp(Gamma_end(a) - Gamma_start(a)), all of sub-chunk a
      from_start   [..., C, K]     exp(Gamma_i), from the chunk start through i
      to_end       [..., C, K]     exp(Gamma_C - Gamma_i), from after i to the chunk end
      whole_chunk  [..., K]        exp(Gamma_C)
    """

    def __init__(self, g: torch.Tensor, sub: int):
        self.sub = sub
        steps = rearrange(g.exp(), "... (s c) d -> ... s c d", c=sub)
        self.within = steps.cumprod(dim=-2)
        self.after = _exclusive_suffix_product(steps)
        self.totals = self.within[..., -1, :]
        before_sub = _exclusive_prefix_product(self.totals)
        self.from_start = rearrange(before_sub[..., None, :] * self.within, "... s c d -> ... (s c) d")
        self.to_end = rearrange(_exclusive_suffix_product(self.totals)[..., None, :] * self.after,
                                "... s c d -> ... (s c) d")
        self.whole_chunk = before_sub[..., -1, :] * self.totals[..., -1, :]

    def before(self, sub_chunk: int) -> torch.Tensor:
        """[..., sub_chunk, K]: exp(Gamma_start(sub_chunk) - Gamma_end(b)) for each earlier sub-chunk b (<= 1)."""
        spans = self.totals[..., 1:sub_chunk, :].flip(-2)  # the sub-chunks in between, nearest first
        ones = torch.ones_like(self.totals[..., :1, :])
        return _exclusive_prefix_product(torch.cat([spans, ones], dim=-2)).flip(-2) if sub_chunk else spans


def intra_chunk_scores(q: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                        decays: ChunkDecays) -> tuple[torch.Tensor, torch.Tensor]:
    """Aqk (j <= i) and diag(beta) A (j < i) of every chunk: [..., C, K] inputs -> two [..., C, C].

    Both are sum_d row_id k_jd exp(Gamma_id - Gamma_jd), with row = q for Aqk and beta k for A,
    factored through the start of i's sub-chunk a so that a matrix product does all pairs:
        row side  row_i exp(Gamma_i - Gamma_start(a))                       <= 1
        key side  k_j exp(Gamma_start(a) - Gamma_j)                         <= 1 for j before a,
                  k_j after_j / totals_a  (= k_j / within_j)                >= 1 for j inside a.
    The last factor is at most 1 / totals_a, so it is used only where every channel of the
    sub-chunk keeps more than 1 / SAFE_GROWTH; the diagonal blocks of the other sub-chunks
    (hard resets, g = -1000) take their pairwise decays directly (`_unsafe_diagonal_blocks`).
    """
    sub, chunk = decays.sub, q.shape[-2]
    split = lambda t: rearrange(t, "... (s c) d -> ... s c d", c=sub)  # noqa: E731
    rows = torch.stack([split(q), split(k * beta[..., None])], dim=-3) * decays.within[..., None, :, :]
    rows = rearrange(rows, "... s x c d -> ... s (x c) d")  # [..., S, 2c, K]: q rows, then beta k rows
    keys = split(k) * decays.after  # decayed to the end of their own sub-chunk
    safe = decays.totals.amin(dim=-1) >= 1.0 / SAFE_GROWTH  # [..., S]
    # 1 / totals where safe, else 0 (the clamp keeps a 1/0 out of the gradient).
    growth = decays.totals.clamp_min(1.0 / SAFE_GROWTH).reciprocal() * safe[..., None]
    fixes = None if safe.all() else _unsafe_diagonal_blocks(q, k, beta, g, safe, sub)

    causal = torch.ones(sub, sub, dtype=torch.bool, device=q.device).tril()
    keep = torch.cat([causal, causal.tril(-1)])  # [2c, c]: Aqk keeps i = j, A does not
    attn = q.new_zeros(*q.shape[:-2], 2, chunk, chunk)  # [..., (qk | A), C(i), C(j)]
    for a in range(chunk // sub):
        factors = torch.cat([decays.before(a), growth[..., a:a + 1, :]], dim=-2)  # [..., a + 1, K]
        keys_a = rearrange(factors[..., None, :] * keys[..., :a + 1, :, :], "... b j d -> ... (b j) d")
        block = rows[..., a, :, :] @ keys_a.transpose(-1, -2)  # [..., 2c, (a + 1) c]
        diagonal = block[..., a * sub:]
        if fixes is not None:
            diagonal += fixes[..., a, :, :]
        diagonal.masked_fill_(~keep, 0.0)
        attn[..., :, a * sub:(a + 1) * sub, :(a + 1) * sub] = rearrange(block, "... (x i) j -> ... x i j", x=2)
    return attn[..., 0, :, :], attn[..., 1, :, :]


def _unsafe_diagonal_blocks(q: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                            safe: torch.Tensor, sub: int) -> torch.Tensor:
    """The diagonal blocks of Aqk and diag(beta) A for sub-chunks where `safe` is False, zero elsewhere.

    q, k, g: [..., C, K]; beta: [..., C]; safe: [..., S]  ->  [..., S, 2c, c] fp32. The pairwise decays
    [c, c, K] of each unsafe sub-chunk come from an fp64 cumsum, later position first, so every exp()
    argument is <= 0 (g = -1000 gives exact zeros).
    """
    picked = (~safe).flatten().nonzero().squeeze(1)
    q_sub, k_sub, g_sub = (rearrange(t, "... (s c) d -> (... s) c d", c=sub)[picked] for t in (q, k, g))
    beta_sub = rearrange(beta, "... (s c) -> (... s) c", c=sub)[picked]
    gamma = g_sub.double().cumsum(dim=-2)  # [M, c, K]
    causal = torch.ones(sub, sub, dtype=torch.bool, device=k.device).tril()[..., None]
    pairwise = (gamma[:, :, None, :] - gamma[:, None, :, :]).masked_fill(~causal, float("-inf")).exp().float()
    rows = torch.cat([q_sub, k_sub * beta_sub[..., None]], dim=-2)  # [M, 2c, K]
    blocks = q.new_zeros(safe.numel(), 2 * sub, sub)
    blocks[picked] = einsum(rows, torch.cat([pairwise, pairwise], dim=1), k_sub, "m i d, m i j d, m j d -> m i j")
    return blocks.view(*safe.shape, 2 * sub, sub)


def _exclusive_prefix_product(x: torch.Tensor) -> torch.Tensor:
    """[..., n, K] -> product of the rows before each row (1 for the first), along dim -2."""
    return F.pad(x[..., :-1, :], (0, 0, 1, 0), value=1.0).cumprod(dim=-2)


def _exclusive_suffix_product(x: torch.Tensor) -> torch.Tensor:
    """[..., n, K] -> product of the rows after each row (1 for the last), along dim -2."""
    return _exclusive_prefix_product(x.flip(-2)).flip(-2)


def sub_chunk_size(chunk_size: int) -> int:
    """The largest divisor of chunk_size not above 16 (4 sub-chunks of a 64-token chunk; a prime C > 16 gets 1)."""
    return max(d for d in range(1, min(chunk_size, 16) + 1) if chunk_size % d == 0)
