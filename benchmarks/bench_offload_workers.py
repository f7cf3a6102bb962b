"""memory.offload with the forward in a worker process (parallel.forward_process): decode step time with and
without the host tier, and the rows each decode step swaps in, as Engine.stats() reports them.

    .venv/bin/python benchmarks/bench_offload_workers.py            # small preset, a 4096-token prompt
    .venv/bin/python benchmarks/bench_offload_workers.py --quick    # tiny preset, 1500 tokens: checks the harness

Two engines with the forward in a worker process, one with memory.offload (hot buffer 2 x top-k rows per
DSA layer), one without, take turns on the same greedy requests (one prompt, then --decode tokens), so that
load spikes of the shared machine hit both alike. Reported: the median decode step of each (the engine's
step records: steps with no prefill token), their ratio, the offload counters per decode step (rows moved
from the host tier, rows already hot), and whether the greedy tokens agree. One torch thread in the worker
by default (--threads). Writes benchmarks/bench_offload_workers.json (_quick with --quick).
"""
from __future__ import annotations

import statistics
from pathlib import Path

import torch
from common import apply_threads, machine_info, make_parser, write_json

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig


def service(max_len: int, threads: int, offload: bool) -> ServiceConfig:
    memory = {"max_num_seqs": 1, "block_size": 64, "cache_bytes": 400_000_000}
    if offload:
        memory["offload"] = {"host_cache_bytes": 400_000_000}
    return ServiceConfig.from_dict({"model": {"max_model_len": max_len},
                                    "parallel": {"forward_process": True, "forward_threads": threads},
                                    "memory": memory, "scheduler": {"max_batch_size": 2, "prefill_chunk_size": 1024}})


def decode_steps(engine: Engine) -> list[float]:
    return [record.duration for record in engine.log.steps if record.prefill_tokens == 0]


def main() -> None:
    parser = make_parser(__doc__, default_threads=1)
    parser.add_argument("--decode", type=int, default=24, help="greedy tokens per request")
    parser.add_argument("--requests", type=int, default=2)
    args = parser.parse_args()
    apply_threads(args)
    preset, prompt_len = ("tiny", 1500) if args.quick else ("small", 4096)
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(ModelConfig.from_preset(preset)).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (prompt_len,), generator=g).tolist()
               for _ in range(args.requests)]
    max_len = prompt_len + args.decode + 64
    engines = {"plain": Engine(model, service(max_len, args.threads, False)),
               "offload": Engine(model, service(max_len, args.threads, True))}
    params = SamplingParams(max_tokens=args.decode)
    tokens = {name: [] for name in engines}
    try:
        for i, prompt in enumerate(prompts):
            for name in (list(engines) if i % 2 == 0 else list(engines)[::-1]):  # alternate who goes first
                tokens[name].append(engines[name].generate([prompt], params, use_tqdm=False)[0].token_ids)
        stats = engines["offload"].stats()
        steps = {name: decode_steps(engine) for name, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.close()
    ms = {name: statistics.median(times) * 1e3 for name, times in steps.items()}
    decodes = len(steps["offload"])
    result = {"machine": machine_info(preset=preset, prompt_len=prompt_len, decode=args.decode,
                                      requests=args.requests, forward_process=True, quick=args.quick),
              "tokens_agree": tokens["plain"] == tokens["offload"],
              "decode_ms_plain": round(ms["plain"], 2), "decode_ms_offload": round(ms["offload"], 2),
              "step_time_ratio": round(ms["offload"] / ms["plain"], 3),
              "hot_rows_per_layer": engines["offload"].stages[0].plan.hot_rows,
              "top_k_rows_per_step": model.config.num_dsa_layers * model.config.indexer.topk,
              **{key: value for key, value in stats.items() if key.startswith("offload_")}}
    # every counter is summed over the run: prefill chunks read the host tier, decodes swap into hot buffers
    result["rows_moved_per_decode_step"] = round(stats["offload_rows_moved"] / decodes, 1)
    result["rows_hit_per_decode_step"] = round(stats["offload_rows_hit"] / decodes, 1)
    print(f"{preset}, {prompt_len}-token prompts, forward process: decode step {ms['offload']:.1f} ms with offload "
          f"vs {ms['plain']:.1f} ms without ({result['step_time_ratio']:.2f}x); per decode step "
          f"{result['rows_moved_per_decode_step']} rows moved, {result['rows_hit_per_decode_step']} hot "
          f"(top-k {result['top_k_rows_per_step']}); tokens agree: {result['tokens_agree']}")
    name = "bench_offload_workers" + ("_quick" if args.quick else "")
    print(f"wrote {write_json(__file__, result, Path(__file__).with_name(name + '.json'))}")


if __name__ == "__main__":
    main()
