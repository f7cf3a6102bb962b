"""4-bit lightning-indexer keys (issue 43 item 1): recall, greedy agreement, device bytes, step time, 1M roofline.

    .venv/bin/python benchmarks/bench_index_keys.py --checkpoint checkpoints/mini-stdlib   # the trained mini
    .venv/bin/python benchmarks/bench_index_keys.py --quick                               # tiny random: harness

Four parts, each against full precision or the fp8 index key in the same process:
  recall   the top-k each 4-bit format (and fp8, for reference) selects over the model's OWN index keys and
           queries (a forward over --prompts held-out rows of --context tokens; every indexer call is re-run on
           the round-tripped keys), against the selection on the unquantized keys: shared / selected positions,
           over the queries at positions >= top-k (earlier ones select every key they see); and the next
           lever, measured but not served: int4 top-(1.5, 2 or 3 x k) candidates re-ranked on exact keys. Two
           counts: the positions both pick ("set"), and with keys tied at the k-th full-precision score
           interchangeable ("tie_aware": ReLU heads leave many exact zeros when few keys score above 0)
  greedy   --new-tokens greedy tokens after each prompt through PagedPools whose index keys are plain fp32 vs
           int4 / fp4 (latent rows plain fp32 in both): the share of tokens equal to the plain pools'
  bytes    the small preset (2 DSA layers, d_I 64, top-k 256) with memory.offload at 32k and 128k (tiny at 2k
           with --quick): one sequence's device bytes, allocated by OffloadedPools and counted by the planner
           (offload_plan.request_tier_bytes), against the no-offload figure; fp8 cache, index keys fp8 vs int4
  step     ms per decode step of those pools (random rows, as bench_offload.py), fp8 vs int4 index keys,
           alternating which runs first; the ratio is what the 4-bit read costs or saves on this CPU
and the k3-2.8t figures on paper: device share at 32k / 128k / 1M, and plan-service's 1M decode roofline.
The machine is shared: the load average is recorded with the figures.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from bench_offload import BLOCK, device_bytes, filled_pools
from common import apply_threads, machine_info, make_parser, write_json

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.layers.dsa_indexer import LightningIndexer
from latentmoe_lab.ops.sparse_attention import index_scores, index_topk, select_topk
from latentmoe_lab.paged_pools import PagedPools, PlainFormat
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.hardware import HARDWARE
from latentmoe_lab.parallel.roofline import decode_roofline
from latentmoe_lab.quant.cli import held_out_rows
from latentmoe_lab.quant.kv_cache import codec_round_trip
from latentmoe_lab.quant.kv_index import QuantizedIndexFormat
from latentmoe_lab.quant.kv_index4 import FourBitIndexFormat, selection_hits
from latentmoe_lab.serving.cache_tiers.offload_plan import request_tier_bytes

FOUR_BIT = ("int4", "fp4")
RERANKED = {f"int4 top-{factor}k + exact rerank": factor for factor in (1.5, 2, 3)}


def load_model(checkpoint: str | None) -> tuple[LatentMoEForCausalLM, str]:
    if checkpoint and Path(checkpoint).is_dir():
        return LatentMoEForCausalLM.from_pretrained(checkpoint).float().eval(), f"trained checkpoint {checkpoint}"
    torch.manual_seed(0)
    return LatentMoEForCausalLM(ModelConfig.from_preset("tiny")).eval(), "tiny preset, random weights (seed 0)"


def reranked(indexer: LightningIndexer, x, c_q, coarse_keys, fine_keys, offset, first_key, positions, factor):
    """The next lever measured, not served: top-(factor x k) candidates on the 4-bit keys, then the k best of them
    rescored on the fine keys (the unquantized ones here), which a host tier could hold next to the latent
    rows: its misses are only the candidates the 4-bit scan left out. -> [B, T, k]."""
    if positions is None:
        positions = torch.arange(offset, offset + x.shape[1])[None]
    q_idx, weights = indexer.queries(x, c_q, positions)
    candidates = index_topk(q_idx, coarse_keys, weights, int(factor * indexer.topk), offset, first_key)
    scores = index_scores(q_idx, fine_keys, weights)  # [B, T, S]
    slots = torch.where(candidates >= 0, candidates, scores.shape[-1])  # padding marks a spare last column
    kept = scores.new_zeros(*scores.shape[:-1], scores.shape[-1] + 1, dtype=torch.bool).scatter_(-1, slots, True)
    return select_topk(scores.masked_fill(~kept[..., :-1], -1e30), indexer.topk, offset)  # others rank below


@torch.no_grad()
def real_key_recall(model: LatentMoEForCausalLM, prompts: torch.Tensor) -> dict[str, dict[str, float]]:
    """Recall of each format's selection over the model's own keys, queries at positions >= top-k: as sets
    ("set") and with keys tied at the k-th full-precision score interchangeable ("tie_aware")."""
    dim, topk = model.config.indexer.head_dim, model.config.indexer.topk
    formats = {"fp8": QuantizedIndexFormat(dim, "fp8")} | {name: FourBitIndexFormat(dim, name) for name in FOUR_BIT}
    counts = {name: {"set": [0, 0], "tie_aware": [0, 0]} for name in (*formats, *RERANKED)}
    queries = [0]
    original = LightningIndexer.select

    def recording(self, x, c_q, index_keys, offset, first_key=None, positions=None):
        chosen = original(self, x, c_q, index_keys, offset, first_key, positions)
        late = (offset + torch.arange(x.shape[1])) >= topk
        if not bool(late.any()):
            return chosen
        at = positions if positions is not None else torch.arange(offset, offset + x.shape[1])[None]
        q_idx, weights = self.queries(x, c_q, at)
        scores = index_scores(q_idx, index_keys, weights)[:, late]  # full precision, [B, T_late, S]
        flat = index_keys.reshape(-1, dim)
        keys = {name: codec_round_trip(fmt, flat).to(index_keys.dtype).view_as(index_keys)
                for name, fmt in formats.items()}
        picks = {name: original(self, x, c_q, keys[name], offset, first_key, positions) for name in formats}
        picks |= {name: reranked(self, x, c_q, keys["int4"], index_keys, offset, first_key, positions, factor)
                  for name, factor in RERANKED.items()}
        for name, picked in picks.items():
            for metric, given in (("set", None), ("tie_aware", scores)):
                hits, total = selection_hits(picked[:, late], chosen[:, late], given)
                counts[name][metric][0] += hits
                counts[name][metric][1] += total
        queries[0] += int(late.sum()) * x.shape[0]
        return chosen

    LightningIndexer.select = recording
    try:
        for row in prompts:
            model(row[None].long())
    finally:
        LightningIndexer.select = original
    return {name: {metric: hits / total for metric, (hits, total) in by.items()} for name, by in counts.items()} \
        | {"queries": queries[0]}


@torch.no_grad()
def paged_greedy(model, index_format, prompt: list[int], new_tokens: int, block_size: int = 64) -> list[int]:
    blocks = -(-(len(prompt) + new_tokens) // block_size)
    pools = PagedPools(model.config, blocks, block_size, 1, latent_format=PlainFormat(torch.float32),
                       index_format=index_format)
    tokens, context = list(prompt), 0
    for _ in range(new_tokens):
        new = tokens[context:]
        batch = ForwardBatch.from_sequences([new], [context], [list(range(-(-(context + len(new)) // block_size)))],
                                            [0], block_size)
        tokens.append(int(model(batch.input_ids, batch=batch, pools=pools).logits[0].argmax()))
        context += len(new)
    return tokens[len(prompt):]


def greedy_agreement(model, prompts: torch.Tensor, new_tokens: int) -> dict[str, float]:
    dim = model.config.indexer.head_dim
    rows = [row.tolist() for row in prompts]
    reference = [paged_greedy(model, PlainFormat(torch.float32), row, new_tokens) for row in rows]
    out = {}
    for name in FOUR_BIT:
        tokens = [paged_greedy(model, FourBitIndexFormat(dim, name), row, new_tokens) for row in rows]
        out[name] = sum(a == b for t, r in zip(tokens, reference) for a, b in zip(t, r)) / (len(rows) * new_tokens)
    return out


@torch.no_grad()
def bytes_and_step_time(model: LatentMoEForCausalLM, context: int, steps: int) -> dict:
    config = model.config
    hot_rows = 2 * config.indexer.topk
    no_offload, _ = filled_pools(config, context, None, "fp8")
    pools = {name: filled_pools(config, context, hot_rows, "fp8", name) for name in ("auto", "int4")}
    table = pools["auto"][1]
    times = {name: [] for name in pools}
    token = 1
    for step in range(steps):  # the same tokens through both: the fp8 pools' greedy choice
        batch = ForwardBatch.from_sequences([[token]], [context + step], [table], [0], BLOCK)
        order = list(pools.items()) if step % 2 else list(pools.items())[::-1]
        logits = {}
        for name, (pool, _) in order:
            start = time.perf_counter()
            logits[name] = model(batch.input_ids, batch=batch, pools=pool).logits
            times[name].append(time.perf_counter() - start)
        token = int(logits["auto"][0].argmax())
    plain = device_bytes(no_offload)
    # both ratios against the no-offload figure with fp8 keys (what the target compares with)
    baseline = request_tier_bytes(config, context, "fp8", 2 * config.indexer.topk)
    planned_no_offload = sum(v for k, v in baseline.items() if k != "device: dsa_hot_buffers")
    row = {"context": context, "device_bytes_no_offload": plain, "planned_bytes_no_offload": planned_no_offload}
    for name, (pool, _) in pools.items():
        planned = sum(v for k, v in request_tier_bytes(config, context, "fp8", 2 * config.indexer.topk, name).items()
                      if k.startswith("device"))
        row[name] = {"device_bytes": device_bytes(pool), "device_ratio": device_bytes(pool) / plain,
                     "planned_device_bytes": planned, "planned_ratio": planned / planned_no_offload,
                     "ms_per_step": statistics.median(times[name][1:]) * 1e3}
    row["step_time_ratio_int4_vs_fp8"] = row["int4"]["ms_per_step"] / row["auto"]["ms_per_step"]
    return row


def full_scale_on_paper() -> dict:
    """k3-2.8t: one sequence's device share with memory.offload, and the 1M decode roofline (plan-service's)."""
    config = ModelConfig.from_preset("k3-2.8t")
    shares = {}
    for share in (1, 2):
        shared = config.replace(dsa={"index_share_every": share})
        for context in (32768, 131072, 2 ** 20):
            baseline = request_tier_bytes(shared, context, "fp8")  # no offload, fp8 keys: what the ratio compares with
            whole = sum(v for k, v in baseline.items() if k != "device: dsa_hot_buffers")
            for keys in ("auto", "int4"):
                tiers = request_tier_bytes(shared, context, "fp8", None, keys)
                device = sum(v for k, v in tiers.items() if k.startswith("device"))
                shares[f"share{share} {context} {keys}"] = {"device_bytes": device, "ratio": device / whole,
                                                            "kda_bytes": tiers["device: kda_state"]
                                                            + tiers["device: kda_conv"]}
    layout, hw = ParallelConfig(tp=8, ep=8, pp=2), HARDWARE["H200-141GB"]
    roofline = {}
    for keys in ("auto", "int4"):
        for swap in (None, 1.0):
            rows = decode_roofline(config, layout, hw, 1_000_000, "fp8", "fp8", swap, index_key_dtype=keys)
            roofline[f"{keys} swap={swap}"] = {"scan_bytes": rows["indexer scan"]["bytes"],
                                               "scan_ms": rows["indexer scan"]["seconds"] * 1e3,
                                               "token_ms": rows["total"]["seconds"] * 1e3}
    return {"device_share": shares, "roofline_1m": roofline}


def main() -> None:
    parser = make_parser(__doc__, default_threads=1, full_doc=True)
    parser.add_argument("--checkpoint", default="checkpoints/mini-stdlib",
                        help="a save_pretrained directory; absent: the tiny preset with random weights")
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens (recall and greedy)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per context (the first is not timed)")
    args = parser.parse_args()
    apply_threads(args)
    if args.quick:
        args.context, args.prompts, args.new_tokens, args.steps = 512, 1, 4, 3
    load_before = os.getloadavg()
    model, described = load_model(None if args.quick else args.checkpoint)
    context = min(args.context, model.config.max_position_embeddings - args.new_tokens)
    corpus = argparse.Namespace(seq_len=context, eval_rows=args.prompts, calib_rows=1, corpus_root=None,
                                held_out_fraction=0.02)
    prompts = held_out_rows(corpus)[0]
    result = {"machine": machine_info(model=described, context=context, prompts=args.prompts,
                                      new_tokens=args.new_tokens, steps=args.steps, load_before=load_before)}
    result["recall"] = real_key_recall(model, prompts)
    print(f"{described}, {args.prompts} prompts of {context} tokens, {result['recall']['queries']} queries at "
          f"positions >= top-k: recall of the top-{model.config.indexer.topk} (set / tie-aware)", flush=True)
    for name, value in result["recall"].items():
        if name != "queries":
            print(f"  {name:<30}{value['set']:.4f} / {value['tie_aware']:.4f}")
    result["greedy"] = greedy_agreement(model, prompts, args.new_tokens)
    print("greedy agreement with plain index keys: "
          + ", ".join(f"{k} {v:.3f}" for k, v in result["greedy"].items())
          + f" ({args.prompts} x {args.new_tokens} tokens)", flush=True)
    preset, contexts = ("tiny", [2048]) if args.quick else ("small", [32768, 131072])
    config = ModelConfig.from_preset(preset).replace(max_position_embeddings=max(contexts) + 1024)
    torch.manual_seed(0)
    bench_model = LatentMoEForCausalLM(config).eval()
    result["bytes_and_steps"] = []
    for length in contexts:
        row = bytes_and_step_time(bench_model, length, args.steps)
        result["bytes_and_steps"].append(row)
        print(f"{preset} {length:>7} tokens with offload: device {row['auto']['device_ratio']:.1%} (fp8 keys) -> "
              f"{row['int4']['device_ratio']:.1%} (int4) of the no-offload "
              f"{row['device_bytes_no_offload'] / 2 ** 20:.1f} MiB; planner {row['auto']['planned_ratio']:.1%} -> "
              f"{row['int4']['planned_ratio']:.1%}; step {row['int4']['ms_per_step']:.1f} vs "
              f"{row['auto']['ms_per_step']:.1f} ms ({row['step_time_ratio_int4_vs_fp8']:.2f}x)", flush=True)
    result["full_scale"] = full_scale_on_paper()
    for key, value in result["full_scale"]["device_share"].items():
        print(f"k3-2.8t {key}: device {value['device_bytes'] / 1e9:.2f} GB = {value['ratio']:.1%} of no-offload")
    for key, value in result["full_scale"]["roofline_1m"].items():
        print(f"k3-2.8t 1M roofline {key}: scan {value['scan_bytes'] / 1e9:.2f} GB {value['scan_ms']:.3f} ms, "
              f"token {value['token_ms']:.3f} ms")
    result["machine"]["load_after"] = os.getloadavg()
    print(f"load average before {load_before}, after {result['machine']['load_after']}")
    name = "bench_index_keys" + ("_quick" if args.quick else "")
    print(f"wrote {write_json(__file__, result, Path(__file__).with_name(name + '.json'))}")


if __name__ == "__main__":
    main()
