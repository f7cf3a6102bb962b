"""Gated DSA at long context: blocked sparse prefill and top-k decode against the same layer's dense path.

    .venv/bin/python benchmarks/bench_dsa.py             # contexts 4k, 16k, 32k, index_topk 2048
    .venv/bin/python benchmarks/bench_dsa.py --quick     # contexts 1k, 2k, index_topk 256

Table 1, prefill and decode: GatedDSA with the small preset's attention sizes (hidden 512, 4 MLA heads,
kv_lora 128, nope 64, rope 32, v 64; indexer 4 heads x 64) and index_topk 2048, fp32, B=1, query_block 16.
Table 2, decode only: the k3-2.8t attention layer with 1/8 of its heads (12 MLA heads of kv_lora 512,
rope 64, nope 128, v 128; 8 index heads of 128; hidden 1024, q_lora 768), so the cached bytes per key,
576 latent + rope against 128 index values, are the full-scale ones. Its cache is filled with the
layer's own projections (GatedDSA.project) of random hidden states: a decode step depends only on
what the cache holds, and a sparse prefill of these sizes would take many minutes here.

    sparse   layer(x, cache): the indexer scores and selects per block of 16 queries, attention
             gathers only the selected latent rows (absorbed MQA form)
    dense    layer(x, dense=True): the reference, softmax over every causal key, [B, H, T, S] at once

Peak memory is counted by latentmoe_lab.analysis.memory.PeakMemory: the most bytes of tensor storage
the forward allocates and holds at once (inputs and weights excluded). Dense prefill at 16k/32k needs far
more memory than this shared machine has (its [B, H, T, S] logits alone are 4.3 / 17.2 GB), so its
peak is replayed on the meta device (the same ops, shapes only, nothing allocated) and its time is
not measured; where dense does run, both counts are printed to show they agree.

Decode: after the sparse prefill, --steps single-token steps run on two copies of the cache, sparse
and dense alternating call by call so load spikes on the shared machine hit both alike; medians.
One torch thread by default (--threads): with other jobs on the 2 shared cores, two OpenMP threads
stall at every small op, which made both paths several times slower and noisier.
Writes benchmarks/bench_dsa.json.
"""
from __future__ import annotations

import copy
import dataclasses
import statistics
import time

import torch

from latentmoe_lab.cache import DSALayerCache
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.dsa import GatedDSA
from latentmoe_lab.analysis.memory import PeakMemory

from common import apply_threads, machine_info, make_parser, write_json

DENSE_RUN_LIMIT = 4 * 2 ** 30  # bytes: dense prefill runs for real only below this replayed peak
GIB, MIB = 2 ** 30, 2 ** 20


def small_config(topk: int) -> ModelConfig:
    base = ModelConfig.from_preset("small")
    return base.replace(indexer=dataclasses.asdict(base.indexer) | {"topk": topk})


def k3_eighth_config(topk: int) -> ModelConfig:
    base = ModelConfig.from_preset("k3-2.8t")
    return base.replace(hidden_size=1024, mla=dataclasses.asdict(base.mla) | {"num_heads": 12, "q_lora_rank": 768},
                        indexer=dataclasses.asdict(base.indexer) | {"num_heads": 8, "topk": topk},
                        moe=dataclasses.asdict(base.moe) | {"latent_size": 512})  # MoE unused; must fit hidden


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def peak_bytes(fn) -> int:
    with PeakMemory() as memory:
        fn()
    return memory.peak_bytes


def decode_step_ms(layer: GatedDSA, cache: DSALayerCache, steps: int) -> tuple[float, float]:
    """Median ms of a sparse and a dense decode step, alternating, each on its own copy of `cache`."""
    sparse_cache, dense_cache = cache, copy.deepcopy(cache)
    tokens = torch.randn(steps + 1, 1, 1, layer.hidden_size)
    layer(tokens[0], cache=sparse_cache)  # warm-up
    layer(tokens[0], cache=dense_cache, dense=True)
    sparse_steps, dense_steps = [], []
    for step in range(1, steps + 1):
        sparse_steps.append(timed(lambda: layer(tokens[step], cache=sparse_cache))[0])
        dense_steps.append(timed(lambda: layer(tokens[step], cache=dense_cache, dense=True))[0])
    return 1e3 * statistics.median(sparse_steps), 1e3 * statistics.median(dense_steps)


def prefill_and_decode(config: ModelConfig, contexts: list[int], steps: int) -> list[dict]:
    torch.manual_seed(0)
    layer = GatedDSA(config, query_block=16)
    with torch.device("meta"):
        meta_layer = GatedDSA(config, query_block=16)
    rows = []
    print(f"{'S':>6} {'sparse s':>9} {'dense s':>8} {'sparse MiB':>11} {'dense MiB':>10} {'mem ratio':>10} "
          f"{'sparse step ms':>15} {'dense step ms':>14} {'decode speedup':>15}")
    for context in contexts:
        x = torch.randn(1, context, config.hidden_size)
        cache = DSALayerCache()
        sparse_s, _ = timed(lambda: layer(x, cache=cache))
        sparse_peak = peak_bytes(lambda: layer(x, cache=DSALayerCache()))
        dense_replayed = peak_bytes(lambda: meta_layer(x.to("meta"), dense=True))
        dense_s = dense_measured = None
        if dense_replayed < DENSE_RUN_LIMIT:
            dense_s, _ = timed(lambda: layer(x, dense=True))
            dense_measured = peak_bytes(lambda: layer(x, dense=True))
        sparse_ms, dense_ms = decode_step_ms(layer, cache, steps)

        dense_peak = dense_measured or dense_replayed
        row = dict(context=context, sparse_prefill_s=sparse_s, dense_prefill_s=dense_s,
                   sparse_peak_bytes=sparse_peak, dense_peak_bytes_measured=dense_measured,
                   dense_peak_bytes_replayed=dense_replayed, peak_ratio=sparse_peak / dense_peak,
                   sparse_step_ms=sparse_ms, dense_step_ms=dense_ms, decode_speedup=dense_ms / sparse_ms)
        rows.append(row)
        dense_time = f"{dense_s:>8.1f}" if dense_s is not None else f"{'not run':>8}"
        replayed = "" if dense_measured else " (dense peak replayed)"
        print(f"{context:>6} {sparse_s:>9.1f} {dense_time} {sparse_peak / MIB:>11.0f} "
              f"{dense_peak / MIB:>10.0f} {row['peak_ratio']:>10.3f} {sparse_ms:>15.2f} {dense_ms:>14.2f} "
              f"{row['decode_speedup']:>14.1f}x{replayed}", flush=True)
        if dense_measured:
            print(f"       dense peak measured {dense_measured / MIB:.0f} MiB, "
                  f"replayed on meta {dense_replayed / MIB:.0f} MiB")
    return rows


def decode_only(config: ModelConfig, contexts: list[int], steps: int) -> list[dict]:
    torch.manual_seed(0)
    layer = GatedDSA(config, query_block=16)
    rows = []
    print(f"{'S':>6} {'sparse step ms':>15} {'dense step ms':>14} {'decode speedup':>15}")
    for context in contexts:
        cache = DSALayerCache()
        *_, latent, k_rope, index_keys = layer.project(torch.randn(1, context, config.hidden_size))
        cache.append(latent, k_rope, index_keys)
        sparse_ms, dense_ms = decode_step_ms(layer, cache, steps)
        rows.append(dict(context=context, sparse_step_ms=sparse_ms, dense_step_ms=dense_ms,
                         decode_speedup=dense_ms / sparse_ms))
        print(f"{context:>6} {sparse_ms:>15.2f} {dense_ms:>14.2f} {dense_ms / sparse_ms:>14.1f}x", flush=True)
    return rows


def describe(config: ModelConfig) -> dict:
    mla, idx = config.mla, config.indexer
    return dict(hidden=config.hidden_size, mla_heads=mla.num_heads, q_lora=mla.q_lora_rank, kv_lora=mla.kv_lora_rank,
                nope=mla.qk_nope_head_dim, rope=mla.qk_rope_head_dim, v=mla.v_head_dim, index_heads=idx.num_heads,
                index_dim=idx.head_dim, index_topk=idx.topk, query_block=16, dtype="fp32")


def main() -> None:
    parser = make_parser(__doc__, default_threads=1)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    apply_threads(args)
    contexts, topk = ([1024, 2048], 256) if args.quick else ([4096, 16384, 32768], 2048)
    steps = 5 if args.quick else args.steps

    small, k3_eighth = small_config(topk), k3_eighth_config(topk)
    with torch.no_grad():
        print("Table 1: small preset attention, prefill and decode")
        small_rows = prefill_and_decode(small, contexts, steps)
        print("Table 2: k3-2.8t attention at 1/8 of its heads, decode")
        k3_rows = decode_only(k3_eighth, contexts, steps)

    result = dict(small=dict(config=describe(small), rows=small_rows),
                  k3_eighth=dict(config=describe(k3_eighth), rows=k3_rows), steps=steps,
                  machine=machine_info())
    out = write_json(__file__, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
