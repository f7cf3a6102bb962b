"""K3's three model switches on mini: held-out bits/byte and expert balance for the same training minutes.

Variants, each trained from the same seed on the same standard-library batches for --minutes of training time
(the train preset's lr and warm-up, a cosine that ends at --minutes, bench_train's `mini_trainer`):

    baseline     mini as it ships (SwiGLU experts, plain residuals, the sign bias rule)
    situ         moe.activation "situ" (b1 = 4, b2 = 25)
    attnres      attn_res_block_size --block (layers per block; mini has 4 layers)
    quantile     moe.bias_update "quantile"
    all          the three together (the published K3's choices)

Reported per variant: steps done, held-out bits/byte at the end, the expert balance during the last tenth of
training (max / mean tokens per expert, averaged over the MoE layers and steps) and on the held-out rows.
The same minutes mean fewer steps for a slower variant: that is the comparison asked for (quality per
training time), and the step counts are in the JSON. One run per variant, one seed: differences of a few
hundredths of a bit per byte are within run-to-run noise, and a shared machine shifts the step counts.

    python benchmarks/bench_k3_ablation.py --threads 1 --minutes 8
    python benchmarks/bench_k3_ablation.py --quick                  # 0.2 minutes each: checks the harness
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from bench_train import mini_trainer, timed_cosine
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


def train_variant(name: str, block: int, minutes: float, batch: int, train_rows, held_rows) -> dict:
    defaults = PRESET_DEFAULTS["mini"]
    clock = {"started": time.perf_counter()}
    schedule = timed_cosine(defaults["warmup"], minutes * 60, lambda: time.perf_counter() - clock["started"])
    model, step = mini_trainer(variant_config(name, block), defaults["lr"], defaults["warmup"], 0, schedule)
    layers = _moe_layers(model)
    balance, number, started = [], 0, time.perf_counter()
    clock["started"] = started
    while time.perf_counter() - started < minutes * 60:
        step(train_rows[batch_rows(number, batch, len(train_rows), 0)].long())
        balance.append(_max_over_mean(layers))
        number += 1
    trained = time.perf_counter() - started
    model.eval()
    with torch.no_grad():
        bits = heldout_bits_per_byte(lambda ids: model(ids, labels=ids).loss, held_rows)
        held_balance = []
        for start in range(0, len(held_rows), 8):
            model(held_rows[start:start + 8])
            held_balance.append(_max_over_mean(layers))
    tail = balance[-max(1, len(balance) // 10):]
    return {"steps": number, "train_s": trained, "heldout_bits_per_byte": bits,
            "train_tail_max_over_mean": sum(tail) / len(tail),
            "heldout_max_over_mean": sum(held_balance) / len(held_balance)}


def main() -> None:
    parser = make_parser(__doc__, default_threads=1, full_doc=True)
    defaults = PRESET_DEFAULTS["mini"]
    parser.add_argument("--minutes", type=float, default=8.0, help="training minutes per variant (default 8)")
    parser.add_argument("--block", type=int, default=2, help="attn_res_block_size for the AttnRes variants")
    parser.add_argument("--batch", type=int, default=defaults["batch"], help="rows per step (default: train's)")
    parser.add_argument("--seq-len", type=int, default=defaults["seq_len"], help="bytes per row (default: train's)")
    parser.add_argument("--eval-rows", type=int, default=64, help="held-out rows (default 64)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default: bench_k3_ablation.json here)")
    args = parser.parse_args()
    apply_threads(args)
    if args.quick:
        args.minutes, args.eval_rows = 0.2, 16
    corpus = load_corpus(None, 0.02, verbose=False)
    train_rows, held = pack(corpus.train, args.seq_len), pack(corpus.held_out, args.seq_len)
    held_rows = held[torch.linspace(0, len(held) - 1, min(args.eval_rows, len(held))).round().long()].long()
    load_before = os.getloadavg()
    result = {"minutes": args.minutes, "block": args.block, "batch": args.batch, "seq_len": args.seq_len}
    for name in args.variants:
        result[name] = train_variant(name, args.block, args.minutes, args.batch, train_rows, held_rows)
        r = result[name]
        print(f"{name:>9}: {r['steps']} steps, held-out {r['heldout_bits_per_byte']:.3f} bits/byte, max/mean "
              f"load {r['train_tail_max_over_mean']:.2f} (last tenth of training), {r['heldout_max_over_mean']:.2f} "
              f"(held-out)", flush=True)
    result["machine"] = machine_info(quick=args.quick, loadavg_before=load_before, loadavg_after=os.getloadavg())
    print(f"results: {write_json(__file__, result, out=args.out)}")


if __name__ == "__main__":
    main()
