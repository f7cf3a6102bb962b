"""K3's three model switches on mini: held-out bits/byte and expert balance, at equal steps and at equal minutes.

Variants, each trained from the same seed on the same standard-library batches for --steps steps (the train
preset's lr, warm-up and cosine over --steps, bench_train's `mini_trainer`: `latentmoe-lab train --preset
mini`'s step on one process):

    baseline     mini as it ships (SwiGLU experts, plain residuals, the sign bias rule)
    situ         moe.activation "situ" (b1 = 4, b2 = 25)
    attnres      attn_res_block_size --block (layers per block; mini has 4 layers)
    quantile     moe.bias_update "quantile"
    all          the three together (the published K3's choices)

Why steps and not a wall-clock budget per variant: on a shared machine the load moves between variants run
one after the other (a 6-minute budget gave 26 to 123 steps in one earlier run), so minutes would compare the
machine, not the switches. Instead:

- quality at equal steps (equal tokens): held-out bits/byte every --steps/4 steps, the same held-out rows;
- the step time of each variant against baseline, measured interleaved in one loop (baseline, situ, ...,
  baseline, ... on fresh models, --timing-rounds rounds, medians), so a load spike hits them all alike;
- quality at equal minutes, derived: a variant whose step takes r x baseline's gets steps / r in baseline's
  time for `steps`; its bits/byte there is read off its own curve (linear between evaluated points).
  This reads a run whose cosine ends at `steps` before its learning rate has decayed, so it is pessimistic
  for the slower variant (a run planned for those minutes would have annealed by then).

Balance: max / mean tokens per expert, averaged over the MoE layers, over the last tenth of training and on
the held-out rows. One seed: differences of a few hundredths of a bit per byte are within run-to-run noise.

    python benchmarks/bench_k3_ablation.py --threads 1                # 450 steps (mini's train default)
    python benchmarks/bench_k3_ablation.py --quick                    # 8 steps each: checks the harness
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
from bench_train import mini_trainer
from bench_train_parts import heldout_bits_per_byte
from common import apply_threads, machine_info, make_parser, write_json

from latentmoe_lab import ModelConfig
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.training.corpus import batch_rows, load_corpus, pack
from latentmoe_lab.training.lm import PRESET_DEFAULTS

VARIANTS = ("baseline", "situ", "attnres", "quantile", "all")


def variant_config(name: str, block: int) -> ModelConfig:
    base = ModelConfig.from_preset("mini")
    moe = base.to_dict()["moe"]
    if name in ("situ", "all"):
        moe["activation"] = "situ"
    if name in ("quantile", "all"):
        moe["bias_update"] = "quantile"
    return base.replace(moe=moe, attn_res_block_size=block if name in ("attnres", "all") else None)


def _moe_layers(model) -> list[LatentMoE]:
    return [block.ffn for block in model.layers if isinstance(block.ffn, LatentMoE)]


def _max_over_mean(layers: list[LatentMoE]) -> float:
    ratios = [float(layer.last_expert_counts.max()) / float(layer.last_expert_counts.float().mean())
              for layer in layers]
    return sum(ratios) / len(ratios)


def _evaluate(model, held_rows) -> tuple[float, float]:
    """(held-out bits/byte, held-out max/mean load) of the model in eval mode; leaves it in train mode."""
    model.eval()
    with torch.no_grad():
        bits = heldout_bits_per_byte(lambda ids: model(ids, labels=ids).loss, held_rows)
        balance = []
        for start in range(0, len(held_rows), 8):
            model(held_rows[start:start + 8])
            balance.append(_max_over_mean(_moe_layers(model)))
    model.train()
    return bits, sum(balance) / len(balance)


def train_variant(name: str, block: int, steps: int, batch: int, train_rows, held_rows) -> dict:
    """Train one variant for `steps` steps; bits/byte at every quarter of them."""
    defaults = PRESET_DEFAULTS["mini"]
    model, step = mini_trainer(variant_config(name, block), defaults["lr"], min(defaults["warmup"], steps), steps)
    layers = _moe_layers(model)
    marks = sorted({max(1, round(steps * q / 4)) for q in range(1, 5)})
    balance, curve, started = [], [], time.perf_counter()
    for number in range(steps):
        step(train_rows[batch_rows(number, batch, len(train_rows), 0)].long())
        balance.append(_max_over_mean(layers))
        if number + 1 in marks:
            curve.append([number + 1, _evaluate(model, held_rows)[0]])
    trained = time.perf_counter() - started
    bits, held_balance = _evaluate(model, held_rows)
    tail = balance[-max(1, len(balance) // 10):]
    return {"steps": steps, "wall_s": trained, "heldout_bits_per_byte": bits, "curve": curve,
            "train_tail_max_over_mean": sum(tail) / len(tail), "heldout_max_over_mean": held_balance}


def interleaved_step_times(names, block: int, batch: int, train_rows, rounds: int, steps_per_turn: int) -> dict:
    """Median seconds per training step of each variant, the variants taking turns on fresh models."""
    defaults = PRESET_DEFAULTS["mini"]
    trainers = {name: mini_trainer(variant_config(name, block), defaults["lr"], 1, 10**6)[1] for name in names}
    times = {name: [] for name in names}
    for number in range(rounds):
        for name in names:
            ids = train_rows[batch_rows(number, batch, len(train_rows), 0)].long()
            trainers[name](ids)  # one unmeasured step: the turn's first touches cold weights
            started = time.perf_counter()
            for _ in range(steps_per_turn):
                trainers[name](ids)
            times[name].append((time.perf_counter() - started) / steps_per_turn)
    return {name: statistics.median(values) for name, values in times.items()}


def bits_at(curve: list[list[float]], step: float) -> float:
    """The curve's bits/byte at `step` (linear between evaluated points, clamped to the first and last)."""
    if step <= curve[0][0]:
        return curve[0][1]
    for (s0, b0), (s1, b1) in zip(curve, curve[1:]):
        if step <= s1:
            return b0 + (b1 - b0) * (step - s0) / (s1 - s0)
    return curve[-1][1]


def main() -> None:
    parser = make_parser(__doc__, default_threads=1, full_doc=True)
    defaults = PRESET_DEFAULTS["mini"]
    parser.add_argument("--steps", type=int, default=defaults["steps"], help="training steps per variant "
                        f"(default {defaults['steps']}, `train --preset mini`'s)")
    parser.add_argument("--block", type=int, default=2, help="attn_res_block_size for the AttnRes variants")
    parser.add_argument("--batch", type=int, default=defaults["batch"], help="rows per step (default: train's)")
    parser.add_argument("--seq-len", type=int, default=defaults["seq_len"], help="bytes per row (default: train's)")
    parser.add_argument("--eval-rows", type=int, default=64, help="held-out rows (default 64)")
    parser.add_argument("--timing-rounds", type=int, default=5, help="rounds of the interleaved step timing (5)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default: bench_k3_ablation.json here)")
    args = parser.parse_args()
    apply_threads(args)
    if args.quick:
        args.steps, args.eval_rows, args.timing_rounds = 8, 16, 1
    names = ["baseline"] + [name for name in args.variants if name != "baseline"]
    corpus = load_corpus(None, 0.02, verbose=False)
    train_rows, held = pack(corpus.train, args.seq_len), pack(corpus.held_out, args.seq_len)
    held_rows = held[torch.linspace(0, len(held) - 1, min(args.eval_rows, len(held))).round().long()].long()
    load_before = os.getloadavg()
    result = {"steps": args.steps, "block": args.block, "batch": args.batch, "seq_len": args.seq_len}
    for name in names:
        result[name] = train_variant(name, args.block, args.steps, args.batch, train_rows, held_rows)
        r = result[name]
        print(f"{name:>9}: {r['steps']} steps in {r['wall_s']:.0f} s, held-out {r['heldout_bits_per_byte']:.3f} "
              f"bits/byte, max/mean load {r['train_tail_max_over_mean']:.2f} (last tenth of training), "
              f"{r['heldout_max_over_mean']:.2f} (held-out)", flush=True)
    step_s = interleaved_step_times(names, args.block, args.batch, train_rows, args.timing_rounds, 2)
    for name in names:
        ratio = step_s[name] / step_s["baseline"]
        equal_minutes_steps = args.steps / ratio
        result[name].update(step_s_interleaved=step_s[name], step_time_vs_baseline=ratio,
                            equal_minutes_steps=equal_minutes_steps,
                            equal_minutes_bits_per_byte=bits_at(result[name]["curve"], equal_minutes_steps))
        print(f"{name:>9}: step {ratio:.2f}x baseline's (interleaved), at baseline's minutes "
              f"{result[name]['equal_minutes_bits_per_byte']:.3f} bits/byte", flush=True)
    result["machine"] = machine_info(quick=args.quick, loadavg_before=load_before, loadavg_after=os.getloadavg())
    print(f"results: {write_json(__file__, result, out=args.out)}")


if __name__ == "__main__":
    main()
