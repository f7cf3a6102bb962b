"""Native layouts (torch's FSDP2 / DTensor TP / autograd EP / pipelining): step time and bytes per step vs one process.

Every layout trains the same global batch with NativeTrainer (gloo on CPU, one torch thread per
process). Per layout: warm-up steps, then the mean of the timed steps (barrier to barrier, so the
slowest rank sets it), as a ratio to the one-process step time measured in the same run; then one
more step under CollectiveMeter and RoutingRecorder gives each rank's bytes per kind
(native/traffic.py's counting convention), and, where FSDP2 or EP moves bytes, whether they equal
plan_step_bytes exactly.

    python benchmarks/bench_native.py              # tiny, global batch 8 x 64, 2 warm-up + 3 timed steps
    python benchmarks/bench_native.py --quick      # 1 + 1 steps, batch 4 x 32: checks the harness
    python benchmarks/bench_native.py --eplb       # EP2 and EP4 before / after EPLB placements (below)

--eplb: skewed traffic (the routing bias of experts 0-3, which the contiguous layout puts on ep rank 0 of
EP2 and ranks 0-1 of EP4, raised by 0.5 in every MoE layer, so nearly every token picks two of them). Per
layout, from one checkpoint (tiny: 8 experts, top-2): train with the contiguous experts, rebalance_experts
on the step counts of the warm-up, then train again (same batches) with the experts in that placement: E
slots (a permutation), then E + ep slots (one replica slot per rank). Each phase: the
(token, expert) pairs each ep rank's experts computed over the timed steps, the step time, and whether the
planned All-to-All bytes (which follow the placement) equal the measured ones.

The machine these figures come from has 2 CPU cores shared with other jobs: 4 processes
oversubscribe it, so a ratio above 1 measures the cores as much as the layout. The figures say
what each layout does on this machine, not what it would do on 4 real devices.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from common import apply_threads, machine_info, make_parser, write_json

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.native.layout import NativeLayout

LAYOUTS = {  # name -> layout (the process count is its world size)
    "1 process": NativeLayout(),
    "FSDP2x2 (2 proc)": NativeLayout(dp_shard=2),
    "TP2": NativeLayout(tp=2),
    "EP2": NativeLayout(ep=2),
    "FSDP2x2 (4 proc, dp_shard=4)": NativeLayout(dp_shard=4),
    "EP2xTP2": NativeLayout(ep=2, tp=2),
    "FSDP2xEP2": NativeLayout(dp_shard=2, ep=2),
    "PP2xTP2": NativeLayout(pp=2, tp=2),
}
PLANNED = ("fsdp.", "ep.")


def bench_worker(layouts: list[NativeLayout], preset: str, batch: int, seq_len: int, warmup: int,
                 steps: int, threads: int) -> list[dict]:
    """On each rank: per layout, time `steps` steps after `warmup`, then meter one step."""
    import torch.distributed as dist

    from latentmoe_lab.native.build import build_native
    from latentmoe_lab.native.layout import build_mesh
    from latentmoe_lab.native.train import NativeTrainer
    from latentmoe_lab.native.traffic import CollectiveMeter, RoutingRecorder, plan_step_bytes
    from latentmoe_lab.parallel.mesh import init_distributed

    init_distributed(300)
    torch.set_num_threads(threads)  # after: accelerate sets cores / local processes when OMP_NUM_THREADS is unset
    config = ModelConfig.from_preset(preset)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (batch, seq_len), generator=generator)
               for _ in range(warmup + steps + 1)]
    results = []
    for layout in layouts:
        native = build_native(config, layout, build_mesh(layout))
        trainer = NativeTrainer(native)
        for ids in batches[:warmup]:
            trainer.step(ids)
        losses, each_s = [], []
        for ids in batches[warmup:warmup + steps]:
            dist.barrier()
            start = time.perf_counter()
            losses.append(trainer.step(ids)["loss"])
            dist.barrier()
            each_s.append(time.perf_counter() - start)
        with CollectiveMeter() as meter, RoutingRecorder(native.module) as routing:
            trainer.step(batches[-1])
        planned = {}
        if layout.pp == 1 or layout.data_shards == 1:
            planned = dict(plan_step_bytes(native, layout, routing.gathered(native.mesh["ep"])))
        # a kind with no bytes (a rank that sent no pair: 0 id bytes) is left out, as the plan leaves it out
        measured = {k: n for k, n in meter.bytes.items() if k.startswith(PLANNED) and n}
        results.append({"step_s": sum(each_s) / steps, "each_step_s": each_s, "bytes": dict(meter.bytes),
                        "calls": dict(meter.calls),
                        "planned": planned, "plan_exact": measured == planned if planned or measured else None,
                        "final_loss": losses[-1]})
    return results


EPLB_LAYOUTS = {"EP2": NativeLayout(ep=2), "EP4": NativeLayout(ep=4)}
HOT_EXPERTS, HOT_BIAS = (0, 1, 2, 3), 0.5


def skewed_checkpoint(preset: str, directory: str) -> None:
    """A seeded model whose routers prefer HOT_EXPERTS in every MoE layer (the bias picks, never weighs)."""
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(ModelConfig.from_preset(preset))
    for block in model.layers:
        if block.is_moe:
            block.ffn.correction_bias[list(HOT_EXPERTS)] += HOT_BIAS
    model.save_pretrained(directory)


def _timed_phase(native, batches: list[torch.Tensor], warmup: int) -> dict:
    """Train `batches` (the first `warmup` untimed); counts of the warm-up, pairs per rank of the timed steps."""
    import torch.distributed as dist

    from latentmoe_lab.native.eplb import pairs_per_rank, placed_layers
    from latentmoe_lab.native.train import NativeTrainer
    from latentmoe_lab.native.traffic import CollectiveMeter, RoutingRecorder, plan_step_bytes

    trainer, layout = NativeTrainer(native), native.layout
    config = native.module.config
    counts = sum(trainer.step(ids)["counts"] for ids in batches[:warmup])
    placed = {int(name.split(".")[1]): row for name, row in placed_layers(native.module).items()}
    pairs, each_s = torch.zeros(layout.ep, dtype=torch.int64), []
    for ids in batches[warmup:]:
        dist.barrier()
        start = time.perf_counter()
        with CollectiveMeter() as meter, RoutingRecorder(native.module) as routing:
            loss = trainer.step(ids)["loss"]
        dist.barrier()
        each_s.append(time.perf_counter() - start)
        calls = routing.gathered(native.mesh["ep"])
        for call in calls:
            pairs += pairs_per_rank(call.indices, config.moe.num_experts, layout.ep, placed.get(call.layer))
        planned = dict(plan_step_bytes(native, layout, calls))
        exact = planned == {k: n for k, n in meter.bytes.items() if k.startswith(PLANNED) and n}
    return {"warmup_counts": counts, "pairs_per_rank": pairs.tolist(), "step_s": sum(each_s) / len(each_s),
            "min_step_s": min(each_s), "plan_exact": exact, "final_loss": loss}


PHASES = ("contiguous", "balanced", "balanced + 1 redundant slot per rank")


def eplb_worker(layout: NativeLayout, checkpoint: str, preset: str, batch: int, seq_len: int, warmup: int,
                steps: int, threads: int) -> dict:
    """PHASES: contiguous experts; then the placements rebalance_experts draws from the contiguous phase's
    warm-up counts, with E slots (a permutation) and with E + ep slots (one replica slot per rank)."""
    from latentmoe_lab.native.build import build_native
    from latentmoe_lab.native.layout import build_mesh
    from latentmoe_lab.parallel.eplb.rebalance import rebalance_experts
    from latentmoe_lab.parallel.mesh import init_distributed

    init_distributed(300)
    torch.set_num_threads(threads)
    config = ModelConfig.from_preset(preset)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (batch, seq_len), generator=generator)
               for _ in range(warmup + steps)]
    results = {PHASES[0]: _timed_phase(build_native(config, layout, build_mesh(layout), checkpoint), batches, warmup)}
    counts = results[PHASES[0]]["warmup_counts"].double()
    for phase, slots in zip(PHASES[1:], (config.moe.num_experts, config.moe.num_experts + layout.ep)):
        placement = rebalance_experts(counts, slots, 1, 1, layout.ep, refine=True)[0]
        native = build_native(config, layout, build_mesh(layout), checkpoint, placement=placement)
        results[phase] = _timed_phase(native, batches, warmup) | {"placement": placement}
    return results


def run_eplb(preset: str, batch: int, seq_len: int, warmup: int, steps: int, threads: int) -> list[dict]:
    import tempfile

    from latentmoe_lab.parallel.launch import launch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        skewed_checkpoint(preset, tmp)
        for name, layout in EPLB_LAYOUTS.items():
            ranks = launch(eplb_worker, layout.world_size, timeout_s=900,
                           args=(layout, tmp, preset, batch, seq_len, warmup, steps, threads))
            for phase in PHASES:
                pairs = ranks[0][phase]["pairs_per_rank"]
                placement = ranks[0][phase].get("placement")
                rows.append({"layout": name, "phase": phase, "pairs_per_rank": pairs,
                             "mean_over_max": sum(pairs) / len(pairs) / max(pairs),
                             "step_s": max(r[phase]["step_s"] for r in ranks),
                             "min_step_s": max(r[phase]["min_step_s"] for r in ranks),
                             "planned_equals_measured": all(r[phase]["plan_exact"] for r in ranks),
                             "final_loss": ranks[0][phase]["final_loss"],
                             "placement": None if placement is None else placement.tolist()})
    for row in rows:
        print(f"{row['layout']:4s} {row['phase']:38s} pairs per rank {row['pairs_per_rank']}  mean/max "
              f"{row['mean_over_max']:.3f}  step {row['step_s'] * 1e3:.0f} ms (min {row['min_step_s'] * 1e3:.0f})  "
              f"plan==measured {row['planned_equals_measured']}  loss {row['final_loss']:.6f}")
    return rows


def in_this_process(fn, args: tuple):
    """fn(*args) as the only rank of a gloo group on 127.0.0.1, destroyed afterwards."""
    import torch.distributed as dist

    from latentmoe_lab.parallel.launch import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        return fn(*args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(preset: str, batch: int, seq_len: int, warmup: int, steps: int, threads: int) -> list[dict]:
    from latentmoe_lab.parallel.launch import launch

    by_world: dict[int, list[str]] = {}
    for name, layout in LAYOUTS.items():
        by_world.setdefault(layout.world_size, []).append(name)
    rows = {}
    # the one-process run last and in this process (launch starts 2 or more): launch forks, and the
    # children must not inherit a process group
    for world, names in sorted(by_world.items(), key=lambda item: item[0] == 1):
        args = ([LAYOUTS[n] for n in names], preset, batch, seq_len, warmup, steps, threads)
        per_rank = [in_this_process(bench_worker, args)] if world == 1 else launch(bench_worker, world, args=args,
                                                                                    timeout_s=900)
        for i, name in enumerate(names):
            ranks = [r[i] for r in per_rank]
            kinds = sorted({k for r in ranks for k in r["bytes"]})
            rows[name] = {"layout": name, "processes": world, "step_s": max(r["step_s"] for r in ranks),
                          "min_step_s": min(max(steps) for steps in zip(*(r["each_step_s"] for r in ranks))),
                          "each_step_s_rank0": ranks[0]["each_step_s"],
                          "bytes_per_step_mean_over_ranks": {k: sum(r["bytes"].get(k, 0) for r in ranks) / world
                                                             for k in kinds},
                          "bytes_per_step_per_rank": [r["bytes"] for r in ranks],
                          "planned_per_rank": [r["planned"] for r in ranks],
                          "calls_per_step_rank0": ranks[0]["calls"],
                          "planned_equals_measured": (None if all(r["plan_exact"] is None for r in ranks)
                                                      else all(r["plan_exact"] is not False for r in ranks)),
                          "final_loss": ranks[0]["final_loss"]}
    one = rows["1 process"]["step_s"]
    for row in rows.values():
        row["step_time_vs_one_process"] = row["step_s"] / one
        row["min_step_time_vs_one_process"] = row["min_step_s"] / rows["1 process"]["min_step_s"]
    return [rows[name] for name in LAYOUTS]


def print_table(results: list[dict], param_bytes: int) -> None:
    print(f"{'layout':30s} {'proc':>4s} {'step s':>7s} {'x 1 proc':>8s} {'min x 1':>8s} {'plan==meas':>10s} "
          f"{'kB/step':>9s}")
    for r in results:
        plan = {None: "-", True: "yes", False: "NO"}[r["planned_equals_measured"]]
        total = sum(r["bytes_per_step_mean_over_ranks"].values())
        print(f"{r['layout']:30s} {r['processes']:>4d} {r['step_s']:>7.3f} {r['step_time_vs_one_process']:>8.2f} "
              f"{r['min_step_time_vs_one_process']:>8.2f} {plan:>10s} {total / 1e3:>9.1f}")
        kinds = {k: n for k, n in r["bytes_per_step_mean_over_ranks"].items() if n}
        if kinds:
            print("    " + ", ".join(f"{k} {n / 1e3:.1f} kB" for k, n in kinds.items()))
    print("(step s: mean of the timed steps; min x 1: fastest step against the fastest one-process step, the "
          "figure least\n moved by other jobs on the shared cores; bytes: per rank per step, mean over ranks; the "
          f"model's parameters are {param_bytes / 1e3:.1f} kB in fp32)")


def main() -> None:
    parser = make_parser(__doc__, default_threads=1)
    parser.add_argument("--preset", default="tiny", choices=["tiny", "mini"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout (default: 3)")
    parser.add_argument("--eplb", action="store_true", help="EP2 / EP4 before and after an EPLB placement "
                        "(writes bench_native_eplb.json)")
    args = parser.parse_args()
    apply_threads(args)
    batch, seq_len, warmup, steps = (4, 32, 1, 1) if args.quick else (8, 64, 2, args.steps)
    if args.eplb:
        rows = run_eplb(args.preset, batch, seq_len, warmup, steps, args.threads)
        setup = dict(preset=args.preset, global_batch=batch, seq_len=seq_len, warmup_steps=warmup, timed_steps=steps,
                     hot_experts=list(HOT_EXPERTS), hot_bias=HOT_BIAS)
        out = Path(__file__).with_name("bench_native_eplb.json")
        machine = machine_info(quick=args.quick, threads_per_process=args.threads, backend="gloo (CPU)",
                               load_average_1min=os.getloadavg()[0])
        print(f"results: {write_json(__file__, dict(machine=machine, setup=setup, results=rows), out)}")
        return
    with torch.device("meta"):
        model = LatentMoEForCausalLM(ModelConfig.from_preset(args.preset))
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    load_before = os.getloadavg()[0]
    results = run(args.preset, batch, seq_len, warmup, steps, args.threads)
    print_table(results, param_bytes)
    machine = machine_info(quick=args.quick, threads_per_process=args.threads, backend="gloo (CPU)",
                           note="2 CPU cores shared with other engineers' jobs: the 4-process layouts "
                                "oversubscribe them (4 processes on 2 cores), so their step times are "
                                "upper bounds, and any ratio to one process includes that contention",
                           load_average_1min=[load_before, os.getloadavg()[0]])
    setup = dict(preset=args.preset, global_batch=batch, seq_len=seq_len, warmup_steps=warmup, timed_steps=steps,
                 param_bytes_fp32=param_bytes, param_dtype="fp32",
                 convention="per rank per step: all-gather = output - input bytes, reduce-scatter = input - "
                            "output, all-to-all = bytes sent to other ranks, p2p = bytes sent, all-reduce / "
                            "broadcast = tensor bytes (latentmoe_lab/native/traffic.py)")
    print(f"results: {write_json(__file__, dict(machine=machine, setup=setup, results=results))}")


if __name__ == "__main__":
    main()
