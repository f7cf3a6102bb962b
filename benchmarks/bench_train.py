"""Training-step speed of the mini preset against a dense reference transformer, and the machine's matmul rate.

One run reports, all measured in this process, the steps interleaved (mini, dense, mini, ...) so a load
spike on a shared machine hits both, medians over --steps:

    matmul rate    fp32 [1024, 1024] @ [1024, 1024], GFLOP/s (the utilization's denominator)
    mini step      `latentmoe-lab train`'s step: forward with labels, CE + aux losses, backward, the guard's
                   two finiteness checks, gradient clipping, fused AdamW, the routing-bias update
    dense step     a causal transformer built from torch's own nn.TransformerEncoderLayer (pre-norm, GELU),
                   of similar non-embedding size, same batch, fused AdamW
    model FLOPs    per token: 6 x active parameters + attention (docs/design.md §9, `model_flops_per_token`)
    utilization    model FLOP/s / matmul rate

    python benchmarks/bench_train.py --threads 1             # mini at its train defaults, 5 timed steps each
    python benchmarks/bench_train.py --quick                 # 4 x 64, 2 steps: checks the harness
    python benchmarks/bench_train.py --split                 # also the mini step by component (module hooks)
    python benchmarks/bench_train.py --threads 1 --minutes 8 # + held-out bits/byte after 8 minutes of each
    python benchmarks/bench_train.py --threads 1 --flops-steps 450   # + the race at mini's training FLOPs

--minutes M trains mini (the train preset's lr, warm-up and betas, bias updates) and the dense model (same
batch, lr 1e-3) for M minutes of training time each on the standard-library corpus, their steps interleaved
(the one with less training time so far steps next, so load swings hit both), each with its cosine decay
ending at M minutes (`timed_cosine`), and evaluates both on the same held-out rows (bits per byte) every
M/4 minutes. Minutes still depend on the machine: on a loaded one, read the ratio, not the figures. With
--race, its mini-family members (mini, mini_situ_quantile, twin_active, twin_total) all race the dense model:
    python benchmarks/bench_train.py --threads 1 --minutes 8 --race mini,mini_situ_quantile,twin_active

--flops-steps N trains mini for N steps and two dense models (bench_train_race.DENSE_SHAPES), one with mini's
active parameters and one with its total, each for the steps that spend mini's training FLOPs (model FLOPs
per token x tokens), with held-out bits/byte at each quarter: fixed steps, so it holds on a loaded machine.
bench_train_race.py draws every curve of the JSON(s) on one page.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

import torch
from bench_train_parts import ComponentTimer, dense_like, heldout_bits_per_byte, matmul_gflops, model_flops_per_token
from bench_train_race import MINI_FAMILY, RACERS, corpus_rows, flops_race, mini_family
from bench_train_steps import DENSE_LR, dense_trainer, mini_trainer
from common import apply_threads, machine_info, make_parser, write_json

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.compiled import compile_training
from latentmoe_lab.training.lm import PRESET_DEFAULTS


def speed(config: ModelConfig, batch: int, seq_len: int, steps: int, split: bool, compiled: bool = False) -> dict:
    """Interleaved step times of mini and the dense reference (and, with `compiled`, of mini under
    compiled.compile_training, after timing its first step: the compilation), their FLOPs and utilization."""
    ids = torch.randint(0, 256, (batch, seq_len))
    mini, mini_step = mini_trainer(config, 1e-3, 1, 10 ** 6)
    dense, dense_step = dense_trainer(lambda: dense_like(config, seq_len), DENSE_LR, 1, 10 ** 6)
    trainers = {"mini": (mini, mini_step), "dense": (dense, dense_step)}
    compile_s = None
    if compiled:
        trainers["mini_compiled"] = mini_trainer(config, 1e-3, 1, 10 ** 6)
        compile_training(trainers["mini_compiled"][0])
        start = time.perf_counter()
        trainers["mini_compiled"][1](ids)  # compiles forward and backward of every region
        compile_s = time.perf_counter() - start
    times = {name: [] for name in trainers}
    gflops = [matmul_gflops()]
    for _ in range(2):  # warm-up: allocator, first-call paths
        for _, step in trainers.values():
            step(ids)
    for _ in range(steps):
        for name, (_, step) in trainers.items():
            start = time.perf_counter()
            step(ids)
            times[name].append(time.perf_counter() - start)
        gflops.append(matmul_gflops(repeats=1))
    rate = statistics.median(gflops) * 1e9
    result = {"batch": batch, "seq_len": seq_len, "matmul_gflops": rate / 1e9, "matmul_gflops_all": gflops}
    for name, (model, _) in trainers.items():
        step_s = statistics.median(times[name])
        flops = model_flops_per_token(model, seq_len)
        tokens_per_s = batch * seq_len / step_s
        result[name] = {**flops, "step_s": step_s, "step_s_all": times[name], "tokens_per_s": tokens_per_s,
                        "model_gflops_per_s": flops["flops_per_token"] * tokens_per_s / 1e9,
                        "utilization": flops["flops_per_token"] * tokens_per_s / rate}
    result["mini"]["guard_share"] = guard_share(ids, mini, result["mini"]["step_s"])
    if compiled:
        result["mini_compiled"].update(compile_s=compile_s,
                                       eager_over_compiled=result["mini"]["step_s"] / result["mini_compiled"]["step_s"])
    if split:
        result["mini"]["split_s"] = component_split(mini, mini_step, ids, steps)
    return result


def guard_share(ids: torch.Tensor, model: LatentMoEForCausalLM, step_s: float, repeats: int = 20) -> float:
    """The non-finite guard's cost per step over the step time: the per-block finite flags of the forward
    (finite.all_finite on every hidden state) and the loop's two checks (loss and gradient norm)."""
    from latentmoe_lab.finite import all_finite

    hidden = torch.randn(*ids.shape, model.config.hidden_size)
    loss, norm = torch.tensor(1.0), torch.tensor(2.0)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.stack([all_finite(hidden) for _ in range(len(model.layers) + 2)])
        bool(torch.isfinite(loss)) and bool(torch.isfinite(norm))
    return (time.perf_counter() - start) / repeats / step_s


def component_split(model, step, ids, steps: int) -> dict:
    timer = ComponentTimer(model)
    start = time.perf_counter()
    for _ in range(steps):
        step(ids)
    total = (time.perf_counter() - start) / steps
    timer.remove()
    split = {f"{phase}/{name}": seconds / steps for (phase, name), seconds in sorted(timer.seconds.items())}
    split["rest (norms, loss, AdamW, hooks)"] = total - sum(split.values())
    return {key: value / total for key, value in split.items()}


def timed_cosine(warmup: int, seconds: float, clock, min_ratio: float = 0.1):
    """lr multiplier at scheduler step s: linear warm-up over `warmup` steps, then cosine down to min_ratio
    by training time, clock() / seconds, so a run given M minutes ends its decay at M minutes whatever its
    pace (a step-count schedule sized from a speed run misses when real data runs slower than random ids)."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, clock() / seconds)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def quality(config: ModelConfig, batch: int, seq_len: int, minutes: float, rows,
            family: tuple[str, ...] = ("mini",)) -> dict:
    """Held-out bits/byte against training time of mini (and the other `family` members: bench_train_race.MINI_FAMILY,
    mini with K3's switches or its dense twins) and the dense reference, `minutes` of training each on the stdlib
    corpus, their steps interleaved: the model with the least training time so far takes the next step, so a load
    swing on a shared machine hits all alike. Each has the train preset's warm-up and a cosine decay ending at
    `minutes` of its own training time (timed_cosine); evaluations are not training time. rows:
    bench_train_race.corpus_rows. ratios: each family member's final bits/byte over the dense reference's."""
    from latentmoe_lab.training.corpus import batch_rows

    train_rows, picked = rows
    defaults, seconds = PRESET_DEFAULTS["mini"], minutes * 60
    specs = mini_family(config, family)
    trained = dict.fromkeys([*specs, "dense"], 0.0)
    runs = {}
    for name, spec in specs.items():
        model, step = mini_trainer(spec, defaults["lr"], defaults["warmup"], 0,
                                   timed_cosine(defaults["warmup"], seconds, lambda name=name: trained[name]))
        runs[name] = (model, step, lambda ids, model=model: model(ids, labels=ids).loss)
    dense, dense_step = dense_trainer(lambda: dense_like(config, seq_len), DENSE_LR, defaults["warmup"], 0,
                                      timed_cosine(defaults["warmup"], seconds, lambda: trained["dense"]))
    runs["dense"] = (dense, dense_step, dense.loss)
    steps = dict.fromkeys(runs, 0)
    checkpoints = {name: [seconds * k / 4 for k in (1, 2, 3, 4)] for name in runs}
    out = {name: [] for name in runs}
    load_before = os.getloadavg()
    while any(checkpoints.values()):
        name = min((name for name in runs if checkpoints[name]), key=trained.get)
        model, step, loss_of = runs[name]
        ids = train_rows[batch_rows(steps[name], batch, len(train_rows), 0)].long()
        start = time.perf_counter()
        step(ids)
        trained[name] += time.perf_counter() - start
        steps[name] += 1
        if trained[name] >= checkpoints[name][0]:
            checkpoints[name].pop(0)
            model.eval()
            out[name].append({"train_s": trained[name], "steps": steps[name],
                              "bits_per_byte": heldout_bits_per_byte(loss_of, picked)})
            model.train()
            print(f"  {name}: {trained[name] / 60:.1f} min, {steps[name]} steps, held-out "
                  f"{out[name][-1]['bits_per_byte']:.3f} bits/byte", flush=True)
    out["loadavg"] = {"before": load_before, "after": os.getloadavg()}
    out["ratios"] = {f"{name}_over_dense": out[name][-1]["bits_per_byte"] / out["dense"][-1]["bits_per_byte"]
                     for name in specs}
    out["mini_over_dense"] = out["ratios"].get("mini_over_dense")
    return out


def _learning_rates(text: str) -> tuple[float, ...]:
    """'1e-3,3e-3' -> (0.001, 0.003); argparse reports the error under --dense-lr."""
    try:
        rates = tuple(float(part) for part in text.split(","))
    except ValueError:
        rates = ()
    if not rates or any(not 0 < rate < 1 for rate in rates):
        raise argparse.ArgumentTypeError(f"comma-separated learning rates, each in (0, 1), are required; got {text!r}")
    return rates


def _racers(text: str) -> tuple[str, ...]:
    """'mini,dense_active' -> ("mini", "dense_active"), each one of bench_train_race.RACERS."""
    names = tuple(text.split(","))
    if not all(name in RACERS for name in names):
        raise argparse.ArgumentTypeError(f"each model must be one of {', '.join(RACERS)}; got {text!r}")
    return names


def main() -> None:
    parser = make_parser(__doc__, default_threads=None, full_doc=True)
    defaults = PRESET_DEFAULTS["mini"]
    parser.add_argument("--batch", type=int, default=defaults["batch"], help="rows per step (default: train's)")
    parser.add_argument("--seq-len", type=int, default=defaults["seq_len"], help="bytes per row (default: train's)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each model (default: 5)")
    parser.add_argument("--split", action="store_true", help="also time the mini step by component")
    parser.add_argument("--minutes", type=float, default=0.0, help="train each model this long and compare "
                        "held-out bits/byte (default: 0, speed only)")
    parser.add_argument("--flops-steps", type=int, default=0, help="race mini for this many steps against the "
                        "dense models sized to its active and total parameters, at its training FLOPs (default: 0, "
                        "no race; bench_train_race.py)")
    parser.add_argument("--race", type=_racers, default=None,
                        help="with --flops-steps: comma-separated models, of " + ", ".join(RACERS) + " (default: "
                        "mini,dense_active,dense_total; mini_situ_quantile: K3's SiTU activation and quantile bias "
                        "rule; twin_*: mini with a dense SwiGLU FFN in every layer); with --minutes, its members of "
                        + ", ".join(MINI_FAMILY) + " race the dense reference (default: mini)")
    parser.add_argument("--dense-lr", type=_learning_rates, default=(DENSE_LR,), help="with --flops-steps: "
                        f"comma-separated peak learning rates for each dense model, best raced (default: {DENSE_LR:g})")
    parser.add_argument("--eval-rows", type=int, default=64, help="held-out rows per evaluation (default: 64)")
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default: bench_train.json here)")
    parser.add_argument("--compile", action="store_true", help="add a row for mini under torch.compile "
                        "(compiled.compile_training, inductor): compile time, step, eager / compiled ratio")
    args = parser.parse_args()
    apply_threads(args)
    args.race_given = args.race is not None
    args.race = args.race or ("mini", "dense_active", "dense_total")
    if args.quick:
        args.batch, args.seq_len, args.steps = 4, 64, 2
        args.flops_steps = min(args.flops_steps, 4)
    config = ModelConfig.from_preset("mini")
    load_before = os.getloadavg()
    result = {"speed": speed(config, args.batch, args.seq_len, args.steps, args.split, args.compile)}
    rows = corpus_rows(args.seq_len, args.eval_rows) if args.minutes > 0 or args.flops_steps > 0 else None
    if args.minutes > 0:
        family = tuple(name for name in args.race if name in MINI_FAMILY) if args.race_given else ("mini",)
        result["quality"] = quality(config, args.batch, args.seq_len, args.minutes, rows, family)
    if args.flops_steps > 0:
        result["flops_race"] = flops_race(config, args.batch, args.seq_len, args.flops_steps, rows, args.race,
                                          args.dense_lr)
    result["machine"] = machine_info(quick=args.quick, loadavg_before=load_before, loadavg_after=os.getloadavg())
    report(result)
    print(f"results: {write_json(__file__, result, out=args.out)}")


def report(result: dict) -> None:
    s, m = result["speed"], result["machine"]
    print(f"torch {m['torch']}, {m['threads']} threads, load average {m['loadavg_before'][0]:.1f} -> "
          f"{m['loadavg_after'][0]:.1f}; batch {s['batch']} x {s['seq_len']}; fp32 1024^3 matmul "
          f"{s['matmul_gflops']:.1f} GFLOP/s")
    print("| model | active params | MFLOP/token | step s | tokens/s | model GFLOP/s | utilization |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for name in ("mini", "dense", "mini_compiled"):
        if name not in s:
            continue
        r = s[name]
        print(f"| {name} | {r['active_parameters'] / 1e6:.2f}M | {r['flops_per_token'] / 1e6:.1f} | {r['step_s']:.3f} | "
              f"{r['tokens_per_s']:,.0f} | {r['model_gflops_per_s']:.1f} | {100 * r['utilization']:.1f}% |")
    print(f"guard: {100 * s['mini']['guard_share']:.2f}% of a mini step")
    if "mini_compiled" in s:
        print(f"mini compiled: first step (compilation) {s['mini_compiled']['compile_s']:.1f} s; eager / compiled "
              f"step time {s['mini_compiled']['eager_over_compiled']:.2f}x")
    for key, share in s["mini"].get("split_s", {}).items():
        print(f"    {key:36s} {100 * share:5.1f}%")
    if "quality" in result:
        q = result["quality"]
        names = [*(key.removesuffix("_over_dense") for key in q["ratios"]), "dense"]
        finals = ", ".join(f"{name} {q[name][-1]['bits_per_byte']:.3f}" for name in names)
        print(f"held-out bits/byte after {q['dense'][-1]['train_s'] / 60:.1f} min: {finals} ("
              + ", ".join(f"{name} {ratio:.3f}" for name, ratio in q["ratios"].items()) + ")")
    if "flops_race" in result:
        race = result["flops_race"]
        finals = [f"{name} {run['curve'][-1]['bits_per_byte']:.3f} ({run['steps']} steps)"
                  for name, run in race["models"].items()]
        print(f"at mini's {race['budget_flops'] / 1e12:.2f} TFLOP ({race['mini_steps']} steps of {race['batch']} x "
              f"{race['seq_len']}): " + ", ".join(finals))
        print("  " + ", ".join(f"{name} {ratio:.3f}" for name, ratio in race["ratios"].items()))
        for name, sweep in race["lr_sweep"].items():
            print(f"  {name} by peak lr: " + ", ".join(f"{lr} -> {bits:.3f}" for lr, bits in sweep.items()))


if __name__ == "__main__":
    main()
