"""Does a native layout compute what one process computes? Logits, and parameters after training steps.

    report = check_layouts([NativeLayout(tp=2, ep=2)], nproc=4)   # one launch per world size

Every run starts from one seeded checkpoint (save_pretrained) and one seeded global batch. The
reference trains the plain single-device model with the same AdamW, clipping and bias update on
the whole batch; each layout gathers its parameters (DTensor.full_tensor) after the same steps.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.native.layout import NativeLayout


@dataclass(frozen=True)
class EquivalenceSettings:
    preset: str = "tiny"
    batch: int = 4
    seq_len: int = 32
    steps: int = 3
    lr: float = 1e-3
    grad_clip: float = 1.0
    seed: int = 0
    timeout_s: float = 240.0
    # fp64: Adam's first steps are nearly sign(g), so fp32 summation-order noise in a gradient near 0
    # moves a weight by up to lr; in fp64 any real difference (a missing reduction: about lr) still shows.
    dtype: str = "float64"


@dataclass
class EquivalenceReport:
    layout: str
    max_logit_error: float
    max_param_error: float
    losses: list[float]
    reference_losses: list[float]
    compared_params: int = 0
    extra: dict = field(default_factory=dict)


def training_batches(config: ModelConfig, settings: EquivalenceSettings) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(settings.seed + 1)
    return [torch.randint(0, config.vocab_size, (settings.batch, settings.seq_len), generator=generator)
            for _ in range(settings.steps)]


def write_reference_checkpoint(settings: EquivalenceSettings, directory: Path) -> LatentMoEForCausalLM:
    torch.manual_seed(settings.seed)
    model = LatentMoEForCausalLM(ModelConfig.from_preset(settings.preset)).to(getattr(torch, settings.dtype))
    model.save_pretrained(directory)
    return model


def train_reference(model: LatentMoEForCausalLM, batches: list[torch.Tensor], settings: EquivalenceSettings):
    """The one-process run: logits of the first batch, then `steps` updates -> (logits, losses, params)."""
    with torch.no_grad():
        logits = model(batches[0]).logits
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0, foreach=False)
    moe = [block.ffn for block in model.layers if isinstance(block.ffn, LatentMoE)]
    losses, norms = [], []
    for ids in batches:
        model.train()
        output = model(ids, labels=ids)
        (output.loss + output.aux_loss).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for layer in moe:
            layer.update_bias(layer.last_expert_counts)
        losses.append(float(output.loss.detach()))
    return logits, losses, norms, {name: p.detach().clone() for name, p in model.named_parameters()}


def logical_parameters(module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (DTensor.full_tensor); expert stacks in slot order back in expert order."""
    from latentmoe_lab.native.eplb import first_replicas, placed_layers

    placed = placed_layers(module)
    params = {}
    for name, p in module.named_parameters():
        value = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        prefix = name.rpartition(".")[0]
        if prefix in placed:
            value = value[first_replicas(placed[prefix], module.config.moe.num_experts)]
        params[name] = value
    return params


def replica_spread(module) -> float:
    """Max |replica - the expert's first replica| over every placed expert stack (0.0: replicas identical)."""
    from latentmoe_lab.native.eplb import first_replicas, placed_layers

    spread = 0.0
    for prefix, phy2log in placed_layers(module).items():
        first = first_replicas(phy2log, module.config.moe.num_experts)[phy2log]
        for name in ("w13", "w2"):
            whole = getattr(module.get_submodule(prefix), name).full_tensor()
            spread = max(spread, float((whole - whole[first]).abs().max()))
    return spread


def layouts_worker(layouts: list[NativeLayout], settings: EquivalenceSettings, checkpoint: str,
                   placements: list | None = None) -> list[dict]:
    """On each rank, per layout: build from the checkpoint, forward the first batch, train; gathered tensors.

    placements: per layout, an EPLB placement [MoE layers, P] for its experts or None."""
    from latentmoe_lab.native.build import build_native
    from latentmoe_lab.native.forward import native_logits
    from latentmoe_lab.native.layout import build_mesh
    from latentmoe_lab.native.train import NativeTrainer
    from latentmoe_lab.parallel.mesh import init_distributed

    init_distributed(settings.timeout_s / 2)
    torch.set_num_threads(1)  # after: accelerate's PartialState sets cores / local processes
    config = ModelConfig.from_preset(settings.preset)
    batches = training_batches(config, settings)
    results = []
    for layout, placement in zip(layouts, placements or [None] * len(layouts)):
        native = build_native(config, layout, build_mesh(layout), checkpoint=checkpoint,
                              dtype=getattr(torch, settings.dtype), placement=placement)
        logits = native_logits(native, batches[0])
        trainer = NativeTrainer(native, lr=settings.lr, grad_clip=settings.grad_clip)
        steps = [trainer.step(ids) for ids in batches]
        params = logical_parameters(native.module)
        results.append({"logits": logits, "losses": [s["loss"] for s in steps],
                        "replica_spread": replica_spread(native.module),
                        "grad_norms": [s["grad_norm"] for s in steps], "params": params})
    return results


def check_layouts(layouts: list[NativeLayout], settings: EquivalenceSettings = EquivalenceSettings(),
                  placements: list | None = None) -> list[EquivalenceReport]:
    """Run each layout and compare with the one-process reference; one launch per world size.

    placements: per layout, an EPLB placement of its experts (native/eplb.py) or None."""
    placements = placements or [None] * len(layouts)
    from latentmoe_lab.parallel.launch import launch

    by_world: dict[int, list[int]] = {}
    for i, layout in enumerate(layouts):
        by_world.setdefault(layout.world_size, []).append(i)
    reports: list[EquivalenceReport | None] = [None] * len(layouts)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "reference"
        model = write_reference_checkpoint(settings, checkpoint)
        batches = training_batches(model.config, settings)
        ref_logits, ref_losses, ref_norms, ref_params = train_reference(model, batches, settings)
        for world, indices in by_world.items():
            group = [layouts[i] for i in indices]
            per_rank = launch(layouts_worker, world, args=(group, settings, str(checkpoint),
                                                           [placements[i] for i in indices]),
                              timeout_s=settings.timeout_s * len(group))
            for j, i in enumerate(indices):
                results = [rank[j] for rank in per_rank]
                logit_error = max(float((r["logits"] - ref_logits).abs().max()) for r in results)
                param_error, compared, worst = 0.0, 0, None
                for r in results:
                    for name, value in r["params"].items():
                        error = float((value - ref_params[name]).abs().max())
                        if error > param_error:
                            param_error, worst = error, name
                        compared += 1
                extra = {"worst_param": worst, "grad_norms": results[0]["grad_norms"],
                         "reference_grad_norms": ref_norms,
                         "replica_spread": max(r["replica_spread"] for r in results)}
                reports[i] = EquivalenceReport(layouts[i].name, logit_error, param_error, results[0]["losses"],
                                               ref_losses, compared, extra)
    return reports


def hand_written_worker(pairs: list, settings: EquivalenceSettings, checkpoint: str, placement=None) -> list[float]:
    """Per rank: logits of each (ParallelConfig, NativeLayout) pair through both engines -> max |difference|.

    placement: one EPLB placement [MoE layers, P] that both engines' experts take (None: contiguous)."""
    from latentmoe_lab.native.build import build_native
    from latentmoe_lab.native.forward import native_logits
    from latentmoe_lab.native.layout import build_mesh
    from latentmoe_lab.parallel.comm import Comm
    from latentmoe_lab.parallel.mesh import ProcessMesh, init_distributed
    from latentmoe_lab.parallel.sharded import parallelize

    _, device = init_distributed(settings.timeout_s / 2)
    torch.set_num_threads(1)
    config = ModelConfig.from_preset(settings.preset)
    model = LatentMoEForCausalLM.from_pretrained(checkpoint).eval()
    batch = training_batches(config, settings)[0]
    differences = []
    for pconfig, layout in pairs:
        sharded = parallelize(model, Comm(ProcessMesh(pconfig, device)), placement)
        local = sharded.local_inputs(batch)
        hand_written = sharded.gather_logits(sharded(local), local.shape[0], local.shape[1])
        native = native_logits(build_native(config, layout, build_mesh(layout), checkpoint, placement=placement),
                               batch)
        differences.append(float((native - hand_written).abs().max()))
    return differences


def compare_with_hand_written(pairs: list, settings: EquivalenceSettings = EquivalenceSettings(dtype="float32"),
                              placement: torch.Tensor | None = None) -> list[float]:
    """Max |native logits - parallel/ logits| per (ParallelConfig, NativeLayout) pair, all of one world size;
    placement: the EPLB placement both engines' experts take."""
    from latentmoe_lab.parallel.launch import launch

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "reference"
        write_reference_checkpoint(settings, checkpoint)
        results = launch(hand_written_worker, pairs[0][1].world_size, args=(pairs, settings, str(checkpoint),
                                                                             placement),
                         timeout_s=settings.timeout_s)
    return [max(r[i] for r in results) for i in range(len(pairs))]
