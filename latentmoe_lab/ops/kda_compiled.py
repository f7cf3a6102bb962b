"""Chunked KDA under torch.compile: the eager op's chunk groups, each run through one compiled graph.

`kda_chunked_compiled` has the contract of `ops.kda.kda_chunked` (same inputs, outputs, validation and
fp32 math; forward and backward). Its group loop is the eager one; each group (`_chunk_group`: scores,
triangular solve, the per-chunk state hand-off, outputs) is torch.compile'd, so inductor can fuse the
elementwise passes around the small matmuls; only the intra-chunk scores stay eager (see _compiled_group).
Groups hold a fixed number of whole chunks, so one compilation serves every group of a given shape (the
ragged last group compiles once more).

    out, state = kda_chunked_compiled(q, k, v, g, beta, chunk_size=64)                  # inductor
    out, state = kda_chunked_compiled(q, k, v, g, beta, compile_backend="aot_eager")    # graph capture only

The eager op stays the reference twin (tests/test_compiled.py compares them). Compilation takes
seconds to minutes on a CPU the first time a shape is seen; the timings are in benchmarks/bench_decode.py.
"""
from __future__ import annotations

import functools
import types

import torch
from latentmoe_lab.ops import kda as kda_ops
from latentmoe_lab.ops.kda import _chunk_group, _validate, run_chunk_groups

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@functools.cache
def _compiled_group(compile_backend: str):
    """`ops.kda._chunk_group` compiled, with its intra-chunk scores left eager (see below)."""
    # chunk_decays_and_scores branches on the data (blocks whose decays would overflow are redone in halves,
    # ops/kda_intra.py) and fills an einsum result in place, which AOT autograd's fake tensors cannot
    # trace (a stride mismatch in the view). It runs eager between two compiled graphs: the same code
    # object as _chunk_group, bound to globals in which that one call is excluded from compilation.
    scope = dict(vars(kda_ops), chunk_decays_and_scores=torch.compiler.disable(kda_ops.chunk_decays_and_scores))
    group = types.FunctionType(_chunk_group.__code__, scope, _chunk_group.__name__)
    return torch.compile(group, backend=compile_backend, dynamic=False)


def kda_chunked_compiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         scale: float | None = None, initial_state: torch.Tensor | None = None,
                         output_final_state: bool = False, chunk_size: int = 64,
                         compile_backend: str = "inductor") -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H] -> (out [B, T, H, V], final state [B, H, K, V] or None)."""
    if compile_backend not in COMPILE_BACKENDS:
        raise ValueError(f"compile_backend: must be one of {COMPILE_BACKENDS}, got {compile_backend!r}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    scale = _validate(q, k, v, g, beta, scale, initial_state)
    return run_chunk_groups(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size,
                            _compiled_group(compile_backend))
