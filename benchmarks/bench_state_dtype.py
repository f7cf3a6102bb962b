"""KDA slot formats (memory.state_dtype) on the trained mini: held-out bits/byte and greedy agreement against fp32
slots at 1k, 4k and 16k tokens of context, with and without error feedback; requests per cache budget.

    .venv/bin/python benchmarks/bench_state_dtype.py                   # checkpoints/mini-stdlib, else a short mini
    .venv/bin/python benchmarks/bench_state_dtype.py --checkpoint DIR  # a save_pretrained directory
    .venv/bin/python benchmarks/bench_state_dtype.py --quick           # short contexts: the harness, not the numbers

The model: --checkpoint if given, else checkpoints/mini-stdlib (`make model`) when it exists, else the mini trained
here for --train-steps steps on one thread (runs/bench-state-dtype, reused when present); the output says which.
How a row is served: PagedPools whose KDA slots use one format and whose DSA pools are fp32 in every run. Its first
L tokens run as prefill chunks of --chunk tokens (a state is encoded once per chunk), the next --targets tokens
teacher-forced as decode steps (one write per token): bits/byte over those targets, and top-1 agreement with the
fp32 slots' logits at each of them; then --greedy tokens free-running, compared position by position with the fp32
run's greedy tokens. The "decode-only" row runs every token of its rows as a decode step, the most writes a state
sees. The mini was trained on 128-token rows: every context here is far past it, for fp32 and int8 alike.
Requests per budget: the requests of L + --greedy tokens that fit in --budget bytes (a KDA slot each and their DSA
blocks, paged_pool_bytes), by slot format, with the DSA pools in fp32 and in bf16; and the same for k3-2.8t (fp8).
Writes benchmarks/bench_state_dtype.json; the figures come from a shared, loaded machine (load average recorded).
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.paged_pools import PagedPools, PlainSlotFormat, paged_pool_bytes
from latentmoe_lab.quant.kda_state import FEEDBACK_BITS, Int8ConvFormat, Int8StateFormat
from latentmoe_lab.quant.kv import kv_formats
from latentmoe_lab.training.corpus import load_corpus, pack

from common import apply_threads, machine_info, make_parser, write_json

BLOCK = 64
ROOT = Path(__file__).resolve().parent.parent


def slot_formats(config: ModelConfig) -> dict[str, tuple[object, object]]:
    """name -> (state_format, conv_format); "int8+fbN" keeps an N-bit carry (error feedback), "int8" none."""
    conv = Int8ConvFormat(math.gcd(config.kda.head_dim_k, config.kda.head_dim_v))
    return {"fp32": (PlainSlotFormat(torch.float32), PlainSlotFormat(torch.float32)),
            "bf16": (PlainSlotFormat(torch.bfloat16), PlainSlotFormat(torch.bfloat16)),
            "int8": (Int8StateFormat(0), conv), "int8+fb4": (Int8StateFormat(4), conv),
            "int8+fb8": (Int8StateFormat(8), conv)}


def load_model(args, max_len: int) -> tuple[LatentMoEForCausalLM, str]:
    """The model with room for max_len positions, and where it came from."""
    checkpoint = Path(args.checkpoint) if args.checkpoint else ROOT / "checkpoints" / "mini-stdlib"
    if args.quick and not args.checkpoint:
        torch.manual_seed(0)
        loaded, source = LatentMoEForCausalLM(ModelConfig.from_preset("mini")), "random mini (--quick)"
    elif checkpoint.is_dir():
        loaded, source = LatentMoEForCausalLM.from_pretrained(checkpoint), f"checkpoint {checkpoint}"
    else:
        out = ROOT / "runs" / "bench-state-dtype"
        if not (out / "checkpoint").is_dir():
            from latentmoe_lab.training.lm import TrainSettings, train

            train(TrainSettings(preset="mini", steps=args.train_steps, warmup=min(30, args.train_steps // 5),
                                eval_every=args.train_steps, sample_tokens=0, out=str(out), threads=1))
        loaded = LatentMoEForCausalLM.from_pretrained(out / "checkpoint")
        source = f"the mini trained here for {args.train_steps} steps on 1 thread ({out / 'checkpoint'})"
    config = loaded.config.replace(max_position_embeddings=max(loaded.config.max_position_embeddings, max_len))
    model = LatentMoEForCausalLM(config).float().eval()  # positions past the trained table: RoPE extrapolates
    model.load_state_dict({k: v.float() for k, v in loaded.state_dict().items()})
    return model, source


@torch.no_grad()
def serve_rows(model, rows: torch.Tensor, formats, prefill: int, targets: int, greedy: int,
               chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [R, prefill + targets + 1] -> (logits [R, targets, V] predicting rows[:, prefill:prefill + targets],
    greedy tokens [R, greedy] after the teacher-forced rows[:, :prefill + targets])."""
    count, length = rows.shape[0], prefill + targets + greedy
    per_row = -(-length // BLOCK)
    pools = PagedPools(model.config, count * per_row, BLOCK, count, torch.float32, None, None, None, *formats)
    tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(count)]

    def step(new: list[list[int]], context: int) -> torch.Tensor:
        batch = ForwardBatch.from_sequences(new, [context] * count, tables, list(range(count)), BLOCK)
        return model(batch.input_ids, batch=batch, pools=pools).logits.float()

    context, logits = 0, []
    while context < prefill:
        n = min(chunk, prefill - context)
        last = step(rows[:, context:context + n].tolist(), context)
        context += n
    logits.append(last)
    for position in range(prefill, prefill + targets):
        last = step(rows[:, position:position + 1].tolist(), position)
        if position < prefill + targets - 1:
            logits.append(last)
    tokens = [last.argmax(-1)] if greedy else []
    for position in range(prefill + targets, prefill + targets + greedy - 1):
        tokens.append(step([[int(t)] for t in tokens[-1]], position).argmax(-1))
    return torch.stack(logits, dim=1), torch.stack(tokens, dim=1) if tokens else torch.zeros(count, 0)


def bits_per_byte(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean cross-entropy of logits [R, T, V] on byte targets [R, T], in bits."""
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.long().flatten())) / math.log(2)


def requests_per_budget(config: ModelConfig, budget: int, tokens: int, kv: str, formats) -> dict[str, float]:
    """Requests of `tokens` tokens that fit in `budget` bytes, and one request's bytes (KDA slot, DSA blocks)."""
    latent, index = kv_formats(config, kv, "fp32" if kv == "fp32" else "bf16")
    blocks = -(-tokens // BLOCK)
    slot = sum(paged_pool_bytes(config, 0, BLOCK, 1, torch.float32, latent, index, *formats).values())
    rows = sum(paged_pool_bytes(config, blocks, BLOCK, 0, torch.float32, latent, index, *formats).values())
    return {"requests": budget // (slot + rows), "slot_bytes": slot, "dsa_bytes": rows}


def main() -> None:
    parser = make_parser(__doc__, default_threads=1, full_doc=True)
    parser.add_argument("--checkpoint", default=None, help="a save_pretrained directory (default: see above)")
    parser.add_argument("--train-steps", type=int, default=150, help="steps of the mini trained when none exists")
    parser.add_argument("--contexts", default="1024,4096,16384", help="prefill lengths L, comma-separated")
    parser.add_argument("--rows", default="4,2,1", help="held-out rows per context (decoded together)")
    parser.add_argument("--targets", type=int, default=128, help="teacher-forced decode targets after L")
    parser.add_argument("--greedy", type=int, default=32, help="free-running greedy tokens after the targets")
    parser.add_argument("--decode-only", type=int, default=1024, help="tokens of the decode-only rows (0: none)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (the engine's prefill_chunk_size)")
    parser.add_argument("--budget", type=int, default=1 << 30, help="cache bytes of the mini's request rows")
    parser.add_argument("--k3-budget", type=int, default=64 << 30, help="cache bytes of the k3-2.8t rows")
    parser.add_argument("--out", default=None, help="the JSON file (default: next to this script)")
    args = parser.parse_args()
    apply_threads(args)
    if args.quick:
        args.contexts, args.rows, args.targets, args.greedy, args.decode_only = "256,512", "2,1", 16, 8, 64
    contexts = [int(c) for c in args.contexts.split(",")]
    counts = [int(r) for r in args.rows.split(",")]
    started, load_before = time.time(), os.getloadavg()
    model, source = load_model(args, max(contexts) + args.targets + args.greedy + 1)
    formats = slot_formats(model.config)
    held = load_corpus(None, 0.02, verbose=False).held_out
    cases = [(f"L={c}", c, args.targets, n) for c, n in zip(contexts, counts)]
    if args.decode_only:
        cases.append((f"decode-only {args.decode_only}", 1, args.decode_only - 1, 2))
    results = {}
    for name, prefill, targets, count in cases:
        length = prefill + targets + 1
        rows = pack(held, length)
        rows = rows[torch.linspace(0, rows.shape[0] - 1, count).round().long()]  # spread over the split
        runs = {key: serve_rows(model, rows, fmt, prefill, targets, args.greedy if prefill > 1 else 0, args.chunk)
                for key, fmt in formats.items()}
        truth, (base_logits, base_greedy) = rows[:, prefill:prefill + targets], runs["fp32"]
        base_bpb = bits_per_byte(base_logits, truth)
        results[name] = {}
        for key, (logits, greedy) in runs.items():
            bpb = bits_per_byte(logits, truth)
            same = (greedy == base_greedy).float()
            first = [int((~r).nonzero()[0]) if not r.all() else r.numel() for r in same.bool()]
            results[name][key] = {"bpb": bpb, "delta_bpb": bpb - base_bpb,
                                  "top1_vs_fp32": float((logits.argmax(-1) == base_logits.argmax(-1)).float().mean()),
                                  "greedy_agreement": float(same.mean()) if same.numel() else None,
                                  "greedy_first_divergence": first, "rows": count, "targets": targets}
        print(f"{name}: " + ", ".join(f"{k} {v['bpb']:.4f} ({v['delta_bpb']:+.4f})" for k, v in results[name].items()),
              flush=True)
    budgets = {}
    for preset, kvs, budget in (("mini", ("fp32", "bf16"), args.budget), ("k3-2.8t", ("fp8",), args.k3_budget)):
        config = model.config if preset == "mini" else ModelConfig.from_preset(preset)
        fmts = slot_formats(config)
        for kv in kvs:
            for context in contexts:
                key = f"{preset} kv {kv} L={context}, {budget / 2 ** 30:g} GiB"
                budgets[key] = {name: requests_per_budget(config, budget, context + args.greedy, kv, f)
                                for name, f in fmts.items()}
    load_after = os.getloadavg()
    print(f"\nmodel: {source}; load average before {load_before[0]:.1f}, after {load_after[0]:.1f} "
          f"(a shared, loaded machine); {time.time() - started:.0f} s")
    print("| context | slots | bits/byte | vs fp32 | top-1 vs fp32 | greedy agreement | first divergence |")
    print("|---|---|---:|---:|---:|---:|---|")
    for name, by_format in results.items():
        for key, r in by_format.items():
            greedy, first = (("-", "-") if r["greedy_agreement"] is None else
                             (f"{r['greedy_agreement']:.3f}", r["greedy_first_divergence"]))
            print(f"| {name} | {key} | {r['bpb']:.4f} | {r['delta_bpb']:+.4f} | {r['top1_vs_fp32']:.4f} | {greedy} | "
                  f"{first} |")
    print(f"\nrequests per cache budget (L + {args.greedy} tokens each), ratio to fp32 slots:")
    print("| model, DSA pools, context | " + " | ".join(formats) + " |")
    print("|---|" + "---:|" * len(formats))
    for key, by_format in budgets.items():
        base = by_format["fp32"]["requests"]
        print(f"| {key} | " + " | ".join(f"{r['requests']} ({r['requests'] / base:.2f}x)" for r in by_format.values())
              + " |")
    slot = {k: v["slot_bytes"] for k, v in next(iter(budgets.values())).items()}
    print("mini KDA slot bytes (3 layers, state + conv): " + ", ".join(f"{k} {v:,}" for k, v in slot.items())
          + f"; memory.state_dtype int8 is int8+fb{FEEDBACK_BITS}")
    write_json(__file__, {"model": source, "quick": args.quick, "results": results, "requests_per_budget": budgets,
                          "budget": args.budget, "slot_bytes": slot, "chunk": args.chunk,
                          "loadavg_before": load_before, "loadavg_after": load_after,
                          "seconds": time.time() - started, **machine_info()},
               Path(args.out) if args.out else
               (Path(__file__).with_name("bench_state_dtype_quick.json") if args.quick else None))


if __name__ == "__main__":
    main()
