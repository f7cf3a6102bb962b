"""Quantization on a trained model: held-out bits per byte, top-1 agreement and bytes per recipe and KV dtype.

    .venv/bin/python benchmarks/bench_quant.py --checkpoint runs/train/checkpoint   # the trained mini model
    .venv/bin/python benchmarks/bench_quant.py --quick                              # random tiny: the harness only

Rows: the training corpus's held-out split (files chosen by name hash), cut into --seq-len bytes; static
recipes calibrate on other held-out rows. The baseline is the checkpoint as loaded (fp32 on CPU), plain KV
cache (its bytes per token are counted in bf16, the serving default). Weight recipes run with a plain cache;
KV dtypes run the unquantized weights over a cache that round-trips every token through the codec
(quant/kv_cache.py, the contiguous twin of the paged pools).
"Greedy engine" decodes held-out prompts through PagedPools with the fp8 / int8 formats against bf16 formats.
Also the k3-2.8t figures on paper: weight bytes per recipe and the cache of one 1M-token sequence.
Writes benchmarks/bench_quant.json.
"""
from __future__ import annotations

import argparse
import copy
import math

import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.config import DSA
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.meta import format_bytes, recipe_bytes
from latentmoe_lab.paged_pools import PagedPools
from latentmoe_lab.quant import Recipe, held_bytes, quantize_model
from latentmoe_lab.quant.cli import held_out_rows
from latentmoe_lab.quant.kv import kv_bytes_per_token, kv_formats
from latentmoe_lab.quant.kv_cache import quantized_kv_cache
from latentmoe_lab.quant.report import bits_per_byte

from common import apply_threads, machine_info, make_parser, write_json

WEIGHT_RECIPES = ("fp8-experts", "mxfp4-experts", "int8-w8a8", "fp8-all-linear", "int8-w8a8-smooth")
KV_DTYPES = ("fp8", "int8")


@torch.no_grad()
def logits_of(model, rows: torch.Tensor, kv_cache_dtype: str | None) -> torch.Tensor:
    """[R, T, vocab] next-token logits, one row at a time through a (quantized) cache when asked."""
    out = []
    for row in rows.long():
        cache = None if kv_cache_dtype is None else quantized_kv_cache(model.config, kv_cache_dtype)
        out.append(model(row[None], cache=cache).logits[0])
    return torch.stack(out)


def bpb_from_logits(logits: torch.Tensor, rows: torch.Tensor) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), rows[:, 1:].long().flatten())
    return float(nll) / math.log(2)


@torch.no_grad()
def paged_greedy(model, formats, prompt: list[int], new_tokens: int, block_size: int = 16) -> list[int]:
    blocks = -(-(len(prompt) + new_tokens) // block_size)
    pools = PagedPools(model.config, blocks, block_size, 1, latent_format=formats[0], index_format=formats[1])
    tokens, context = list(prompt), 0
    for _ in range(new_tokens):
        new = tokens[context:]
        batch = ForwardBatch.from_sequences(new_tokens=[new], context_lens=[context], state_slots=[0],
                                            block_tables=[list(range(-(-(context + len(new)) // block_size)))],
                                            block_size=block_size)
        tokens.append(int(model(batch.input_ids, batch=batch, pools=pools).logits[0].argmax()))
        context += len(new)
    return tokens[len(prompt):]


def full_scale_on_paper() -> dict:
    config = ModelConfig.from_preset("k3-2.8t")
    weights = {name: recipe_bytes(config, Recipe(name, weights) if isinstance(weights, dict) else weights, "bf16")
               ["total"] for name, weights in (("bf16", {}), ("fp8-experts", "fp8-experts"),
                                               ("mxfp4-experts", "mxfp4-experts"))}
    kda, tokens = config.kda, 1 << 20
    state = config.num_kda_layers * (kda.num_heads * kda.head_dim_k * kda.head_dim_v * 4
                                     + (2 * kda.num_heads * kda.head_dim_k + kda.num_heads * kda.head_dim_v)
                                     * (kda.conv_kernel - 1) * 2)
    cache = {dtype: config.num_dsa_layers * tokens * sum(kv_bytes_per_token(config, dtype).values()) + state
             for dtype in ("bf16", "fp8")}
    return {"weights": weights, "cache_1m_tokens": cache, "kda_state_bytes": state,
            "per_token_per_dsa_layer": {d: kv_bytes_per_token(config, d) for d in ("bf16", "fp8")}}


def main() -> None:
    parser = make_parser(__doc__, default_threads=None, full_doc=True)
    parser.add_argument("--checkpoint", default=None, help="a save_pretrained directory (the trained mini model)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--eval-rows", type=int, default=32)
    parser.add_argument("--calib-rows", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts for the greedy engine check")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    apply_threads(args)
    if args.quick:
        args.seq_len, args.eval_rows, args.calib_rows, args.prompts, args.new_tokens = 64, 2, 2, 1, 4
    if args.checkpoint is None and not args.quick:
        parser.error("--checkpoint: required unless --quick")
    torch.manual_seed(0)
    model = (LatentMoEForCausalLM(ModelConfig.from_preset("tiny")) if args.checkpoint is None else
             LatentMoEForCausalLM.from_pretrained(args.checkpoint)).eval()
    corpus_args = argparse.Namespace(seq_len=args.seq_len, eval_rows=args.eval_rows, calib_rows=args.calib_rows,
                                     corpus_root=None, held_out_fraction=0.02)
    rows, calib = held_out_rows(corpus_args)
    base_logits = logits_of(model, rows, None)
    base_top1 = base_logits.argmax(-1)
    dsa_layers = model.config.layer_types.count(DSA)
    bf16_per_token = dsa_layers * sum(kv_bytes_per_token(model.config, "bf16").values())
    results = {"baseline": {"bpb": bpb_from_logits(base_logits, rows), "weight_bytes": held_bytes(model),
                            "cache_bytes_per_token": bf16_per_token}}
    for name in WEIGHT_RECIPES:
        quantized = quantize_model(copy.deepcopy(model), name, batches=calib.long().split(8), progress=False)
        logits = logits_of(quantized, rows, None)
        results[name] = {"bpb": bpb_from_logits(logits, rows), "weight_bytes": held_bytes(quantized),
                         "top1": float((logits.argmax(-1) == base_top1).float().mean())}
    prompts = [row[:args.seq_len // 2].tolist() for row in rows[:args.prompts]]
    reference = [paged_greedy(model, kv_formats(model.config, "bf16"), p, args.new_tokens) for p in prompts]
    for dtype in KV_DTYPES:
        logits = logits_of(model, rows, dtype)
        greedy = [paged_greedy(model, kv_formats(model.config, dtype), p, args.new_tokens) for p in prompts]
        agree = sum(a == b for g, r in zip(greedy, reference) for a, b in zip(g, r)) / (len(prompts) * args.new_tokens)
        results[f"kv_{dtype}"] = {"bpb": bpb_from_logits(logits, rows),
                                  "top1": float((logits.argmax(-1) == base_top1).float().mean()),
                                  "greedy_agreement_vs_bf16_kv": agree,
                                  "cache_bytes_per_token": dsa_layers * sum(kv_bytes_per_token(model.config,
                                                                                               dtype).values())}
    paper = full_scale_on_paper()
    base = results["baseline"]["bpb"]
    print(f"| run | held-out bpb | delta | top-1 agreement | weight bytes | cache B/token (all DSA layers) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r.get('bpb', float('nan')):.4f} | {r.get('bpb', base) - base:+.4f} | "
              f"{r.get('top1', 1.0):.4f} | {format_bytes(r['weight_bytes']) if 'weight_bytes' in r else '-'} | "
              f"{r.get('cache_bytes_per_token', '-')} |")
    for dtype in KV_DTYPES:
        print(f"greedy engine, {dtype} KV vs bf16 KV: {results[f'kv_{dtype}']['greedy_agreement_vs_bf16_kv']:.3f} "
              f"token agreement ({len(prompts)} prompts x {args.new_tokens} tokens)")
    print("k3-2.8t weights: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in paper["weights"].items()))
    print("k3-2.8t cache of one 1M-token sequence: " +
          ", ".join(f"{k} {format_bytes(v)}" for k, v in paper["cache_1m_tokens"].items()))
    if not args.quick:  # a random tiny model's figures say nothing; keep the file for real runs
        write_json(__file__, {"machine": machine_info(), "rows": [args.eval_rows, args.seq_len],
                              "checkpoint": args.checkpoint, "results": results, "k3_on_paper": paper})


if __name__ == "__main__":
    main()
