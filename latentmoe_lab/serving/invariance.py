"""Batch-invariant serving (scheduler.batch_invariant): a request's tokens and logits, bit for bit, do not
depend on the other requests in its steps, on the step budget or on a prefix-cache hit.

Three sources of batch dependence, and what removes each:
  1. Chunk boundaries. KDA's chunked form and DSA's query blocks sum in an order set by where a chunk
     starts. The scheduler ends every chunk short of a prompt's end on a multiple of `chunk_grid`
     (the model's KDA chunk size and DSA query block), so each position is computed in the same chunk of
     the same grid; a prefix hit resumes at a block boundary, which the grid must divide.
  2. GEMM shapes. The CPU GEMM's kernel, and so its summation order, depends on the row and column counts
     of the product; inside `batch_invariant_mode()` (ops/batch_invariant.py), which the runner enters
     around the forward, every product is padded past the small shapes.
  3. Elementwise tails. torch's sigmoid / silu / softplus round an element by its place in the tensor;
     in that mode ops/activations.py computes them by forms that do not.

What stays different: a token recomputed after a preemption runs inside a prefill chunk rather than
as a decode, which sums in another order (KDA's chunked form against its recurrent step).

`recorded_logits(engine)` collects the logits rows an engine samples from, to compare runs bit for bit
(tests/test_batch_invariance.py, notebook 06).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from latentmoe_lab.ops.batch_invariant import check_row_invariance
from latentmoe_lab.serving.config import ServiceConfig


def batch_invariant_grid(model, cfg: ServiceConfig, runs_here: bool, device) -> int:
    """The scheduler's chunk grid: 1 when scheduler.batch_invariant is off; else check the rules
    (ValueError naming the key) and this machine's GEMMs (RuntimeError), and return model.chunk_grid()."""
    if not cfg.scheduler.batch_invariant:
        return 1
    key = "scheduler.batch_invariant"
    if not runs_here:
        raise ValueError(f"{key}: needs the forward in the engine's process (parallel sizes 1 and "
                         f"parallel.forward_process false)")
    if torch.device(device).type != "cpu":
        raise ValueError(f"{key}: pads the CPU's GEMMs; device {device} is not supported")
    grid = model.chunk_grid()
    if cfg.scheduler.chunked_prefill and cfg.scheduler.prefill_chunk_size < 2 * grid:
        raise ValueError(f"scheduler.prefill_chunk_size: ({cfg.scheduler.prefill_chunk_size}) must be >= "
                         f"{2 * grid} with {key} (two of the model's chunk grid of {grid}, so that half a "
                         f"budget still reaches a grid point)")
    if cfg.memory.prefix_cache.enabled and cfg.memory.block_size % grid:
        raise ValueError(f"memory.block_size: ({cfg.memory.block_size}) must be a multiple of the model's "
                         f"chunk grid ({grid}) with {key} and prefix caching (a hit resumes at a block boundary)")
    check_row_invariance(next(model.parameters()).dtype)
    return grid


@contextlib.contextmanager
def recorded_logits(engine) -> Iterator[dict[tuple[int, int], torch.Tensor]]:
    """Inside: every logits row the engine samples a token from, as {(request_id, position): row [vocab] fp32},
    the position being that of the token the row is computed at. For comparing runs bit for bit."""
    rows: dict[tuple[int, int], torch.Tensor] = {}
    run = engine.runner.run

    def recording_run(batch):
        output = run(batch)
        for (seq, n), emits, row in zip(batch.entries, batch.emits(), output.logits):
            if emits:
                rows[(seq.request_id, seq.num_computed + n - 1)] = row.detach().float().clone()
        return output

    engine.runner.run = recording_run
    try:
        yield rows
    finally:
        del engine.runner.run  # the class's own method again
