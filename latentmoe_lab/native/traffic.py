"""Bytes on the wire of the native path: a meter on torch.distributed, and the plan it must match.

    with CollectiveMeter() as meter, RoutingRecorder(native.module) as routing:
        trainer.step(batch)
    plan = plan_step_bytes(native, native.layout, routing.gathered(native.mesh["ep"]))
    assert {k: meter.bytes[k] for k in plan} == plan            # exact, in bytes (docs/design.md §11)

Counting convention, per rank, per call (the same as parallel/comm.py for the hand-written twin):
    all-gather      output bytes - input bytes      (what this rank receives from the others)
    reduce-scatter  input bytes - output bytes      (what this rank sends to the others)
    all-to-all      bytes of the rows this rank sends to OTHER ranks (its own slice stays)
    p2p send        the tensor's bytes
    all-reduce, broadcast   the tensor's bytes (the payload; wire bytes depend on the algorithm),
                    none in a group of one

Kinds, by the function called (in this package each one has a single caller):
    fsdp.all_gather / fsdp.reduce_scatter    dist.all_gather_single / reduce_scatter_single (FSDP2)
    ep.all_to_all.{counts,ids,rows}          dist.all_to_all_single (expert.py), told apart by dtype:
                                             int64 row counts, int32 expert ids, float token rows (and
                                             the replicas' gradient sums, native/eplb.py)
    all_reduce, all_gather, broadcast        dist.* (the train step's bias counts and loss, logits)
    dtensor.{all_reduce,all_gather,reduce_scatter}   torch's functional collectives (DTensor: TP)
    p2p.send                                 ProcessGroup.send (pipelining, dist.send)

The plan covers the fsdp.* and ep.* kinds. FSDP2's rules (torch 2.13, fsdp/_fully_shard): one
unit per decoder block and one for the root (embeddings, final norm, head, vision tower), the
experts their own unit over dp_shard when dp_shard > 1 (build.apply_fsdp); each parameter's shard
is dim 0 of its TP/EP-local tensor cut torch.chunk-wise into `shards` pieces and padded to the first
piece, ceil(d0 / shards) x rest, so a unit's all-gather input is the sum of those; a block
all-gathers in forward and again in backward (it reshards after forward), the root only in forward
(reshard_after_forward=False), and every unit reduce-scatters once in backward, in the policy's
dtypes. FSDP2 leaves a parameter out of the reduce-scatter when it got no gradient; which ones
those are is a rule of the model, modelled in `gradient_free`.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.native.eplb import pair_destinations, placed_layers, replica_gradient_bytes
from latentmoe_lab.native.layout import PARAM_DTYPES, NativeLayout
from latentmoe_lab.native.stage import named_blocks

FSDP_DIMS = ("data", "dp_shard")  # the mesh dims FSDP2 shards over (build.apply_fsdp)
A2A_KINDS = {torch.int64: "ep.all_to_all.counts", torch.int32: "ep.all_to_all.ids"}


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _a2a_sent(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **_) -> int:
    """Bytes of all_to_all_single's input rows bound for ranks other than this one."""
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    rows = input.shape[0] if input.dim() else 1
    splits = list(input_split_sizes) if input_split_sizes else [rows // ranks] * ranks
    row_bytes = _nbytes(input) // rows if rows else 0
    return (sum(splits) - splits[me]) * row_bytes


def _payload(tensor, _op_or_src=None, group=None, **_) -> int:
    """An all-reduce's or broadcast's tensor bytes; nothing in a group of one."""
    return _nbytes(tensor) if dist.get_world_size(group) > 1 else 0


def _a2a_kind(output, input, *args, **kwargs) -> str:
    return A2A_KINDS.get(input.dtype, "ep.all_to_all.rows")


# (owner, attribute, kind: a name or a function of the call's arguments, bytes(result, *args, **kwargs));
# functional collectives only give their output back, hence the result. funcol's deprecated
# all_gather_tensor / reduce_scatter_tensor call the *_single ones, so they are not wrapped as well.
_WRAPPED = (
    (dist, "all_gather_single", "fsdp.all_gather",
     lambda r, output, input, *a, **k: _nbytes(output) - _nbytes(input)),
    (dist, "reduce_scatter_single", "fsdp.reduce_scatter",
     lambda r, output, input, *a, **k: _nbytes(input) - _nbytes(output)),
    (dist, "all_to_all_single", _a2a_kind, lambda r, *a, **k: _a2a_sent(*a, **k)),
    (dist, "all_reduce", "all_reduce", lambda r, *a, **k: _payload(*a, **k)),
    (dist, "all_gather", "all_gather",
     lambda r, outputs, tensor, *a, **k: sum(map(_nbytes, outputs)) - _nbytes(tensor)),
    (dist, "broadcast", "broadcast", lambda r, *a, **k: _payload(*a, **k)),
    (funcol, "all_reduce", "dtensor.all_reduce", lambda r, tensor, *a, **k: _nbytes(tensor)),
    (funcol, "all_gather_single", "dtensor.all_gather", lambda r, tensor, *a, **k: _nbytes(r) - _nbytes(tensor)),
    (funcol, "reduce_scatter_single", "dtensor.reduce_scatter",
     lambda r, tensor, *a, **k: _nbytes(tensor) - _nbytes(r)),
    (dist.ProcessGroup, "send", "p2p.send", lambda r, self, tensors, *a, **k: sum(map(_nbytes, tensors))),
)


class CollectiveMeter:
    """Counts this rank's collective bytes per kind while active: `bytes` and `calls` (Counters).

    Replaces the functions in `_WRAPPED` with counting wrappers on entry (callers look them up at call
    time: `dist.all_gather_single(...)`) and puts the originals back on exit, exception or not.
    """

    def __init__(self):
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._originals: list[tuple[object, str, object]] = []

    def __enter__(self) -> CollectiveMeter:
        if self._originals:
            raise RuntimeError("CollectiveMeter: already active; use a new meter per `with` block")
        for owner, attribute, kind, count in _WRAPPED:
            # restore the stored object itself: on a class, getattr gives pybind's bare function, and
            # setting that back would lose the method binding (self)
            self._originals.append((owner, attribute, vars(owner)[attribute]))
            setattr(owner, attribute, self._wrap(getattr(owner, attribute), kind, count))
        return self

    def __exit__(self, *exc) -> None:
        while self._originals:
            owner, attribute, original = self._originals.pop()
            setattr(owner, attribute, original)

    def _wrap(self, original, kind, count):
        def counted(*args, **kwargs):
            result = original(*args, **kwargs)
            name = kind(*args, **kwargs) if callable(kind) else kind
            self.bytes[name] += int(count(result, *args, **kwargs))
            self.calls[name] += 1
            return result
        counted.__wrapped__ = original
        return counted


@dataclass
class DispatchCall:
    """One EP dispatch: the MoE layer, each ep rank's indices [R_ep, N, K], and whether it backpropagates."""

    layer: int
    indices: torch.Tensor
    backward: bool


class _RecordingDispatcher:
    """Wraps a layer's dispatcher: notes the routing indices of each dispatch, then delegates."""

    def __init__(self, inner, layer: int, calls: list):
        self.inner, self.layer, self.calls = inner, layer, calls

    def dispatch(self, z: torch.Tensor, indices: torch.Tensor):
        self.calls.append((self.layer, indices.detach().cpu().clone(), torch.is_grad_enabled() and z.requires_grad))
        return self.inner.dispatch(z, indices)

    def combine(self, y_perm, weights, ctx):
        return self.inner.combine(y_perm, weights, ctx)


class RoutingRecorder:
    """While active, records the (token, expert) indices of this rank's local tokens at every MoE dispatch."""

    def __init__(self, module: nn.Module):
        self.layers = [(i, block.ffn) for i, block in named_blocks(module) if isinstance(block.ffn, LatentMoE)]
        self.calls: list[tuple[int, torch.Tensor, bool]] = []

    def __enter__(self) -> RoutingRecorder:
        for i, layer in self.layers:
            layer.dispatcher = _RecordingDispatcher(layer.dispatcher, i, self.calls)
        return self

    def __exit__(self, *exc) -> None:
        for _, layer in self.layers:
            if isinstance(layer.dispatcher, _RecordingDispatcher):
                layer.dispatcher = layer.dispatcher.inner

    def gathered(self, ep_mesh=None) -> list[DispatchCall]:
        """Every ep rank's indices per call: [R_ep, N, K] each.

        A collective over ep_mesh (call it outside the meter); the ep ranks made the same dispatch
        calls with equal token counts (NativeTrainer splits the batch evenly).
        """
        out = []
        for layer, indices, backward in self.calls:
            if ep_mesh is None or ep_mesh.size() == 1:
                everyone = indices[None]
            else:
                parts = [torch.empty_like(indices) for _ in range(ep_mesh.size())]
                dist.all_gather(parts, indices, group=ep_mesh.get_group())
                everyone = torch.stack(parts)
            out.append(DispatchCall(layer, everyone, backward))
        return out


def expert_pairs(indices: torch.Tensor, num_experts: int, ep: int, rank: int,
                 phy2log: torch.Tensor | None = None) -> dict[str, int]:
    """Rows rank `rank` of the ep group sends to / receives from the others, both ways of shipping them.

    indices [R_ep, N, K]: every ep rank's routing; phy2log: the layer's placement (pair_destinations).
    "pairs": one row per (token, expert) pair, what expert.py sends; "grouped": one row per (token,
    destination rank), what parallel/expert.py sends.
    """
    dest = pair_destinations(indices, num_experts, ep, phy2log)  # [R, N, K] destination rank of each pair
    to_rank = torch.stack([torch.bincount(d.reshape(-1), minlength=ep) for d in dest])  # [src, dst] pairs
    hits = torch.stack([(dest == r).any(-1).sum(-1) for r in range(ep)], dim=1)  # [src, dst] tokens
    others = [r for r in range(ep) if r != rank]
    return {"pairs_sent": int(to_rank[rank, others].sum()), "pairs_received": int(to_rank[others, rank].sum()),
            "grouped_sent": int(hits[rank, others].sum()), "grouped_received": int(hits[others, rank].sum())}


def plan_expert_bytes(calls: list[DispatchCall], num_experts: int, ep: int, rank: int, latent_size: int,
                      row_dtype: torch.dtype, placement: dict[int, torch.Tensor] | None = None) -> Counter[str]:
    """ep.all_to_all.* bytes this ep rank sends in `calls` (expert.py's NativeDispatcher); placement:
    {layer index: phy2log [P]} of the layers whose experts sit in an EPLB placement's slots.

    Per dispatch: counts [ep] int64 (one to each other rank), ids int32 per sent pair, and rows of
    latent_size: the tokens out and the expert outputs back (the rows other ranks sent here), then
    in backward the same two the reverse way.
    """
    plan: Counter[str] = Counter()
    if ep == 1:
        return plan
    row_bytes = latent_size * _element_size(row_dtype)
    for call in calls:
        rows = expert_pairs(call.indices, num_experts, ep, rank, (placement or {}).get(call.layer))
        one_way = (rows["pairs_sent"] + rows["pairs_received"]) * row_bytes
        plan["ep.all_to_all.counts"] += (ep - 1) * 8
        plan["ep.all_to_all.ids"] += rows["pairs_sent"] * 4
        plan["ep.all_to_all.rows"] += one_way * (2 if call.backward else 1)
    return plan


def gradient_free(name: str, with_images: bool = False) -> bool:
    """Parameters a training step leaves without a gradient (FSDP2 then skips them in the reduce-scatter).

    The lightning indexer only picks positions (a top-k: no gradient to its scores; it learns from
    its own warm-up loss), and the vision tower has no path to the loss on a text-only batch.
    """
    return ".indexer." in name or (name.startswith("vision.") and not with_images)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _local_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The TP / EP-local shape FSDP2 cut: the global shape split by every Shard(d) on a non-FSDP mesh dim."""
    if not isinstance(param, DTensor):
        return tuple(param.shape)
    shape = list(param.shape)
    mesh = param.device_mesh
    for dim, (name, placement) in enumerate(zip(mesh.mesh_dim_names, param.placements)):
        if name in FSDP_DIMS or type(placement) is not Shard:
            continue
        size, parts, coordinate = shape[placement.dim], mesh.size(dim), mesh.get_local_rank(dim)
        chunk = math.ceil(size / parts)
        shape[placement.dim] = max(0, min(chunk, size - coordinate * chunk))
    return tuple(shape)


def _padded_shard_numel(param: torch.Tensor, shards: int) -> int:
    shape = _local_shape(param)
    return math.ceil(shape[0] / shards) * math.prod(shape[1:]) if shape else 1


def fsdp_units(module: nn.Module, layout: NativeLayout) -> list[tuple[str, list[tuple[str, torch.Tensor]], int, bool]]:
    """(unit, [(name, param)], shards, all-gathers again in backward) per FSDP2 unit, as build.apply_fsdp makes them."""
    if layout.data_shards == 1:
        return []
    named = dict(module.named_parameters())
    experts = {name for name in named if ".ffn.experts." in name}
    units, claimed = [], set()
    for i, block in named_blocks(module):
        prefix = f"layers.{i}."
        names = [n for n in named if n.startswith(prefix)]
        if layout.dp_shard > 1 and any(n in experts for n in names):
            own = [(n, named[n]) for n in names if n in experts]
            units.append((f"{prefix}ffn.experts", own, layout.dp_shard, True))
        units.append((f"layers.{i}", [(n, named[n]) for n in names if n not in experts], layout.data_shards, True))
        claimed.update(names)
    root = [(n, p) for n, p in named.items() if n not in claimed and n not in experts]
    units.append(("root", root, layout.data_shards, False))
    return units


def plan_step_bytes(native_or_module, layout: NativeLayout, routing: list[DispatchCall] | None = None,
                    with_images: bool = False) -> Counter[str]:
    """This rank's planned fsdp.* and ep.* bytes for one NativeTrainer step (kinds as CollectiveMeter's).

    native_or_module: a NativeModel or this rank's built module; routing: RoutingRecorder.gathered()
    of the same step (needed when ep > 1); with_images: the batch carries images (vision grads).
    """
    module = getattr(native_or_module, "module", native_or_module)
    if layout.pp > 1 and layout.data_shards > 1:
        raise ValueError("layout: FSDP2 under pipelining (pp > 1 with dp_shard x ep > 1) is not modelled: "
                         "its all-gathers depend on the schedule's micro-batch order")
    stored = next(module.parameters()).dtype
    cast = PARAM_DTYPES[layout.param_dtype]
    gather_bytes = _element_size(cast or stored)
    reduce_bytes = _element_size(torch.float32 if cast is not None else stored)
    plan: Counter[str] = Counter()
    for _, params, shards, regather in fsdp_units(module, layout):
        numels = [(_padded_shard_numel(p, shards), gradient_free(n, with_images)) for n, p in params]
        gathered = sum(numel for numel, _ in numels) * (shards - 1) * gather_bytes
        plan["fsdp.all_gather"] += gathered * (2 if regather else 1)
        plan["fsdp.reduce_scatter"] += sum(numel for numel, free in numels if not free) * (shards - 1) * reduce_bytes
    if layout.ep > 1:
        if routing is None:
            raise ValueError("routing: ep > 1 needs the step's RoutingRecorder.gathered() to plan the All-to-All")
        moe = module.config.moe
        compute = cast if cast is not None and layout.data_shards > 1 else stored
        ep_rank = _ep_rank(module)
        placement = {int(name.split(".")[1]): row for name, row in placed_layers(module).items()}
        plan += plan_expert_bytes(routing, moe.num_experts, layout.ep, ep_rank, moe.latent_size, compute, placement)
        plan["ep.all_to_all.rows"] += replica_gradient_bytes(module, ep_rank, layout.ep)  # replicas' sums
    return Counter({kind: n for kind, n in plan.items() if n})


def _ep_rank(module: nn.Module) -> int:
    """This rank's place in its ep group, from the dispatcher expert.py installed."""
    for _, block in named_blocks(module):
        if isinstance(block.ffn, LatentMoE):
            dispatcher = block.ffn.dispatcher
            dispatcher = getattr(dispatcher, "inner", dispatcher)
            return dist.get_rank(dispatcher.group)
    return 0
