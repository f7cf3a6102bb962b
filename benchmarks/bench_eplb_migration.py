"""Expert migration off the step path: decode step time while EPLB moves experts, against steady decoding.

    .venv/bin/python benchmarks/bench_eplb_migration.py            # 16384-wide experts, 320 tokens, two runs
    .venv/bin/python benchmarks/bench_eplb_migration.py --quick    # 2048-wide, 64 tokens: checks the harness

The tiny preset with wider experts (moe.expert_intermediate_size: 16384 makes a 6 MiB fp32 expert, so that
copying a layer's changed slots is a visible share of a step) served by CPU workers at EP2 with 2 redundant
slots and no rebalance of its own; eplb.layers_per_step 1, then 3 (every MoE layer of the preset with one
step: the whole model at once). 4 requests decode --tokens tokens each. Every --period decode steps the
benchmark triggers a rebalance to a given placement (OnlineBalancer.rebalance_next_step(placement)),
alternating between the balancer's answers for experts {0, 4} hot and for experts {1, 5} hot, so every
rebalance moves slots in all 3 MoE layers. The rebalances alternate between the two schedules, in one run
on one worker group:

    staged    the service's: each layer staged on the workers' side thread with one step and switched at the
              next step's start (parallel/eplb/migration.py)
    in-step   OnlineBalancer(staged=False), the schedule before: each layer copied into the live slots inside
              the step that hands it out

A decode step (no prefill token) is "migrating" from the trigger until the balancer has switched every layer,
else "steady". Reported: p50 / p99 of the engine's step time per class and their ratio to steady (target
for staged: p99 <= 1.2x), the bytes the workers moved against the plan (changed slots x expert bytes), and
the load average around each run (the machine is shared: the figures are taken under that load).
Results: stdout and bench_eplb_migration.json.
"""
from __future__ import annotations

import os
import sys

from common import apply_threads, machine_info, make_parser, write_json

import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.parallel.eplb.rebalance import rebalance_experts
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig

NUM_REQUESTS = 4
EP, REDUNDANT = 2, 2
WARMUP_STEPS = 4  # decode steps before the first trigger (and outside every class)


def two_targets(model: LatentMoEForCausalLM) -> list[torch.Tensor]:
    """The balancer's placements [MoE layers, P] for experts {0, 4} hot and for {1, 5} hot."""
    moe, layers = model.config.moe, sum(model.config.is_moe_layer(i) for i in range(model.config.num_layers))
    targets = []
    for hot in ([0, 4], [1, 5]):
        window = torch.ones(layers, moe.num_experts)
        window[:, hot] = 50.0
        targets.append(rebalance_experts(window, moe.num_experts + REDUNDANT, moe.n_group, 1, EP, refine=True)[0])
    return targets


def percentiles(seconds: list[float]) -> dict:
    times = torch.tensor(seconds, dtype=torch.float64) * 1e3
    return {"steps": len(seconds), "p50_ms": float(times.quantile(0.5)), "p99_ms": float(times.quantile(0.99)),
            "max_ms": float(times.max())}


def measure(width: int, tokens: int, period: int, layers_per_step: int) -> dict:
    """Step times of one EP2 engine, by class (module docstring), and bytes moved against the plan."""
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny").to_dict()
    config["moe"] = config["moe"] | {"expert_intermediate_size": width}
    model = LatentMoEForCausalLM(ModelConfig.from_dict(config)).eval()
    service = {"model": {"preset": "tiny", "max_model_len": tokens + 64},
               "memory": {"max_num_seqs": NUM_REQUESTS, "block_size": 16, "cache_bytes": 16_000_000},
               "scheduler": {"max_batch_size": NUM_REQUESTS, "prefill_chunk_size": 32},
               "parallel": {"expert_parallel_size": EP},
               "eplb": {"enabled": True, "num_redundant_experts": REDUNDANT, "window_steps": 100,
                        "rebalance_interval_steps": 10 ** 9, "layers_per_step": layers_per_step}}
    targets = two_targets(model)
    engine = Engine(model, ServiceConfig.from_dict(service))
    balancer = engine.balancer
    classes = {"steady": [], "staged": [], "in-step": []}
    rebalances = {"staged": 0, "in-step": 0}
    try:
        for i in range(NUM_REQUESTS):
            engine.add_request([(7 * i + j) % 500 + 1 for j in range(8 + 3 * i)], SamplingParams(max_tokens=tokens))
        decode_steps, schedule, triggered_at = 0, "staged", None
        while engine.has_unfinished():
            if (decode_steps >= WARMUP_STEPS and (decode_steps - WARMUP_STEPS) % period == 0
                    and triggered_at != decode_steps and not balancer.migrating()):
                schedule = "in-step" if rebalances["staged"] > rebalances["in-step"] else "staged"
                balancer.staged = schedule == "staged"
                balancer.rebalance_next_step(targets[sum(rebalances.values()) % 2])
                rebalances[schedule] += 1
                triggered_at = decode_steps
            label = schedule if balancer.migrating() else "steady"
            engine.step()
            record = engine.log.steps[-1]
            if record.prefill_tokens or not record.decode_tokens:
                continue
            if decode_steps >= WARMUP_STEPS:
                classes[label].append(record.duration)
            decode_steps += 1
        stats = engine.stats()
    finally:
        engine.close()
    expert_bytes = 3 * model.config.moe.latent_size * width * 4
    steady = percentiles(classes["steady"])
    result = {"expert_width": width, "expert_bytes": expert_bytes, "rebalances": rebalances, "steady": steady,
              "bytes_moved": stats["eplb_bytes_moved"], "bytes_planned": balancer.slots_moved * expert_bytes}
    for schedule in ("staged", "in-step"):
        figures = percentiles(classes[schedule])
        result[schedule] = figures | {"p50_ratio": figures["p50_ms"] / steady["p50_ms"],
                                      "p99_ratio": figures["p99_ms"] / steady["p99_ms"]}
    return result


def report(result: dict) -> None:
    print(f"EP2 + {REDUNDANT} redundant, tiny with {result['expert_width']}-wide experts "
          f"({result['expert_bytes']:,} B fp32), layers_per_step {result['layers_per_step']}, {NUM_REQUESTS} "
          f"requests x {result['tokens']} tokens, rebalances {result['rebalances']}")
    print(f"load average (1, 5, 15 min) before {result['loadavg_before']}, after {result['loadavg_after']}: "
          f"a shared machine")
    print(f"{'decode steps':<12}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}{'p50 x':>8}{'p99 x':>8}")
    for name in ("steady", "staged", "in-step"):
        row = result[name]
        ratios = ("", "") if name == "steady" else (f"{row['p50_ratio']:.2f}", f"{row['p99_ratio']:.2f}")
        print(f"{name:<12}{row['steps']:>6}{row['p50_ms']:>10.1f}{row['p99_ms']:>10.1f}{row['max_ms']:>10.1f}"
              f"{ratios[0]:>8}{ratios[1]:>8}")
    staged_p99 = result["staged"]["p99_ratio"]
    print(f"target p99 (staged) <= 1.2x steady: {'met' if staged_p99 <= 1.2 else 'missed'} ({staged_p99:.2f}x); "
          f"bytes moved {result['bytes_moved']:,} == planned {result['bytes_planned']:,}: "
          f"{result['bytes_moved'] == result['bytes_planned']}")


def main(argv: list[str] | None = None) -> dict:
    parser = make_parser(__doc__, default_threads=1)
    parser.add_argument("--expert-width", type=int, default=None, help="moe.expert_intermediate_size "
                        "(default 16384, 2048 with --quick)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per request (default 320, 64 with --quick)")
    parser.add_argument("--period", type=int, default=12, help="decode steps from one rebalance to the next")
    parser.add_argument("--layers-per-step", type=int, default=None, help="eplb.layers_per_step alone (default: "
                        "1, then 3; 1 with --quick)")
    args = parser.parse_args(argv)
    apply_threads(args)
    width = args.expert_width or (2048 if args.quick else 16384)
    tokens = args.tokens or (64 if args.quick else 320)
    layer_counts = [args.layers_per_step] if args.layers_per_step else [1] if args.quick else [1, 3]
    runs = []
    for layers_per_step in layer_counts:
        load_before = os.getloadavg()
        result = measure(width, tokens, args.period, layers_per_step)
        runs.append(dict(layers_per_step=layers_per_step, tokens=tokens, loadavg_before=load_before,
                         loadavg_after=os.getloadavg(), **result))
        report(runs[-1])
    out = machine_info(quick=args.quick, period=args.period, runs=runs)
    print(f"wrote {write_json(__file__, out)}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
