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

--minutes M trains mini (the train preset's lr, warm-up and betas, bias updates) and then the dense model
(same batch, lr 1e-3) for M minutes of training time each on the standard-library corpus, each with its
cosine decay ending at M minutes (`timed_cosine`), and evaluates both on the same held-out rows (bits per
byte) every M/4 minutes. It needs a quiet machine to mean anything.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path

import torch
from bench_train_parts import (ComponentTimer, DenseCausalLM, dense_like, heldout_bits_per_byte, matmul_gflops,
                               model_flops_per_token)
from common import apply_threads, machine_info, make_parser, write_json

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.compiled import compile_training
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.training.lm import PRESET_DEFAULTS, warmup_cosine


def mini_trainer(config: ModelConfig, lr: float, warmup: int, total_steps: int, lr_factor=None):
    """(model, step(ids) -> loss): the train loop's step on one process (training/lm.py), without accelerate.
    lr_factor: the scheduler's multiplier (default: warm-up + cosine over total_steps, as `train`)."""
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(config)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.95), fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor or warmup_cosine(warmup, total_steps, 0.1))
    moe_layers = [block.ffn for block in model.layers if isinstance(block.ffn, LatentMoE)]

    def step(ids: torch.Tensor) -> float:
        output = model(ids, labels=ids)
        total = output.loss + output.aux_loss
        total.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not (torch.isfinite(total.detach()) and torch.isfinite(grad_norm)):
            raise FloatingPointError("non-finite loss or gradient norm")
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        for layer in moe_layers:
            layer.update_bias(layer.last_expert_counts)
        return float(output.loss.detach())

    return model, step


def dense_trainer(config: ModelConfig, seq_len: int, lr: float, warmup: int, total_steps: int, lr_factor=None):
    torch.manual_seed(0)
    model = dense_like(config, seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor or warmup_cosine(warmup, total_steps, 0.1))

    def step(ids: torch.Tensor) -> float:
        loss = model.loss(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return model, step


def speed(config: ModelConfig, batch: int, seq_len: int, steps: int, split: bool, compiled: bool = False) -> dict:
    """Interleaved step times of mini and the dense reference (and, with `compiled`, of mini under
    compiled.compile_training, after timing its first step: the compilation), their FLOPs and utilization."""
    ids = torch.randint(0, 256, (batch, seq_len))
    mini, mini_step = mini_trainer(config, 1e-3, 1, 10 ** 6)
    dense, dense_step = dense_trainer(config, seq_len, 1e-3, 1, 10 ** 6)
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


def quality(config: ModelConfig, batch: int, seq_len: int, minutes: float, eval_rows: int) -> dict:
    """Held-out bits/byte against training time, mini then dense, `minutes` each on the stdlib corpus, each
    with the train preset's warm-up and a cosine decay that ends at `minutes` (timed_cosine)."""
    from latentmoe_lab.training.corpus import batch_rows, load_corpus, pack

    corpus = load_corpus(None, 0.02, verbose=False)
    train_rows, held_rows = pack(corpus.train, seq_len), pack(corpus.held_out, seq_len)
    picked = held_rows[torch.linspace(0, len(held_rows) - 1, min(eval_rows, len(held_rows))).round().long()].long()
    mini_defaults = PRESET_DEFAULTS["mini"]
    out = {}
    for name in ("mini", "dense"):
        clock = {"started": time.perf_counter()}
        schedule = timed_cosine(mini_defaults["warmup"], minutes * 60, lambda: time.perf_counter() - clock["started"])
        if name == "mini":
            model, step = mini_trainer(config, mini_defaults["lr"], mini_defaults["warmup"], 0, schedule)
            evaluate = lambda: heldout_bits_per_byte(lambda ids: model(ids, labels=ids).loss, picked)  # noqa: E731
        else:
            model, step = dense_trainer(config, seq_len, 1e-3, mini_defaults["warmup"], 0, schedule)
            evaluate = lambda: heldout_bits_per_byte(model.loss, picked)  # noqa: E731
        curve, trained, started, number = [], 0.0, time.perf_counter(), 0
        clock["started"] = started
        checkpoints = [minutes * 60 * k / 4 for k in (1, 2, 3, 4)]
        while checkpoints:
            ids = train_rows[batch_rows(number, batch, len(train_rows), 0)].long()
            step(ids)
            number += 1
            trained = time.perf_counter() - started
            if trained >= checkpoints[0]:
                checkpoints.pop(0)
                model.eval()
                curve.append({"train_s": trained, "steps": number, "bits_per_byte": evaluate()})
                model.train()
                started += time.perf_counter() - started - trained  # evaluation time is not training time
                clock["started"] = started
                print(f"  {name}: {trained / 60:.1f} min, {number} steps, held-out {curve[-1]['bits_per_byte']:.3f} "
                      f"bits/byte", flush=True)
        out[name] = curve
    out["mini_over_dense"] = out["mini"][-1]["bits_per_byte"] / out["dense"][-1]["bits_per_byte"]
    return out


def main() -> None:
    parser = make_parser(__doc__, default_threads=None, full_doc=True)
    defaults = PRESET_DEFAULTS["mini"]
    parser.add_argument("--batch", type=int, default=defaults["batch"], help="rows per step (default: train's)")
    parser.add_argument("--seq-len", type=int, default=defaults["seq_len"], help="bytes per row (default: train's)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each model (default: 5)")
    parser.add_argument("--split", action="store_true", help="also time the mini step by component")
    parser.add_argument("--minutes", type=float, default=0.0, help="train each model this long and compare "
                        "held-out bits/byte (default: 0, speed only)")
    parser.add_argument("--eval-rows", type=int, default=64, help="held-out rows per evaluation (default: 64)")
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default: bench_train.json here)")
    parser.add_argument("--compile", action="store_true", help="add a row for mini under torch.compile "
                        "(compiled.compile_training, inductor): compile time, step, eager / compiled ratio")
    args = parser.parse_args()
    apply_threads(args)
    if args.quick:
        args.batch, args.seq_len, args.steps = 4, 64, 2
    config = ModelConfig.from_preset("mini")
    load_before = os.getloadavg()
    result = {"speed": speed(config, args.batch, args.seq_len, args.steps, args.split, args.compile)}
    if args.minutes > 0:
        result["quality"] = quality(config, args.batch, args.seq_len, args.minutes, args.eval_rows)
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
        print(f"held-out bits/byte after {q['mini'][-1]['train_s'] / 60:.1f} min: mini {q['mini'][-1]['bits_per_byte']:.3f}, "
              f"dense {q['dense'][-1]['bits_per_byte']:.3f} (mini / dense {q['mini_over_dense']:.3f})")


if __name__ == "__main__":
    main()
