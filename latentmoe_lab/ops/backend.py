"""Which implementation runs behind an op: the PyTorch reference ("torch") or a Triton kernel ("triton").

Ops that have a kernel in `latentmoe_kernels` take `backend="auto" | "torch" | "triton"` and call
`resolve_backend` first:

- "torch" always runs the reference.
- "auto" runs the kernel only for CUDA tensors in fp32 / bf16 / fp16 that need no gradient (the
  kernels are forward-only), with triton importable, and the reference everywhere else, silently: a
  CPU machine with triton installed behaves like one without it.
- "triton" insists on the kernel; fp64 inputs or inputs that need a gradient raise. On CPU tensors it
  needs TRITON_INTERPRET=1 (set before triton is imported), which runs the kernel in triton's
  interpreter, the way the tests check kernels on CPU.

Nothing here imports triton unless CUDA tensors ask for it, so the package works without triton.
"""
from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "torch", "triton")
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, *tensors: torch.Tensor | None) -> str:
    """Return "torch" or "triton" for an op called on `tensors` (None entries are skipped)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of 'auto', 'torch', 'triton', got {backend!r}")
    if backend == "torch":
        return "torch"
    present = [t for t in tensors if t is not None]
    on_cuda = bool(present) and all(t.is_cuda for t in present)
    other_dtypes = sorted({str(t.dtype) for t in present if t.is_floating_point() and t.dtype not in _KERNEL_DTYPES})
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in present)
    if backend == "auto":
        return "triton" if on_cuda and not other_dtypes and not needs_grad and _triton_importable() else "torch"
    if other_dtypes:
        raise TypeError(f"backend: 'triton' kernels take float32, bfloat16 or float16 tensors, got {other_dtypes}")
    if needs_grad:
        raise ValueError("backend: the 'triton' kernels are forward-only; call them under torch.no_grad() "
                         "or use backend='torch' where gradients are needed")
    if not _triton_importable():
        raise ValueError("backend: 'triton' needs the triton package (pip install 'latentmoe-lab[kernels]')")
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend: 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 (set before triton is "
                         "imported) to run the kernels on CPU in triton's interpreter")
    return "triton"
