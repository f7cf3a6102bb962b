"""Planned == measured bytes for the native layouts (FSDP2 all-gather / reduce-scatter, EP All-to-All), exactly.

One NativeTrainer step per layout on the tiny preset, under CollectiveMeter and RoutingRecorder; the
plan comes from the parameter shapes, FSDP2's rules and the recorded routing (native/traffic.py).
"""
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.native.layout import NativeLayout
from latentmoe_lab.native.traffic import (CollectiveMeter, RoutingRecorder, expert_pairs, plan_step_bytes,
                                          plan_expert_bytes, DispatchCall)
from latentmoe_lab.parallel.launch import launch

PLANNED_PREFIXES = ("fsdp.", "ep.")


def _direct_collectives() -> dict:
    """Known collectives outside the model, so the meter's own arithmetic is checked without the plan."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # each rank keeps 1 row of 5 fp32 and sends rank + 1 rows to every other rank
    send = [1 if r == rank else rank + 1 for r in range(world)]
    recv = [1 if r == rank else r + 1 for r in range(world)]
    with CollectiveMeter() as meter:
        dist.all_to_all_single(torch.empty(sum(recv), 5), torch.zeros(sum(send), 5), recv, send)
        dist.all_gather_single(torch.empty(7 * world, dtype=torch.float64), torch.ones(7, dtype=torch.float64))
    sent = (world - 1) * (rank + 1) * 5 * 4
    return {"measured": dict(meter.bytes), "expected": {"ep.all_to_all.rows": sent,
                                                        "fsdp.all_gather": 7 * 8 * (world - 1)}}


def traffic_worker(layouts: list[NativeLayout]) -> list[dict]:
    from latentmoe_lab.native.build import build_native
    from latentmoe_lab.native.layout import build_mesh
    from latentmoe_lab.native.train import NativeTrainer
    from latentmoe_lab.parallel.mesh import init_distributed

    init_distributed(60)
    torch.set_num_threads(1)  # after: accelerate sets its own count when OMP_NUM_THREADS is unset
    config = ModelConfig.from_preset("tiny")
    batch = torch.randint(0, config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    originals = _stored()
    results = []
    for layout in layouts:
        native = build_native(config, layout, build_mesh(layout))
        trainer = NativeTrainer(native)
        with CollectiveMeter() as meter, RoutingRecorder(native.module) as routing:
            trainer.step(batch)
        plan = plan_step_bytes(native, layout, routing.gathered(native.mesh["ep"]))
        results.append({"measured": dict(meter.bytes), "calls": dict(meter.calls), "plan": dict(plan),
                        "restored": all(now is before for now, before in zip(_stored(), originals))})
    results.append(_direct_collectives())
    return results


@pytest.fixture(scope="module")
def runs():
    groups = [[NativeLayout(dp_shard=2), NativeLayout(ep=2)], [NativeLayout(dp_shard=2, ep=2)]]
    out = {}
    for layouts in groups:
        per_rank = launch(traffic_worker, layouts[0].world_size, args=(layouts,), timeout_s=180)
        for i, layout in enumerate(layouts):
            out[layout.name] = [rank[i] for rank in per_rank]
        out[f"direct x{layouts[0].world_size}"] = [rank[-1] for rank in per_rank]
    return out


@pytest.mark.parametrize("name", ["FSDP2", "EP2", "FSDP2xEP2"])
def test_planned_equals_measured_exactly(runs, name):
    for rank, result in enumerate(runs[name]):
        measured = {k: n for k, n in result["measured"].items() if k.startswith(PLANNED_PREFIXES)}
        assert measured == result["plan"], f"rank {rank}"
        assert result["restored"]


@pytest.mark.parametrize("name", ["FSDP2", "EP2", "FSDP2xEP2"])
def test_the_meter_counts_something(runs, name):
    """Not vacuous: FSDP2 moved parameters and gradients, and EP moved token rows (4 blocks, 3 MoE layers)."""
    for result in runs[name]:
        assert result["measured"]["fsdp.all_gather"] > 0 and result["measured"]["fsdp.reduce_scatter"] > 0
        experts_unit = 3 if name.startswith("FSDP2") else 0  # experts are their own unit when dp_shard > 1
        assert result["calls"]["fsdp.all_gather"] == 2 * 4 + 1 + 2 * experts_unit  # blocks twice, root once
        if "EP2" in name:
            assert result["measured"]["ep.all_to_all.rows"] > 0
            assert result["calls"]["ep.all_to_all.rows"] == 3 * 4  # dispatch, combine, and both in backward


@pytest.mark.parametrize("name", ["direct x2", "direct x4"])
def test_the_meter_counts_known_collectives_exactly(runs, name):
    for result in runs[name]:
        assert result["measured"] == result["expected"]


def _stored() -> tuple:
    # the stored objects themselves: on ProcessGroup, getattr returns pybind's bare function, and an
    # equal-looking one set back would lose the method binding
    return (vars(dist)["all_gather_single"], vars(dist)["reduce_scatter_single"], vars(dist)["all_to_all_single"],
            vars(dist)["all_reduce"], vars(funcol)["all_reduce"], vars(dist.ProcessGroup)["send"])


def test_the_meter_restores_torch_distributed_even_on_error():
    originals = _stored()
    with pytest.raises(ZeroDivisionError):
        with CollectiveMeter():
            assert dist.all_to_all_single is not originals[2]
            assert vars(dist.ProcessGroup)["send"] is not originals[-1]
            1 / 0
    assert all(now is before for now, before in zip(_stored(), originals))


def test_expert_pairs_both_ways():
    # E = 4 experts on ep = 2 ranks (0-1 on rank 0, 2-3 on rank 1); 2 tokens each, top-2
    indices = torch.tensor([[[0, 1], [2, 3]],    # rank 0: token 1 goes to rank 1 with both its experts
                            [[3, 2], [0, 3]]])   # rank 1: token 1 has one expert on rank 0
    assert expert_pairs(indices, 4, 2, 0) == {"pairs_sent": 2, "pairs_received": 1,
                                             "grouped_sent": 1, "grouped_received": 1}
    plan = plan_expert_bytes([DispatchCall(1, indices, backward=True)], 4, 2, 0, latent_size=8,
                             row_dtype=torch.float32)
    assert plan == {"ep.all_to_all.counts": 8, "ep.all_to_all.ids": 2 * 4, "ep.all_to_all.rows": 2 * 3 * 8 * 4}


def test_plan_refuses_what_it_cannot_model():
    with torch.device("meta"):
        model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny"))
    with pytest.raises(ValueError, match="routing"):
        plan_step_bytes(model, NativeLayout(ep=2))
    with pytest.raises(ValueError, match="pp > 1"):
        plan_step_bytes(model, NativeLayout(pp=2, dp_shard=2))
    assert RoutingRecorder(model).gathered() == []
