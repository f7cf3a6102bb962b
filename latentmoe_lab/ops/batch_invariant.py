"""Batch-invariant mode on the CPU: a token's bits must not depend on who shares its step.

Why: BLAS picks its kernel from the shape. On the CPU this was measured on (torch 2.13's CPU GEMMs), row
and column counts M, N >= 12 give every output element the same bits whatever M and N are, while below
that other kernels sum in another order: M = 1 (a GEMV), M = 2-3, the rows past the last multiple of 4
when M < 12, and N <= 11. In a serving step M is the number of tokens in the step, of one expert's group
or of an attention tile, so a token served alone would round differently from the same token in a busy
step, and greedy picks between near-equal logits would follow the batch.

`batch_invariant_mode()` makes every CPU mm / addmm / bmm / baddbmm pad its rows to at least MIN_ROWS
and its columns to at least MIN_COLS (zeros, sliced off after), for as long as it is entered; the grouped
expert product (ops/routing.py) pads each expert's group, and sigmoid / silu / softplus
(ops/activations.py) take forms that do not depend on an element's place, when `active()`. The products
are otherwise torch's own kernels, so their cost is the padding of tiny products plus a Python call each.
`check_row_invariance()` tests the premise on this machine and raises if it fails.

The override is process-wide while entered (torch.library replaces the CPU kernels), so enter it around
a forward on one thread, as the serving engine does with scheduler.batch_invariant.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

MIN_ROWS = 16  # 12 measured, with a margin
MIN_COLS = 16

_aten = torch.ops.aten
_active = False


def active() -> bool:
    """True inside `batch_invariant_mode()`."""
    return _active


def _pad_rows(a: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """a padded with zero rows along dim to `size` (a contiguous copy)."""
    shape = list(a.shape)
    shape[dim] = size - a.shape[dim]
    return torch.cat([a, a.new_zeros(shape)], dim=dim)


def _padded(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None):
    """Operands of a (batched) product a [.., M, K] @ b [.., K, N] (+ c [.., M, N] or a bias broadcast to it)
    padded to the minimum rows and columns; returns them and the (M, N) to trim the result back to."""
    m, n = a.shape[-2], b.shape[-1]
    if m < MIN_ROWS:
        a = _pad_rows(a, a.dim() - 2, MIN_ROWS)
        if c is not None and c.dim() >= 2 and c.shape[-2] == m and m != 1:  # (a row of 1 broadcasts)
            c = _pad_rows(c, c.dim() - 2, MIN_ROWS)
    if n < MIN_COLS:
        b = _pad_rows(b, b.dim() - 1, MIN_COLS)
        if c is not None and c.dim() >= 1 and c.shape[-1] == n and n != 1:
            c = _pad_rows(c, c.dim() - 1, MIN_COLS)
    return a, b, c, m, n


def _trimmed(out: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """The [.., m, n] result: `out` itself when nothing was padded, else a compact copy of its corner."""
    if out.shape[-2:] == (m, n):
        return out
    return out[..., :m, :n].clone()


def _mm(a, b):
    a, b, _, m, n = _padded(a, b, None)
    return _trimmed(_aten.mm.out(a, b, out=a.new_empty(a.shape[0], b.shape[1])), m, n)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    a, b, bias, m, n = _padded(a, b, bias)
    out = a.new_empty(a.shape[0], b.shape[1])
    return _trimmed(_aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=out), m, n)


def _bmm(a, b):
    a, b, _, m, n = _padded(a, b, None)
    return _trimmed(_aten.bmm.out(a, b, out=a.new_empty(a.shape[0], a.shape[1], b.shape[2])), m, n)


def _baddbmm(c, a, b, *, beta=1, alpha=1):
    a, b, c, m, n = _padded(a, b, c)
    out = a.new_empty(a.shape[0], a.shape[1], b.shape[2])
    return _trimmed(_aten.baddbmm.out(c, a, b, beta=beta, alpha=alpha, out=out), m, n)


@contextlib.contextmanager
def batch_invariant_mode():
    """Inside: CPU mm, addmm, bmm and baddbmm give each output element the bits of a large product, and
    `active()` is True (the grouped product and the activations read it)."""
    global _active
    if _active:  # re-entered (a nested forward): the outer registration holds
        yield
        return
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": the point here
        for name, kernel in (("mm", _mm), ("addmm", _addmm), ("bmm", _bmm), ("baddbmm", _baddbmm)):
            library.impl(name, kernel, "CPU")
    _active = True
    try:
        yield
    finally:
        _active = False
        library._destroy()  # torch's own kernels again


def check_row_invariance(dtype: torch.dtype = torch.float32) -> None:
    """Raise RuntimeError unless, here, a row's product bits are the same for every M >= MIN_ROWS and every
    N >= MIN_COLS (the premise of `batch_invariant_mode`), on the shapes a small model's step meets."""
    generator = torch.Generator().manual_seed(0)
    for k, n in ((16, 16), (64, 100), (256, 512), (512, 2048)):
        a = torch.randn(300, k, generator=generator).to(dtype)
        b = torch.randn(k, n, generator=generator).to(dtype)
        reference = a @ b
        for rows, cols in ((MIN_ROWS, n), (MIN_ROWS + 3, n), (64, n), (300, MIN_COLS), (33, 37)):
            if not torch.equal(a[:rows] @ b[:, :cols], reference[:rows, :cols]):
                raise RuntimeError(
                    f"scheduler.batch_invariant: this machine's {dtype} GEMM gives a row other bits at "
                    f"M={rows}, N={cols} than at M=300, N={n} (K={k}); batch-invariant serving needs "
                    f"M >= {MIN_ROWS} and N >= {MIN_COLS} to be one kernel class (ops/batch_invariant.py)")
