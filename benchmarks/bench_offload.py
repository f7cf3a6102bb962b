"""DSA rows in a host tier (issue 29): device cache bytes, decode step time and bytes moved, with vs without.

    .venv/bin/python benchmarks/bench_offload.py            # small preset, fp8 cache, 32k and 128k context
    .venv/bin/python benchmarks/bench_offload.py --quick    # tiny preset, 2k context: checks the harness

One sequence sits at the context length in both pools, filled with the same random rows (a real prefill of
128k tokens takes too long on 2 cores; the rows' values do not change the work of a decode step). The same
greedy tokens then decode through plain PagedPools and through OffloadedPools with a hot buffer of
--hot-rows rows per DSA layer, alternating step by step; the logits must agree bit for bit. Measured:
device cache bytes of the one sequence, ms per decode step (median), rows and bytes swapped into the hot
buffers per step. Random keys make consecutive selections overlap less than real text does (notebook 06
shows a real run), so the bytes moved here are an upper-side figure.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from common import apply_threads, machine_info, make_parser, write_json

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.serving.cache_tiers.offload_tier import OffloadedPools
from latentmoe_lab.paged_pools import DSAPool, KDAPool, PagedPools
from latentmoe_lab.quant.kv import kv_formats

BLOCK = 64


def filled_pools(config: ModelConfig, context: int, hot_rows: int | None, cache_dtype: str,
                 index_key_dtype: str = "auto"):
    """Pools for one sequence of `context` + steps tokens, rows 0 .. context - 1 written (seeded, equal for
    every layout and format); hot_rows None: no host tier. -> (pools, block table)."""
    blocks = -(-(context + 64) // BLOCK)
    formats = kv_formats(config, cache_dtype, "fp32", index_key_dtype)
    pools = (PagedPools(config, blocks, BLOCK, 1, torch.float32, None, *formats) if hot_rows is None
             else OffloadedPools(config, blocks, BLOCK, 1, hot_rows, 1, torch.float32, None, *formats))
    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(context)
    for pool in pools.layers:
        if isinstance(pool, DSAPool):
            for start in range(0, context, 16384):
                span = positions[start:start + 16384]
                pool.write(span, torch.randn(len(span), pool.latent_dim, generator=generator),
                           torch.randn(len(span), pool.index_dim, generator=generator) if pool.index.numel() else None)
        elif isinstance(pool, KDAPool):
            pool.state.copy_(0.1 * torch.randn(pool.state.shape, generator=generator))
    return pools, list(range(blocks))


def device_bytes(pools) -> int:
    return sum(value for kind, value in pools.nbytes().items() if not kind.startswith("host"))


@torch.no_grad()
def bench_context(model: LatentMoEForCausalLM, context: int, hot_rows: int, steps: int, cache_dtype: str) -> dict:
    plain, table = filled_pools(model.config, context, None, cache_dtype)
    offloaded, _ = filled_pools(model.config, context, hot_rows, cache_dtype)
    times = {"plain": [], "offload": []}
    moved_rows, token = [], 1
    for step in range(steps):
        batch = ForwardBatch.from_sequences([[token]], [context + step], [table], [0], BLOCK)
        logits = {}
        order = (("plain", plain), ("offload", offloaded))
        for name, pools in order if step % 2 else order[::-1]:  # alternate who runs first (warm caches)
            before = pools.stats()["rows_moved"] if name == "offload" else 0
            start = time.perf_counter()
            logits[name] = model(batch.input_ids, batch=batch, pools=pools).logits
            times[name].append(time.perf_counter() - start)
            if name == "offload":
                moved_rows.append(pools.stats()["rows_moved"] - before)
        if not torch.equal(logits["plain"], logits["offload"]):
            raise AssertionError(f"context {context}, step {step}: offloaded logits differ from the plain pools'")
        token = int(logits["plain"][0].argmax())
    row_bytes = offloaded.stats()["bytes_moved"] // max(1, offloaded.stats()["rows_moved"])
    layers = model.config.num_dsa_layers
    plain_ms, offload_ms = (statistics.median(times[k][1:]) * 1e3 for k in ("plain", "offload"))
    result = {"context": context, "hot_rows": hot_rows, "device_bytes_plain": device_bytes(plain),
              "device_bytes_offload": device_bytes(offloaded),
              "host_bytes_offload": offloaded.nbytes()["host_dsa_latent"],
              "ms_plain": plain_ms, "ms_offload": offload_ms, "step_time_ratio": offload_ms / plain_ms,
              "rows_moved_per_step": moved_rows, "first_step_rows": moved_rows[0],
              "mean_rows_moved_later": statistics.mean(moved_rows[1:]),
              "top_k_rows_per_step": layers * model.config.indexer.topk,
              "bytes_moved_per_step_later": statistics.mean(moved_rows[1:]) * row_bytes}
    result["device_ratio"] = result["device_bytes_offload"] / result["device_bytes_plain"]
    return result


def main() -> None:
    parser = make_parser(__doc__, default_threads=1)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per context (the first is not timed)")
    parser.add_argument("--cache-dtype", default="fp8", choices=("fp8", "fp32"))
    parser.add_argument("--share", type=int, default=1, help="dsa.index_share_every")
    args = parser.parse_args()
    apply_threads(args)
    preset, contexts = ("tiny", [2048]) if args.quick else ("small", [32768, 131072])
    config = ModelConfig.from_preset(preset).replace(max_position_embeddings=max(contexts) + 1024,
                                                     dsa={"index_share_every": args.share})
    hot_rows = 2 * config.indexer.topk
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(config).eval()
    result = {"machine": machine_info(preset=preset, cache_dtype=args.cache_dtype, steps=args.steps,
                                      index_share_every=args.share), "contexts": []}
    for context in contexts:
        row = bench_context(model, context, hot_rows, args.steps, args.cache_dtype)
        result["contexts"].append(row)
        print(f"{preset} {context:>7} tokens: device {row['device_bytes_offload'] / 2**20:.2f} MiB with offload vs "
              f"{row['device_bytes_plain'] / 2**20:.2f} MiB without ({row['device_ratio']:.1%}); step "
              f"{row['ms_offload']:.1f} vs {row['ms_plain']:.1f} ms ({row['step_time_ratio']:.2f}x); rows moved "
              f"first {row['first_step_rows']}, then {row['mean_rows_moved_later']:.0f} of "
              f"{row['top_k_rows_per_step']} per step ({row['bytes_moved_per_step_later'] / 1024:.1f} KiB)", flush=True)
    name = "bench_offload" + ("_quick" if args.quick else "") + (f"_share{args.share}" if args.share > 1 else "")
    print(f"wrote {write_json(__file__, result, Path(__file__).with_name(name + '.json'))}")


if __name__ == "__main__":
    main()
