"""KDA decode cost does not grow with context: step time after 1k vs 64k tokens of prefill.

    .venv/bin/python benchmarks/bench_kda_decode.py            # small preset's KDA layer, contexts 1k and 64k
    .venv/bin/python benchmarks/bench_kda_decode.py --quick    # contexts 256 and 2k

One KimiDeltaAttention layer with the small preset's sizes (hidden 512, 4 heads x 128, chunk 64), fp32,
B=1. Each context is prefilled through a KDALayerCache in segments of --segment tokens (chunked
prefill: the state carries over), then --steps single-token decode steps run, interleaved between
the contexts call by call so that load spikes on the shared machine hit both alike; the step time is
their median. A decode step reads and writes only the conv tail and the [H, d_k, d_v] state, so the
two medians should match. For scale: without the state, a step would have to re-run the prefill
over the whole context, so "reuse speedup" is prefill time / step time. One torch thread by default
(--threads), as in bench_dsa.py: small ops on shared cores.
Writes benchmarks/bench_kda_decode.json.
"""
from __future__ import annotations

import statistics
import time

import torch

from latentmoe_lab.cache import KDALayerCache
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.kda import KimiDeltaAttention

from common import apply_threads, machine_info, make_parser, write_json


def prefill(layer: KimiDeltaAttention, x: torch.Tensor, segment: int) -> tuple[KDALayerCache, float]:
    """Run x [1, T, hidden] through the layer in segments; return the cache and the seconds it took."""
    cache = KDALayerCache()
    start = time.perf_counter()
    for begin in range(0, x.shape[1], segment):
        layer(x[:, begin:begin + segment], cache=cache)
    return cache, time.perf_counter() - start


def cache_bytes(cache: KDALayerCache) -> int:
    return sum(t.numel() * t.element_size() for t in (cache.conv_state, cache.recurrent_state))


def main() -> None:
    parser = make_parser(__doc__, default_threads=1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--segment", type=int, default=8192)
    args = parser.parse_args()
    apply_threads(args)
    contexts = [256, 2048] if args.quick else [1024, 65536]
    steps = 10 if args.quick else args.steps

    config = ModelConfig.from_preset("small")
    torch.manual_seed(0)
    layer = KimiDeltaAttention(config)
    hidden = config.hidden_size
    caches, rows = {}, {}
    with torch.no_grad():
        for context in contexts:
            x = torch.randn(1, context, hidden)
            caches[context], prefill_s = prefill(layer, x, args.segment)
            rows[context] = dict(context=context, prefill_ms=1e3 * prefill_s,
                                 state_bytes=cache_bytes(caches[context]), step_s=[])
            print(f"prefilled {context} tokens in {prefill_s:.1f} s", flush=True)

        tokens = torch.randn(steps, 1, 1, hidden)
        for _ in range(2):  # warm-up
            for context in contexts:
                layer(tokens[0], cache=caches[context])
        for step in range(steps):
            for context in contexts:
                start = time.perf_counter()
                layer(tokens[step], cache=caches[context])
                rows[context]["step_s"].append(time.perf_counter() - start)

    base = contexts[0]
    base_ms = 1e3 * statistics.median(rows[base]["step_s"])
    print(f"{'context':>8} {'step ms':>8} {'vs ' + str(base):>9} {'state bytes':>12} {'prefill ms':>11} "
          f"{'reuse speedup':>14}")
    table = []
    for context in contexts:
        row = rows[context]
        step_ms = 1e3 * statistics.median(row.pop("step_s"))
        row.update(step_ms=step_ms, step_vs_base=step_ms / base_ms, reuse_speedup=row["prefill_ms"] / step_ms)
        table.append(row)
        print(f"{context:>8} {step_ms:>8.2f} {row['step_vs_base']:>8.2f}x {row['state_bytes']:>12,} "
              f"{row['prefill_ms']:>11.0f} {row['reuse_speedup']:>13.0f}x")

    result = dict(config=dict(layer="KimiDeltaAttention(small preset)", hidden=hidden, heads=config.kda.num_heads,
                              d_k=config.kda.head_dim_k, d_v=config.kda.head_dim_v, chunk=config.kda.chunk_size,
                              segment=args.segment, steps=steps, dtype="fp32"),
                  machine=machine_info(), rows=table)
    out = write_json(__file__, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
