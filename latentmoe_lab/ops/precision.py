"""The compute dtype of the numerically sensitive steps: at least fp32, fp64 when the input is fp64.

bf16 / fp16 inputs are upcast to fp32 (norms, decay gates); fp64 stays fp64, so a float64 run is a
float64 reference end to end (the native layouts are checked against one process that way).
"""
import torch


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))
