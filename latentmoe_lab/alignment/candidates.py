"""Candidates built from a reference model, each checked against it by `compare` (docs/design.md §8).

    cast_candidate(model, torch.bfloat16)    a deep copy in another dtype (taps are compared in fp32)
    quantized_candidate(model, "int8-w8a8")  a deep copy quantized by a recipe of latentmoe_lab.quant
    BackendCandidate(model, "triton")        the same weights, every op forced onto the Triton kernels
    ParallelCandidate(model, ParallelConfig(ep=2))   an N-rank layout in local processes, taps gathered
    EngineCandidate(model, service_config)   the serving engine (paged cache, chunked prefill, fp8 KV)

The model has no global backend switch: the layers call the ops with backend="auto", which picks
the kernels only on CUDA. BackendCandidate rebinds `resolve_backend` inside every loaded
latentmoe_lab.ops module, for the duration of its own forward only, so that "auto" means the forced
backend; an explicit backend="torch" (the ops' own reference fallbacks) is left alone. On CPU the
Triton kernels need TRITON_INTERPRET=1 set before triton is imported (ops/backend.py says so when
it is missing).
"""
from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from latentmoe_lab.alignment.taps import ExpertChoice, Recording, TokenSubset, model_parts, record_taps
from latentmoe_lab.ops import backend as backend_module

_CAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def cast_candidate(reference: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A deep copy of `reference` in `dtype` (LatentMoE keeps its correction bias fp32 by itself)."""
    if dtype not in _CAST_DTYPES:
        raise ValueError(f"dtype: must be one of {[str(d) for d in _CAST_DTYPES]}, got {dtype!r}")
    return copy.deepcopy(reference).to(dtype).eval()


def quantized_candidate(reference: nn.Module, recipe, batches=None) -> nn.Module:
    """A deep copy of `reference` quantized by `recipe` (a name in quant.RECIPES, a Recipe or its dict).

    batches: calibration inputs for static / SmoothQuant recipes; take them from other text than the
    inputs you compare on, or the calibration has seen the test.
    """
    from latentmoe_lab.quant import quantize_model

    candidate = quantize_model(copy.deepcopy(reference), recipe, batches=batches, progress=False).eval()
    candidate.name = candidate.quant_recipe.name
    return candidate


@contextlib.contextmanager
def forced_backend(backend: str) -> Iterator[None]:
    """Inside the block, ops called with backend="auto" run `backend` ("torch" or "triton")."""
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend: must be 'torch' or 'triton', got {backend!r}")
    original = backend_module.resolve_backend

    def resolve(requested: str, *tensors):
        return original(backend if requested == "auto" else requested, *tensors)

    modules = [m for name, m in list(sys.modules.items())
               if name.startswith("latentmoe_lab.ops.") and m is not backend_module
               and getattr(m, "resolve_backend", None) is original]
    for module in modules:
        module.resolve_backend = resolve
    try:
        yield
    finally:
        for module in modules:
            module.resolve_backend = original


class BackendCandidate(nn.Module):
    """`model` (shared, not copied) run with every op forced onto `backend`. forward as the model's."""

    def __init__(self, model: nn.Module, backend: str = "triton"):
        super().__init__()
        if backend not in ("torch", "triton"):
            raise ValueError(f"backend: must be 'torch' or 'triton', got {backend!r}")
        model_parts(model)  # a clear TypeError now rather than at the first forward
        self.model, self.backend = model, backend
        self.name = f"backend={backend}"

    def forward(self, *args, **kwargs):
        with forced_backend(self.backend):
            return self.model(*args, **kwargs)


class ParallelCandidate:
    """`reference` sharded with `pconfig` over pconfig.world_size local processes (gloo on CPU).

    record(inputs, subset): every rank runs the prefill of its rows under record_taps; the parent joins
    the ranks' taps to the single-process names and shapes: pipeline stages contribute their own
    layers, tensor-parallel replicas hold complete (already reduced) outputs so one of them is kept,
    and the dp * ep batch shards are concatenated in batch order. Context parallelism, sequence
    parallelism and micro-batches split the token axis or call a block more than once per forward;
    they are refused rather than gathered wrongly.
    """

    def __init__(self, reference: nn.Module, pconfig, timeout_s: float = 60.0):
        from latentmoe_lab.parallel.config import ParallelConfig

        if not isinstance(pconfig, ParallelConfig):
            raise TypeError(f"pconfig: expected a ParallelConfig, got {type(pconfig).__name__}")
        if pconfig.cp > 1 or pconfig.sequence_parallel or pconfig.micro_batches > 1:
            raise ValueError(f"pconfig: {pconfig.name()} splits the token axis or the batch inside a stage "
                             f"(cp, sequence_parallel, micro_batches > 1); taps are gathered for ep / tp / pp / dp")
        if pconfig.world_size < 2:
            raise ValueError(f"pconfig: needs at least 2 processes, got layout {pconfig.name()}")
        pconfig.validate_for(reference.config, pconfig.world_size)
        self.reference, self.pconfig, self.timeout_s = reference, pconfig, timeout_s
        self.name = pconfig.name()

    def record(self, inputs, subset: TokenSubset = TokenSubset()) -> Recording:
        from latentmoe_lab.parallel.launch import launch

        if isinstance(inputs, Mapping):
            if set(inputs) != {"input_ids"}:
                raise ValueError(f"inputs: a parallel layout runs text only (input_ids), got {sorted(inputs)}")
            inputs = inputs["input_ids"]
        self.pconfig.validate_batch(*inputs.shape)
        per_rank = launch(_record_worker, self.pconfig.world_size,
                          (self.reference, self.pconfig, inputs, subset, self.timeout_s), timeout_s=self.timeout_s)
        return gather_recordings(per_rank, model_parts(self.reference)[0])


def _record_worker(model, pconfig, input_ids: torch.Tensor, subset: TokenSubset, timeout_s: float) -> dict:
    """One rank: shard, run the prefill of this rank's rows with the taps on, return them (CPU tensors)."""
    from latentmoe_lab.parallel.comm import Comm
    from latentmoe_lab.parallel.mesh import ProcessMesh, data_shard, init_distributed
    from latentmoe_lab.parallel.sharded import parallelize

    _, device = init_distributed(timeout_s)
    mesh = ProcessMesh(pconfig, device)
    sharded = parallelize(model.to(device), Comm(mesh))
    local = sharded.local_inputs(input_ids.to(device))
    with record_taps(sharded, subset) as recording:
        sharded(local)
    # plain tensors and tuples only: launch loads the results with torch.load(weights_only=True)
    return _as_plain({"shard": data_shard(pconfig, mesh.rank), "values": recording.values,
                      "positions": recording.positions})


def gather_recordings(per_rank: list[dict], config) -> Recording:
    """Join rank recordings ({"shard", "values", "positions"}; an ExpertChoice travels as the tuple
    (indices, weights)) into one Recording with the global names."""
    from latentmoe_lab.alignment.taps import tap_points

    by_shard: dict[int, dict] = {}
    for rank in per_rank:  # the first rank of a shard to hold a tap supplies it (tp replicas are equal)
        merged = by_shard.setdefault(rank["shard"], {"values": {}, "positions": {}})
        for name, value in rank["values"].items():
            merged["values"].setdefault(name, value)
            merged["positions"].setdefault(name, rank["positions"][name])
    shards = [by_shard[s] for s in sorted(by_shard)]
    recording = Recording(tap_points(config))
    for point in recording.points:
        parts = [s["values"].get(point.name) for s in shards]
        if any(p is None for p in parts):
            continue
        if isinstance(parts[0], tuple):
            value = ExpertChoice(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
        else:
            value = torch.cat(parts)
        recording.values[point.name] = value
        recording.positions[point.name] = shards[0]["positions"][point.name]
    return recording


class EngineCandidate:
    """The serving engine (latentmoe_lab.serving.Engine) on `model`, against model.forward on the same tokens.

    record(input_ids [B, T], TokenSubset()): each row is one request (max_tokens=1) in a fresh engine, so its
    prompt runs through the paged pools in prefill chunks of scheduler.prefill_chunk_size. Every per-token
    tap sees all T tokens, chunk after chunk; the engine computes norm and logits only at the last token of
    each chunk, so those two taps hold the chunk ends (compare picks the same positions of the reference).
    Only the full token set is supported: chunk ends fall anywhere, a strided subset would miss them.
    """

    def __init__(self, model: nn.Module, service_config, name: str = "engine"):
        from latentmoe_lab.serving import ServiceConfig

        if not isinstance(service_config, ServiceConfig):
            raise TypeError(f"service_config: expected a ServiceConfig, got {type(service_config).__name__}")
        if service_config.memory.prefix_cache.enabled:
            raise ValueError("service_config: memory.prefix_cache would skip cached prompt tokens; "
                             "alignment needs every token computed")
        self.model, self.service_config, self.name = model, service_config, name

    def record(self, inputs, subset: TokenSubset = TokenSubset()) -> Recording:
        from latentmoe_lab.serving import Engine, SamplingParams

        if subset != TokenSubset():
            raise ValueError("subset: the engine candidate records every token (TokenSubset())")
        ids = inputs["input_ids"] if isinstance(inputs, Mapping) and set(inputs) == {"input_ids"} else inputs
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError("inputs: the engine candidate takes input_ids [B, T] (text only)")
        rows = []
        for row in ids:
            lengths = []
            hook = self.model.register_forward_pre_hook(
                lambda module, args, kwargs: lengths.append((args[0] if args else kwargs["input_ids"]).shape[1]),
                with_kwargs=True)
            try:
                with record_taps(self.model, subset) as recording:
                    Engine(self.model, self.service_config).generate([row.tolist()], SamplingParams(max_tokens=1),
                                                                     use_tqdm=False)
            finally:
                hook.remove()
            if sum(lengths) != ids.shape[1]:
                raise RuntimeError(f"engine: computed {sum(lengths)} prompt tokens, expected {ids.shape[1]}")
            chunk_ends = torch.tensor(lengths).cumsum(0) - 1
            for name in ("norm", "logits"):
                recording.positions[name] = chunk_ends
            rows.append({"shard": len(rows), "values": recording.values, "positions": recording.positions})
        config = model_parts(self.model)[0]
        return gather_recordings([_as_plain(r) for r in rows], config)


def _as_plain(rank: dict) -> dict:
    """A recording's values with ExpertChoice as (indices, weights), the form gather_recordings takes."""
    values = {n: (v.indices, v.weights) if isinstance(v, ExpertChoice) else v for n, v in rank["values"].items()}
    return {**rank, "values": values}
