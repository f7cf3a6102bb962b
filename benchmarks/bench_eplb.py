"""Expert-parallel load balancing at K3 scale on paper: balancedness, the busiest rank's step time, rebalance time.

    .venv/bin/python benchmarks/bench_eplb.py            # 92 MoE layers x 896 experts, every workload
    .venv/bin/python benchmarks/bench_eplb.py --quick    # 8 layers, two workloads: checks the harness

For each of the six imbalance workloads (latentmoe_lab/routing_workloads.py: 4096 tokens, top-16, the expert ids
shuffled per layer so the hot experts differ between layers), the k3-2.8t preset on H200-141GB serving
SERVE_128K at EP64 (8 nodes of 8):

    none      the layout without a balancer: expert e on rank e // 14
    R = 0     rebalance_experts with no redundant slot (balanced packing alone)
    R = 64    one redundant slot per rank; R = 128 two

"refined" rows use rebalance_experts(refine=True) (packing-aware replica counts, docs/design.md §14), as
the serving balancer does; R = 64 also runs with the public balancer alone ("plain") to compare.

balancedness = mean / max tokens per rank, per layer, averaged over the 92 layers (parallel/eplb/load.py);
the step times are the planner's for the busiest EP rank of every layer (parallel/eplb/plan.py: its experts
get max / mean x the average routed pairs) with the fullest rank's expert slots in memory. 896 + 32 slots
do not split evenly over 64 ranks (rebalance_experts refuses num_replicas=928 for 64 ranks), so R = 32 runs
at EP32 and the EP64 + 32 memory row is the planner's (15 slots on the fullest rank). Rebalance time is
one rebalance_experts call over the whole table, divided by the layers.

Measured on CPU workers (tiny preset, EP2 with 2 redundant slots and EP4 with 4; EP2 alone with --quick):
the routing bias of experts 0 and 4 is raised by 0.5 in every MoE layer, so they draw most tokens (the
initial placement, balanced for equal loads, puts both on rank 0 at EP2 and EP4). One
engine with eplb enabled (no rebalance on its own) serves the prompts, then rebalances at the next step
(every layer at once) and serves the same prompts again: per phase the (token, expert) pairs each rank's
experts computed (max, and mean / max) and the mean engine step time, and whether the greedy tokens of
the two phases agree. Results: stdout and bench_eplb.json.
"""
from __future__ import annotations

import sys

from common import apply_threads, machine_info, make_parser, write_json

import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.parallel.eplb.load import moe_layers
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.meta import format_bytes
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.eplb.plan import plan_placement, workload_loads
from latentmoe_lab.parallel.hardware import HARDWARE, SERVE_128K
from latentmoe_lab.parallel.planner import plan_layout
from latentmoe_lab.routing_workloads import WORKLOADS

VARIANTS = [(64, None, False), (64, 0, True), (64, 64, False), (64, 64, True), (64, 128, True), (32, None, False),
            (32, 32, True)]  # (ep, redundant slots, refine)


def measure_workers(ep: int, redundant: int, num_prompts: int) -> dict:
    """Per-rank expert pairs and step time of one EP engine before and after a rebalance (module docstring)."""
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny")).eval()
    for layer in moe_layers(model):
        layer.correction_bias[[0, 4]] = 0.5  # selection only: experts 0 and 4 win most top-2 choices
    service = {"model": {"preset": "tiny", "max_model_len": 256},
               "memory": {"max_num_seqs": 4, "block_size": 16, "cache_bytes": 2_000_000},
               "scheduler": {"max_batch_size": 16, "prefill_chunk_size": 32},
               "parallel": {"expert_parallel_size": ep},
               "eplb": {"enabled": True, "num_redundant_experts": redundant, "window_steps": 1000,
                        "rebalance_interval_steps": 10**9, "layers_per_step": len(moe_layers(model))}}
    prompts = [[(7 * i + j) % 500 + 1 for j in range(20 + 5 * i)] for i in range(num_prompts)]
    params = SamplingParams(max_tokens=8)
    engine = Engine(model, ServiceConfig.from_dict(service))
    phases, tokens = {}, []
    try:
        for phase in ("before", "after"):
            if phase == "after":
                engine.balancer.rebalance_next_step()
            pairs_start, steps_start = list(engine.runner.rank_expert_pairs), len(engine.log.steps)
            tokens.append([o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)])
            pairs = [b - a for a, b in zip(pairs_start, engine.runner.rank_expert_pairs)]
            steps = list(engine.log.steps)[steps_start:]
            phases[phase] = {"pairs_per_rank": pairs, "max_pairs": max(pairs),
                             "balancedness": sum(pairs) / len(pairs) / max(pairs),
                             "step_ms": 1e3 * sum(s.duration for s in steps) / len(steps)}
    finally:
        engine.close()
    return {"ep": ep, "redundant": redundant, **phases, "greedy_tokens_equal": tokens[0] == tokens[1],
            "bytes_moved": engine.stats()["eplb_bytes_moved"]}


def main(argv: list[str] | None = None) -> dict:
    parser = make_parser(__doc__, default_threads=1)
    args = parser.parse_args(argv)
    apply_threads(args)
    config = ModelConfig.from_preset("k3-2.8t")
    hardware = HARDWARE["H200-141GB"]
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    layers = 8 if args.quick else moe_layers
    names = ["one_hot_expert", "same_topk"] if args.quick else list(WORKLOADS)
    if args.quick:  # a shallower model: the planner and the loads shrink together
        depth = layers + config.first_dense_layers
        config = ModelConfig.from_dict(config.to_dict() | {"num_layers": depth,
                                                           "layer_types": list(config.layer_types[:depth])})
    rows = []
    print(f"{'workload':<18}{'layout':>8}{'R':>6}{'balancer':>9}{'balanced':>10}{'imbal.':>8}{'prefill s':>11}"
          f"{'decode ms':>11}"
          f"{'weights/rank':>14}{'rebalance ms/layer':>20}")
    for name in names:
        weight = workload_loads(name, layers, config.moe.num_experts, config.moe.top_k, num_tokens=4096)
        for ep, redundant, refine in VARIANTS:
            study = plan_placement(config, ParallelConfig(ep=ep), hardware, SERVE_128K, weight, redundant,
                                   refine=refine)
            times = study.plan.times
            row = dict(workload=name, ep=ep, redundant=redundant, refine=refine, balancedness=study.balancedness,
                       imbalance=study.imbalance, prefill_s=times["prefill"]["sequential"],
                       decode_ms=times["decode"]["sequential"] * 1e3, weights_bytes=study.plan.memory.weights,
                       rebalance_ms_per_layer=study.rebalance_seconds / layers * 1e3)
            rows.append(row)
            balancer = "-" if redundant is None else ("refined" if refine else "plain")
            print(f"{name:<18}{'EP' + str(ep):>8}{'none' if redundant is None else redundant:>6}{balancer:>9}"
                  f"{row['balancedness']:>10.3f}{row['imbalance']:>8.2f}{row['prefill_s']:>11.3f}"
                  f"{row['decode_ms']:>11.2f}{format_bytes(row['weights_bytes']):>14}"
                  f"{row['rebalance_ms_per_layer']:>20.2f}")
    memory = {str(r): plan_layout(config, ParallelConfig(ep=64), hardware, SERVE_128K,
                                  redundant_experts=r).memory.weights for r in (0, 32, 64)}
    print("weights per rank at EP64, by redundant slots: "
          + ", ".join(f"R={r}: {format_bytes(b)}" for r, b in memory.items()))
    workers = [measure_workers(ep, redundant, 4 if args.quick else 8)
               for ep, redundant in ([(2, 2)] if args.quick else [(2, 2), (4, 4)])]
    for w in workers:
        print(f"EP{w['ep']} + {w['redundant']} redundant on CPU workers: "
              + "; ".join(f"{phase}: max pairs/rank {w[phase]['max_pairs']}, balancedness "
                          f"{w[phase]['balancedness']:.3f}, step {w[phase]['step_ms']:.1f} ms"
                          for phase in ("before", "after"))
              + f"; greedy tokens equal: {w['greedy_tokens_equal']}, moved {w['bytes_moved']} B")
    result = machine_info(preset="k3-2.8t", layers=layers, hardware=hardware.name, rows=rows,
                          ep64_weights_bytes_by_redundant=memory, workers=workers, quick=args.quick)
    print(f"wrote {write_json(__file__, result)}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
