"""Triton kernels for LatentMoE Lab, importable as `latentmoe_kernels`.

Kernels import only torch and triton. Each kernel family sits beside a plain-PyTorch
reference twin in `latentmoe_lab.ops`, and tests compare the two under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import importlib.util
import os

import torch


def triton_available() -> bool:
    """True when the triton package can be imported (it may still lack a GPU to run on)."""
    return importlib.util.find_spec("triton") is not None


def reject_interpreted_bf16(**tensors: torch.Tensor) -> None:
    """Raise when a bfloat16 tensor would reach tl.dot in triton's interpreter (TRITON_INTERPRET=1).

    The interpreter stores bfloat16 as raw uint16 bits and its tl.dot multiplies those bits
    (triton-lang/triton#11584), so the result would be silently wrong. Compiled kernels are unaffected.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    for name, tensor in tensors.items():
        if tensor.dtype == torch.bfloat16:
            raise TypeError(f"{name}: bfloat16 cannot go through tl.dot in triton's interpreter (it multiplies "
                            f"the raw bits); use float16 or float32 with TRITON_INTERPRET=1")
