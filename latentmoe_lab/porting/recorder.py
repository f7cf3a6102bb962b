"""Record what a forward dispatches: every op, the module it came from, shapes, dtypes, FLOPs and bytes.

    with ModuleTracker(model) as tracker, DispatchRecorder(tracker) as recorder:
        model(input_ids)
    recorder.calls      # [OpCall], in dispatch order

FLOPs come from torch.utils.flop_counter's registry (porting/flops.py adds our custom ops'). Bytes: each
input read once and each output written once, views free; ops that touch only part of an input (gathers,
the grouped GEMM, sparse attention) count the rows they use (`BYTES_READ`). On the meta device `bincount`
(expert counts, whose size depends on values) is answered by its minlength.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from latentmoe_lab.porting import flops as _flops  # noqa: F401  (registers the custom ops' FLOP formulas)
from latentmoe_lab.porting.module_path import ModuleTracker


def op_name(func) -> str:
    """torch.ops.aten.mm.default -> "aten.mm"; custom ops keep their namespace ("latentmoe.kda_chunk")."""
    return func._overloadpacket._qualified_op_name.replace("::", ".")


def tensors_of(tree) -> list[torch.Tensor]:
    """The tensors in a nest of args / kwargs / outputs."""
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(tensors) -> int:
    unique = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def op_flops(func, args, kwargs, out) -> int:
    """FLOPs of one call from flop_counter's registry (ours included); 0 for ops it has no formula for."""
    formula = flop_registry.get(func._overloadpacket)
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


def _gathered(out, *indices) -> int:
    """A gather reads the rows it returns (and its indices), not the whole table."""
    return _nbytes(tensors_of(out)) + _nbytes([i for i in indices if isinstance(i, torch.Tensor)])


def _grouped_read(x, w, offsets, *rest) -> int:
    """A grouped GEMM reads x and the weights of at most min(E, M) experts (the ones that got rows)."""
    experts = w.shape[0]
    return _nbytes([x, offsets]) + w.numel() * w.element_size() * min(experts, x.shape[0]) // experts


def _sparse_attention_read(q, k, v, indices, *rest) -> int:
    """q, the indices and the selected key / value rows (one gather when v is k's leading channels)."""
    rows = indices.numel() * k.shape[2]
    value_is_key = v._base is not None and v._base is (k._base if k._base is not None else k)
    return _nbytes([q, indices]) + rows * k.element_size() * (k.shape[-1] + (0 if value_is_key else v.shape[-1]))


# Bytes read by ops that touch only part of an input; every other op reads each input once.
BYTES_READ = {
    "aten.embedding": lambda out, weight, indices, *rest: _gathered(out, indices),
    "aten.index_select": lambda out, x, dim, index: _gathered(out, index),
    "aten.gather": lambda out, x, dim, index, *rest: _gathered(out, index),
    "aten.index": lambda out, x, indices: _gathered(out, *indices),
    "latentmoe.grouped_matmul": lambda out, *args: _grouped_read(*args),
    "latentmoe.grouped_swiglu": lambda out, *args: _grouped_read(*args),
    "latentmoe.sparse_attention": lambda out, *args: _sparse_attention_read(*args),
}


def bytes_read(name: str, func, args, kwargs, out) -> int:
    if func.is_view:
        return 0
    partial = BYTES_READ.get(name)
    if partial is None:
        return _nbytes(tensors_of((args, kwargs)))
    return partial(out, *args, **{k: v for k, v in kwargs.items() if k != "out"})  # an out= op's result is `out`


@dataclass
class OpCall:
    """One dispatched op: where it ran, what it was called with, its cost."""

    path: str
    op: str
    shapes: tuple
    dtypes: tuple
    flops: int
    bytes_read: int
    bytes_written: int


class DispatchRecorder(TorchDispatchMode):
    """Record every op dispatched inside the block (with the module path `tracker` reports)."""

    def __init__(self, tracker: ModuleTracker | None = None):
        super().__init__()
        self.tracker, self.calls = tracker, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.bincount.default and args[0].is_meta:  # counts per expert: minlength slots
            out = torch.empty(kwargs.get("minlength", args[2] if len(args) > 2 else 0), dtype=torch.int64,
                              device="meta")
        else:
            out = func(*args, **kwargs)
        inputs, name = tensors_of((args, kwargs)), op_name(func)
        self.calls.append(OpCall(
            path=self.tracker.current if self.tracker else "", op=name,
            shapes=tuple(tuple(t.shape) for t in inputs), dtypes=tuple(str(t.dtype).replace("torch.", "")
                                                                      for t in inputs),
            flops=op_flops(func, args, kwargs, out), bytes_read=bytes_read(name, func, args, kwargs, out),
            bytes_written=0 if func.is_view else _nbytes(tensors_of(out))))
        return out
