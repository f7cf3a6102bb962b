"""Parameters stored as DTensors, computed with as local tensors: the bridge between torch's TP and our layers.

ColwiseParallel / RowwiseParallel cover nn.Linear. A KDA or MLA layer also owns parameters it uses
directly (A_log, dt_bias, the short-conv weight, the per-head output norm, W_kvb in the absorbed
form, the experts' stacked w13 / w2). `LocalParams` registers those as DTensors, so checkpoints,
FSDP2 and the optimizer see their global shape and placement, and hands the layer's forward plain
local views, so the layer code stays exactly the single-device code:

    Shard(d)           this rank's slice along d; its gradient is this rank's slice too.
    REPLICATED_SUM     the whole tensor on every rank, used on this rank's heads only: each rank's
                       gradient is a partial sum, and to_local(grad_placements=[Partial()]) makes
                       the optimizer see their sum over the mesh dim (the all-reduce Megatron does
                       by hand for norms inside a TP region).
    Sections(sizes)    stored whole like REPLICATED_SUM; the forward sees, from each block of `sizes`
                       rows (q | k | v channels of the conv), this rank's slice.

`sum_gradients_over` is the matching op for activations: identity forward, all-reduce of the
gradient backward (Megatron's "f"), for a replicated tensor that enters per-head computation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

REPLICATED_SUM = "replicated_sum"


@dataclass(frozen=True)
class Sections:
    """Row blocks (dim 0) each split over the mesh dim on its own."""

    sizes: tuple[int, ...]


def sum_gradients_over(x: torch.Tensor, mesh) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient over `mesh` (1-D)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _local_view(param: DTensor, rule) -> torch.Tensor:
    if isinstance(rule, Shard):
        return param.to_local()
    whole = param.to_local(grad_placements=[Partial()])
    if rule == REPLICATED_SUM:
        return whole
    mesh = param.device_mesh
    rank, parts = mesh.get_local_rank(), mesh.size()
    blocks = whole.split(list(rule.sizes), dim=0)
    return torch.cat([b.narrow(0, rank * (b.shape[0] // parts), b.shape[0] // parts) for b in blocks])


class LocalParams(ParallelStyle):
    """A ParallelStyle for a module's own parameters: rules {dotted name: Shard(d) | REPLICATED_SUM | Sections}.

    Applied by parallelize_module like any other style; the module's forward then runs on local views.
    """

    def __init__(self, rules: dict):
        super().__init__()
        self.rules = dict(rules)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        swaps: list[tuple[nn.Module, str, object]] = []  # (owning module, parameter name, rule)
        for name, rule in self.rules.items():
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            param = owner._parameters[leaf]
            if isinstance(rule, Shard):
                placement = rule
            elif rule == REPLICATED_SUM or isinstance(rule, Sections):
                placement = Replicate()
            else:
                raise ValueError(f"rules[{name!r}]: expected Shard(d), REPLICATED_SUM or Sections, got {rule!r}")
            owner._parameters[leaf] = nn.Parameter(distribute_tensor(param.data, device_mesh, [placement]),
                                                   requires_grad=param.requires_grad)
            swaps.append((owner, leaf, rule))
        stored: list[tuple[nn.Module, str, nn.Parameter]] = []

        def to_local(mod, args, kwargs):
            for owner, leaf, rule in swaps:
                param = owner._parameters.pop(leaf)
                stored.append((owner, leaf, param))
                owner.__dict__[leaf] = _local_view(param, rule)  # a plain attribute, for this forward only
            return args, kwargs

        def restore(mod, args, kwargs, output):
            while stored:
                owner, leaf, param = stored.pop()
                del owner.__dict__[leaf]
                owner._parameters[leaf] = param
            return output

        module.register_forward_pre_hook(to_local, with_kwargs=True)
        module.register_forward_hook(restore, with_kwargs=True, always_call=True)
        return module
