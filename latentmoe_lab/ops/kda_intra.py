"""The intra-chunk half of chunked KDA (ops/kda.py): the decays inside a chunk and the two C x C score matrices.

Everything here is batched over any leading dims ([N, B*H] in kda_chunked); its plain twin is the
per-token recurrence `kda_recurrent`, which tests compare it with.

Decays are products of exp(g_t), never exp() of a positive number: products keep fp32's relative
precision however deep the decay (a difference of two long cumsums would not), and a decay that
underflows to 0 is exact to 1e-38 (g = -1000 resets give exact zeros, never inf or NaN).

Their gradients are taken in log space (`DecayProduct`, `GrownKeys`: d decay / d g_t = +-decay), not by
autograd through exp().cumprod() and a division: d(keys / decay)/d decay = -(keys / decay) / decay reaches
1e40 for a decay of 1e-20, inf in fp32, and inf * 0 is NaN wherever a score is discarded or masked (that
was kda_chunked's NaN gradient of g once a chunk decayed past ~e^-44; docs/design.md §1.3).

Eager, `chunk_decays_and_scores` runs the decays and every chunk's one-block scores as one autograd.Function
(`_ChunkScores`, its backward written out: two bmm and one triangular-matrix suffix sum for all of g's log-space
terms) and halves only the chunks that are not safe, through autograd as before. Its plain twin is
`ChunkDecays` + `intra_chunk_scores` (autograd through DecayProduct, GrownKeys and the products), which the
compiled step keeps (its custom op) and tests/test_kda_intra_function.py compares it with.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import einsum

# A block's own keys are grown by up to 1 / (the block's total decay); past this the block is halved.
SAFE_GROWTH = 1e20
# Blocks this small take every pair's decay directly ([s, s, K] per block) instead of halving further. 4, not 8:
# under the lower-bound gates (g >= -5) an 8-token block decays by at most e^-40, inside SAFE_GROWTH, so it takes
# one grown product; forming its [8, 8, K] pair decays cost 1.8x more at K3's gates (RESULTS.md, issue 44).
PAIRWISE_SIZE = 4


class DecayProduct(torch.autograd.Function):
    """Products of steps = exp(g) ([..., n, K], along n), differentiated in log space with respect to g:

      "prefix"    P_i = prod_{t <= i} steps_t              dL/dg_t = sum_{i >= t} grad_i P_i
      "suffix"    P_i = prod_{t > i} steps_t (1 at n - 1)   dL/dg_t = sum_{i < t} grad_i P_i
      "pairwise"  P_ij = prod_{j < t <= i} steps_t, [..., n, n, K] (1 where i <= j)
                                                           dL/dg_t = sum_{j < t <= i} grad_ij P_ij

    Each grad * P is one bounded score term, so nothing divides by a decay (exp().cumprod()'s own backward
    divides by steps: denormal below g = -87, 0 at resets). steps is g.exp() computed once by the caller;
    no gradient flows through it.
    """

    @staticmethod
    def forward(ctx, g: torch.Tensor, steps: torch.Tensor, kind: str) -> torch.Tensor:
        if kind == "prefix":
            product = steps.cumprod(dim=-2)
        elif kind == "suffix":
            product = _exclusive_suffix_product(steps)
        else:  # a cumprod down i of steps_i placed where i > j
            later = _later(steps.shape[-2], steps.device)
            product = torch.where(later, steps[..., :, None, :], 1.0).cumprod(dim=-3)
        ctx.kind = kind
        ctx.save_for_backward(product)
        return product

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (product,) = ctx.saved_tensors
        terms = grad * product
        if ctx.kind == "prefix":
            return _suffix_sum(terms, dim=-2), None, None
        if ctx.kind == "suffix":
            return F.pad(terms.cumsum(dim=-2)[..., :-1, :], (0, 0, 1, 0)), None, None
        later = _later(product.shape[-2], product.device)  # [s(t), s(j), 1]: pairs (i >= t, j < t)
        return (_suffix_sum(terms, dim=-3) * later).sum(dim=-2), None, None


class GrownKeys(torch.autograd.Function):
    """keys / within.clamp_min(floor), [..., s, K], within the prefix product of the block's steps (not
    differentiated: the gradient goes to the block's log decays g in log space, dL/dg_t = -sum_{j >= t} grad_j
    grown_j). Autograd through the division would form (keys / within) / within, up to 1e40 = inf in fp32 for
    within = 1e-20, and inf * 0 = NaN where a score is discarded. Clamped entries occur only in blocks that are
    not safe, whose scores (and so gradients) are discarded.
    """

    @staticmethod
    def forward(ctx, g: torch.Tensor, keys: torch.Tensor, within: torch.Tensor, floor: float) -> torch.Tensor:
        divisor = within.clamp_min(floor)
        grown = keys / divisor
        ctx.save_for_backward(divisor, grown)
        return grown

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        divisor, grown = ctx.saved_tensors
        return -_suffix_sum(grad * grown, dim=-2), grad / divisor, None, None


class ChunkDecays:
    """g: [..., C, K] log decays of each chunk (Gamma = their cumsum inside the chunk) ->

      g            [..., C, K]  the log decays (what gradients flow to)
      steps        [..., C, K]  exp(g_i), the factors of every product (no gradient of its own)
      from_start   [..., C, K]  exp(Gamma_i), from the chunk start through i
      to_end       [..., C, K]  exp(Gamma_C - Gamma_i), from after i to the chunk end
      whole_chunk  [..., K]     exp(Gamma_C)
    """

    def __init__(self, g: torch.Tensor, steps: torch.Tensor | None = None, from_start: torch.Tensor | None = None,
                 to_end: torch.Tensor | None = None):
        """The products through DecayProduct, or those given (`chunk_decays_and_scores` forms them itself)."""
        self.g = g
        self.steps = g.detach().exp() if steps is None else steps
        self.from_start = DecayProduct.apply(g, self.steps, "prefix") if from_start is None else from_start
        self.to_end = DecayProduct.apply(g, self.steps, "suffix") if to_end is None else to_end
        self.whole_chunk = self.from_start[..., -1, :]


class _ChunkScores(torch.autograd.Function):
    """Every chunk as one block (`_grown_scores` with the chunk's decays) and the decays themselves, in one node:
    q, k, g, steps = exp(g) [F, C, K], beta [F, C] -> (attn [F, 2C, C] masked (qk | A), from_start, to_end).

    Forward, with P = from_start:  R = [q; beta k] * P,  G = k / max(P, 1 / SAFE_GROWTH),  attn = R G^T masked.
    Backward, from dattn (masked), dP and dE (= d to_end):
        dR = dattn G,  dG = dattn^T R     dq = dR_q P,  dk = dR_A P beta + dG / max(P, ..),  dbeta = <dR_A P, k>
        dg_t = sum_{i >= t} [sum_x dR_x R_x - dG G + dP P]_i  +  sum_{i < t} [dE E]_i       (log space, as
    DecayProduct and GrownKeys take them; the two sums are one product with a [C, 2C] 0/1 matrix).
    Scores of chunks that are not safe are meaningless here: the caller overwrites them in place (so their
    gradient arrives here as zeros), and their divisor's clamp never reaches a gradient.
    """

    @staticmethod
    def forward(ctx, q, k, beta, g, steps):
        rows, chunk, dim = q.shape
        from_start, to_end = steps.cumprod(dim=1), _exclusive_suffix_product(steps)
        grown_rows = q.new_empty(rows, 2, chunk, dim)
        torch.mul(q, from_start, out=grown_rows[:, 0])
        torch.mul(k * beta[..., None], from_start, out=grown_rows[:, 1])
        divisor = from_start.clamp_min(1.0 / SAFE_GROWTH)
        grown_keys = k / divisor
        # [F, 2C, C], not a view: the caller views it as [F, 2, C, C] and overwrites unsafe chunks in place
        attn = torch.bmm(grown_rows.view(rows, 2 * chunk, dim), grown_keys.transpose(1, 2))
        _masked(attn.view(rows, 2, chunk, chunk))
        ctx.save_for_backward(k, beta, from_start, to_end, divisor, grown_rows, grown_keys)
        return attn, from_start, to_end

    @staticmethod
    def backward(ctx, grad_attn, grad_from_start, grad_to_end):
        k, beta, from_start, to_end, divisor, grown_rows, grown_keys = ctx.saved_tensors
        rows, chunk, dim = k.shape
        grad_scores = grad_attn.clone(memory_format=torch.contiguous_format)
        _masked(grad_scores.view(rows, 2, chunk, chunk))
        grad_rows = torch.bmm(grad_scores, grown_keys).view(rows, 2, chunk, dim)
        grad_keys = torch.bmm(grad_scores.transpose(1, 2), grown_rows.view(rows, 2 * chunk, dim))
        terms = torch.empty(rows, 2 * chunk, dim, dtype=k.dtype, device=k.device)  # [suffix-summed | prefix-summed]
        later_terms, earlier_terms = terms[:, :chunk], terms[:, chunk:]
        torch.mul(grad_rows[:, 0], grown_rows[:, 0], out=later_terms)
        later_terms.addcmul_(grad_rows[:, 1], grown_rows[:, 1]).addcmul_(grad_from_start, from_start)
        later_terms.addcmul_(grad_keys, grown_keys, value=-1.0)
        torch.mul(grad_to_end, to_end, out=earlier_terms)
        grad_g = torch.matmul(_log_decay_sums(chunk, k.dtype, k.device), terms)
        grad_rows.mul_(from_start[:, None])
        grad_q, grad_beta_keys = grad_rows[:, 0], grad_rows[:, 1]
        grad_beta = (grad_beta_keys * k).sum(-1)
        grad_k = grad_keys.div_(divisor).addcmul_(grad_beta_keys, beta[..., None])
        return grad_q, grad_k, grad_beta, grad_g, None


def chunk_decays_and_scores(q: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor
                            ) -> tuple[ChunkDecays, torch.Tensor, torch.Tensor]:
    """`ChunkDecays(g)` and `intra_chunk_scores` at once: q, k, g [..., C, K], beta [..., C] ->
    (decays, Aqk [..., C, C], diag(beta) A [..., C, C]); the same values, fewer autograd nodes (`_ChunkScores`).

    Under torch.compile it is the two plain calls (the scores as their custom op, see `intra_chunk_scores`).
    """
    if torch.compiler.is_compiling():
        decays = ChunkDecays(g)
        return (decays, *intra_chunk_scores(q, k, beta, decays))
    *lead, chunk, dim = q.shape
    flat_q, keys, flat_g = (t.reshape(-1, chunk, dim) for t in (q, k, g))
    flat_beta, steps = beta.reshape(-1, chunk), flat_g.detach().exp()
    attn, from_start, to_end = _ChunkScores.apply(flat_q, keys, flat_beta, flat_g, steps)
    attn = attn.view(-1, 2, chunk, chunk)
    safe = from_start[:, -1].amin(dim=-1) >= 1.0 / SAFE_GROWTH
    if not bool(safe.all()):
        rows = torch.stack([flat_q, keys * flat_beta[..., None]], dim=1)  # [F, 2, C, K], as _intra_chunk_scores
        _halve_unsafe_chunks(attn, rows, keys, flat_g, steps, (~safe).nonzero().squeeze(1))
    decays = ChunkDecays(g, steps.view(g.shape), from_start.view(g.shape), to_end.view(g.shape))
    attn = attn.reshape(*lead, 2, chunk, chunk)
    return decays, attn[..., 0, :, :], attn[..., 1, :, :]


def intra_chunk_scores(q: torch.Tensor, k: torch.Tensor, beta: torch.Tensor,
                       decays: ChunkDecays) -> tuple[torch.Tensor, torch.Tensor]:
    """Aqk (j <= i) and diag(beta) A (j < i) of every chunk: [..., C, K] inputs, beta [..., C] -> two [..., C, C].

    Under torch.compile the data-dependent halving below (which blocks are safe decides the work) cannot be
    a graph: it runs as one opaque custom op, `latentmoe::kda_intra_chunk_scores`, the same code and bits.
    """
    if torch.compiler.is_compiling():
        return torch.ops.latentmoe.kda_intra_chunk_scores(q, k, beta, decays.g)
    return _intra_chunk_scores(q, k, beta, decays)


def _intra_chunk_scores(q: torch.Tensor, k: torch.Tensor, beta: torch.Tensor,
                        decays: ChunkDecays) -> tuple[torch.Tensor, torch.Tensor]:
    """`intra_chunk_scores`, eager:

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
    keys, g, steps = (t.reshape(-1, chunk, dim) for t in (k, decays.g, decays.steps))
    attn, safe = _grown_scores(rows, keys, g, decays.from_start.reshape(-1, chunk, dim))  # [F, (qk | A), C, C]
    if not bool(safe.all()):
        _halve_unsafe_chunks(attn, rows, keys, g, steps, (~safe).nonzero().squeeze(1))
    attn = attn.reshape(*lead, 2, chunk, chunk)
    return attn[..., 0, :, :], attn[..., 1, :, :]


def _halve_unsafe_chunks(attn: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, g: torch.Tensor,
                         steps: torch.Tensor, unsafe: torch.Tensor) -> None:
    """Overwrite, in place, the scores attn [F, 2, C, C] of the chunks `unsafe` [M] (ids) by halving them (see
    `_intra_chunk_scores`): rows [F, 2, C, K], keys, g and steps [F, C, K], all differentiable where they need be."""
    # Blocks still to halve: (chunk ids [M], start, size). Their entries in attn are overwritten below.
    pending = [(unsafe, 0, attn.shape[-1])]
    while pending:
        ids, start, size = pending.pop()
        half = size // 2
        # (indexing the slice gathers only the block's own rows, not its whole chunk)
        block_rows, block_keys, block_steps = (t[ids, ..., start:start + size, :] for t in (rows, keys, steps))
        # The products never read g in the forward: gather it only where a gradient will flow back to it.
        block_g = g[ids, start:start + size] if g.requires_grad else block_steps
        after_m = DecayProduct.apply(block_g[:, half:], block_steps[:, half:], "prefix")  # from m through i
        before_m = DecayProduct.apply(block_g[:, :half], block_steps[:, :half], "suffix")  # from after j to m
        keys_before = (block_keys[:, :half] * before_m).transpose(-1, -2)[:, None]
        cross = (block_rows[:, :, half:] * after_m[:, None]) @ keys_before  # pairs j < m <= i
        attn[ids, :, start + half:start + size, start:start + half] = cross
        for first, stop in ((0, half), (half, size)):
            part_rows, part_keys = block_rows[:, :, first:stop], block_keys[:, first:stop]
            part_g, part_steps = block_g[:, first:stop], block_steps[:, first:stop]
            where = slice(start + first, start + stop)
            if stop - first <= PAIRWISE_SIZE:  # small enough to form every pair's decay, exactly
                decay = DecayProduct.apply(part_g, part_steps, "pairwise")  # [M, s(i), s(j), K]
                attn[ids, :, where, where] = _masked(einsum(part_rows, decay, part_keys,
                                                            "m x i d, m i j d, m j d -> m x i j"))
                continue
            within = DecayProduct.apply(part_g, part_steps, "prefix")
            scores, safe = _grown_scores(part_rows, part_keys, part_g, within)
            attn[ids[safe], :, where, where] = scores[safe]
            if not bool(safe.all()):
                pending.append((ids[~safe], start + first, stop - first))


# ---- the custom op: forward and backward opaque to torch.compile, fake rules give the [..., C, C] shapes.
# Its backward recomputes the forward with autograd on (the halving's graph is only known at run time), so a
# compiled step pays the intra-chunk scores twice; the eager path keeps its one forward. The recompute is the
# fused `chunk_decays_and_scores` (same values, a written-out backward).

@torch.library.custom_op("latentmoe::kda_intra_chunk_scores", mutates_args=())
def _scores_op(q: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    attn_qk, attn_kk = _intra_chunk_scores(q, k, beta, ChunkDecays(g))
    # views of one buffer: a custom op's outputs may not alias, and must have the fake rule's contiguous strides
    return attn_qk.clone(memory_format=torch.contiguous_format), attn_kk.clone(memory_format=torch.contiguous_format)


@_scores_op.register_fake
def _(q, k, beta, g):
    shape = (*q.shape[:-1], q.shape[-2])
    return q.new_empty(shape), q.new_empty(shape)


@torch.library.custom_op("latentmoe::kda_intra_chunk_scores_backward", mutates_args=())
def _scores_backward_op(q: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                        grad_qk: torch.Tensor, grad_kk: torch.Tensor) -> list[torch.Tensor]:
    inputs = [t.detach().requires_grad_() for t in (q, k, beta, g)]
    # A custom op's kernel runs with autograd's dispatch keys excluded; the recompute needs them back.
    below_autograd = torch._C._dispatch_tls_local_exclude_set()
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                         below_autograd.remove(torch._C.DispatchKey.AutogradCPU)), torch.enable_grad():
        outputs = chunk_decays_and_scores(*inputs)[1:]  # (the fused node: its backward is written out)
        grads = torch.autograd.grad(outputs, inputs, (grad_qk, grad_kk), allow_unused=True)
    return [t.new_zeros(t.shape) if grad is None else grad.contiguous() for t, grad in zip(inputs, grads)]


@_scores_backward_op.register_fake
def _(q, k, beta, g, grad_qk, grad_kk):
    return [t.new_empty(t.shape) for t in (q, k, beta, g)]


def _scores_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _scores_op_backward(ctx, grad_qk, grad_kk):
    q, k, beta, g = ctx.saved_tensors
    shape = (*q.shape[:-1], q.shape[-2])
    grad_qk = q.new_zeros(shape) if grad_qk is None else grad_qk
    grad_kk = q.new_zeros(shape) if grad_kk is None else grad_kk
    return tuple(_scores_backward_op(q, k, beta, g, grad_qk.contiguous(), grad_kk.contiguous()))


_scores_op.register_autograd(_scores_op_backward, setup_context=_scores_setup_context)


def _grown_scores(rows: torch.Tensor, keys: torch.Tensor, g: torch.Tensor,
                  within: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block per chunk, factored through its start: rows [M, 2, s, K], keys and g [M, s, K], within [M, s, K]
    (the decay from the block start through i) -> (masked scores [M, 2, s, s], safe [M] bool).

    Scores of blocks that are not safe (some channel decays past 1 / SAFE_GROWTH) are meaningless.
    """
    size = keys.shape[1]
    safe = within[:, -1].amin(dim=-1) >= 1.0 / SAFE_GROWTH
    grown = GrownKeys.apply(g, keys, within.detach(), 1.0 / SAFE_GROWTH)  # the clamp only touches unsafe blocks
    scores = torch.bmm((rows * within[:, None]).flatten(1, 2), grown.transpose(1, 2)).unflatten(1, (2, size))
    return _masked(scores), safe


def _masked(scores: torch.Tensor) -> torch.Tensor:
    """[M, 2, s, s] diagonal-block scores, in place -> Aqk keeps j <= i, A keeps j < i."""
    size = scores.shape[-1]
    lower = torch.ones(size, size, dtype=torch.bool, device=scores.device).tril()
    keep = torch.stack([lower, lower.tril(-1)])  # [2, s, s]
    return scores.masked_fill_(~keep, 0.0)


def _later(size: int, device: torch.device) -> torch.Tensor:
    """[size(i), size(j), 1] bool, i > j."""
    index = torch.arange(size, device=device)
    return (index[:, None] > index[None, :])[..., None]


def _suffix_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum of the entries from each one to the end along dim (inclusive)."""
    return x.flip(dim).cumsum(dim).flip(dim)


def _exclusive_suffix_product(x: torch.Tensor) -> torch.Tensor:
    """[..., n, K] -> product of the rows after each row (1 for the last), along dim -2."""
    return F.pad(x.flip(-2)[..., :-1, :], (0, 0, 1, 0), value=1.0).cumprod(dim=-2).flip(-2)


def _log_decay_sums(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[size(t), 2 size] 0/1: row t sums the first half's entries i >= t and the second half's i < t."""
    index = torch.arange(size, device=device)
    return torch.cat([index[None, :] >= index[:, None], index[None, :] < index[:, None]], dim=1).to(dtype)
