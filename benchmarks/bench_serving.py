"""Serving engine benchmarks (issue 13): ratios against a baseline run in the same process.

    .venv/bin/python benchmarks/bench_serving.py                    # small preset, the issue's sizes
    .venv/bin/python benchmarks/bench_serving.py --quick            # tiny preset, sizes / 8: checks the harness
    .venv/bin/python benchmarks/bench_serving.py --only prefix      # or throughput, long, overhead, memory, dsa_chunk

throughput  32 requests (prompts 64-512, 64 new tokens): engine generated tokens/s against model.generate on
            each prompt in turn (target >= 5x), the engine at two step budgets (prefill_chunk_size): 512, the
            latency setting of the other benchmarks, and 2048, a throughput setting (the budget vLLM's V1
            engine typically runs chunked prefill with): fewer, fuller prefill steps, so the last prompt
            starts decoding sooner. Also the engine at budget 512 with scheduler.batch_invariant: its cost.
long        one 16k-token prompt arriving with 8 short ones: the short requests' p99 TTFT with
            prefill_chunk_size 512 against whole-prompt prefill (chunked_prefill false, same budget: the long
            prompt runs whole in one step; target >= 5x lower), and the long one's e2e (target within 1.3x).
prefix      16 requests sharing a 2k-token prefix (one first, then 15): prefill tokens computed, mean TTFT of
            the 15 and the outputs, prefix caching on against off (targets >= 80% fewer tokens, >= 3x TTFT,
            identical outputs), both with scheduler.batch_invariant (serving/invariance.py): without it the
            off run's budget-cut chunks round differently and flip near-tied greedy picks of the random
            model. A request whose outputs differ is also served alone, to tell which run moved it.
overhead    32 running sequences decoding: scheduler + ForwardBatch metadata time as a share of step time
            (target <= 10%).
memory      64k- and 128k-token prompts prefilled in chunks of 512: peak tensor memory allocated during the
            steps, beyond the pools (PeakMemory; target: flat in prompt length).
dsa_chunk   the same question for one Gated DSA layer alone, at both paged_reads (block-wise and the gather
            twin): one 512-token chunk after 64k and 128k cached tokens, peak memory beyond the pool (and
            the time, PeakMemory's per-op bookkeeping included: not a speed figure).
Writes benchmarks/bench_serving.json. Greedy sampling everywhere; random weights (seeded).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from latentmoe_lab.analysis.memory import PeakMemory
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.layers.dsa import GatedDSA
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.paged_pools import DSAPool, PagedPools
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig

from common import apply_threads, machine_info, make_parser, write_json


def service(max_model_len, chunk=512, chunked=True, prefix=False, max_num_seqs=32, cache_bytes=256 << 20,
            block=64, invariant=False):
    return ServiceConfig.from_dict({
        "model": {"max_model_len": max_model_len},
        "memory": {"cache_bytes": cache_bytes, "block_size": block, "max_num_seqs": max_num_seqs,
                   "prefix_cache": {"enabled": prefix}},
        "scheduler": {"prefill_chunk_size": chunk, "chunked_prefill": chunked, "max_batch_size": 256,
                      "batch_invariant": invariant}})


def random_prompts(g, count, low, high):
    return [torch.randint(0, 256, (int(torch.randint(low, high + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def bench_throughput(model, scale, g):
    prompts = random_prompts(g, 32 // scale, 64 // scale, 512 // scale)
    new = 64 // scale
    runs = {}
    # the batch-invariant run keeps budget 512 at every scale: it needs two of the model's chunk grid (64)
    for budget, invariant in ((512 // scale, False), (2048 // scale, False), (512, True)):
        engine = Engine(model, service(1024, chunk=budget, invariant=invariant))
        start = time.perf_counter()
        outputs = engine.generate(prompts, SamplingParams(max_tokens=new), use_tqdm=False)
        name = f"{budget} batch_invariant" if invariant else str(budget)
        runs[name] = (time.perf_counter() - start, [o.token_ids for o in outputs], engine.stats()["steps"])
    start = time.perf_counter()
    reference = [model.generate(torch.tensor([p]), new)[0, len(p):].tolist() for p in prompts]
    sequential_s = time.perf_counter() - start
    tokens = sum(len(ids) for ids in reference)
    return {"requests": len(prompts), "new_tokens": new, "sequential_tokens_per_s": tokens / sequential_s,
            "budgets": {budget: {"engine_tokens_per_s": sum(map(len, outputs)) / engine_s,
                                 "speedup": sequential_s / engine_s,
                                 "steps": steps, "outputs_equal": outputs == reference}
                        for budget, (engine_s, outputs, steps) in runs.items()}}


def bench_long(model, scale, g):
    long_len, chunk = 16384 // scale, 512 // scale
    long_prompt = random_prompts(g, 1, long_len, long_len)[0]
    shorts = random_prompts(g, 8, 16, max(32, 128 // scale))
    results = {}
    for name, cfg in (("chunked", service(long_len + 64, chunk=chunk, max_num_seqs=16)),
                      ("whole", service(long_len + 64, chunk=chunk, chunked=False, max_num_seqs=16))):
        engine = Engine(model, cfg)
        outputs = engine.generate([long_prompt] + shorts, SamplingParams(max_tokens=16), use_tqdm=False)
        short_ttft = torch.tensor([o.metrics.ttft for o in outputs[1:]])
        results[name] = {"short_p99_ttft_s": float(torch.quantile(short_ttft, 0.99)),
                         "long_e2e_s": outputs[0].metrics.e2e}
    return results | {
        "prompt": long_len, "chunk": chunk,
        "short_p99_ttft_ratio": results["whole"]["short_p99_ttft_s"] / results["chunked"]["short_p99_ttft_s"],
        "long_e2e_ratio": results["chunked"]["long_e2e_s"] / results["whole"]["long_e2e_s"]}


def bench_prefix(model, scale, g):
    shared = random_prompts(g, 1, 2048 // scale, 2048 // scale)[0]
    prompts = [shared + suffix for suffix in random_prompts(g, 16, 16, 16)]
    results = {}
    for prefix in (False, True):
        engine = Engine(model, service(4096, prefix=prefix, invariant=True))
        first = engine.generate(prompts[:1], SamplingParams(max_tokens=8), use_tqdm=False)
        rest = engine.generate(prompts[1:], SamplingParams(max_tokens=8), use_tqdm=False)
        results["on" if prefix else "off"] = {
            "prefill_tokens": engine.stats()["prefill_tokens"], "hit_tokens": engine.stats()["prefix_hit_tokens"],
            "mean_ttft_s": sum(o.metrics.ttft for o in rest) / len(rest),
            "outputs": [o.token_ids for o in first + rest]}
    on, off = results["on"], results["off"]
    # a request whose outputs differ is served alone (prefix caching off): which run changed it
    differ = [i for i, (a, b) in enumerate(zip(on["outputs"], off["outputs"])) if a != b]
    alone = {i: Engine(model, service(4096, invariant=True)).generate([prompts[i]], SamplingParams(max_tokens=8),
                                                      use_tqdm=False)[0].token_ids for i in differ}
    return {"shared_prefix": len(shared), "prefill_tokens_off": off["prefill_tokens"],
            "prefill_tokens_on": on["prefill_tokens"], "hit_tokens": on["hit_tokens"],
            "fewer_prefill_tokens": 1 - on["prefill_tokens"] / off["prefill_tokens"],
            "ttft_ratio": off["mean_ttft_s"] / on["mean_ttft_s"], "outputs_equal": not differ,
            "differing_requests": differ, "differing_on_equals_alone": [on["outputs"][i] == alone[i] for i in differ],
            "differing_off_equals_alone": [off["outputs"][i] == alone[i] for i in differ]}


def bench_overhead(model, scale, g):
    engine = Engine(model, service(1024, chunk=1024))
    for prompt in random_prompts(g, 32, 64 // scale, 128 // scale):
        engine.add_request(prompt, SamplingParams(max_tokens=40))
    while any(s.in_prefill or not s.generated_ids for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(16):
        engine.step()
    decode_steps = [s for s in list(engine.log.steps)[-16:] if s.decode_tokens == 32]  # the log is a deque
    overhead = sum(s.schedule_time for s in decode_steps) / sum(s.duration for s in decode_steps)
    return {"running": 32, "decode_steps": len(decode_steps), "overhead_share": overhead,
            "mean_step_ms": 1e3 * sum(s.duration for s in decode_steps) / len(decode_steps)}


MEMORY_LENGTHS = (65536, 131072)


def bench_memory(model, scale, g, lengths=MEMORY_LENGTHS):
    out = {}
    for length in (n // scale for n in lengths):
        engine = Engine(model, service(length + 16, chunk=512, max_num_seqs=1, cache_bytes=(length + 1024) * 4096))
        engine.add_request(random_prompts(g, 1, length, length)[0], SamplingParams(max_tokens=1))
        with PeakMemory() as memory:
            while engine.has_unfinished():
                engine.step()
        out[str(length)] = {"peak_mib_beyond_pools": memory.peak_bytes / 2**20,
                            "pool_mib": engine.plan.total_bytes / 2**20}
        print("memory", length, out[str(length)], flush=True)  # a run cut short keeps the first length
    lengths = list(out)
    if len(lengths) < 2:  # one length per run (--memory-lengths): the ratio is taken across runs
        return out
    return out | {"peak_ratio_long_over_short": out[lengths[-1]]["peak_mib_beyond_pools"]
                  / out[lengths[0]]["peak_mib_beyond_pools"]}


def bench_dsa_chunk(model, scale, g):
    config, block, chunk = model.config, 64, 512
    layer = next(m for m in model.modules() if isinstance(m, GatedDSA))
    out = {}
    for context in (65536 // scale, 131072 // scale):
        blocks = -(-(context + chunk) // block)
        pools = PagedPools(config, blocks, block, num_slots=1)
        pool = next(p for p in map(pools.layer, range(config.num_layers)) if isinstance(p, DSAPool))
        count = blocks * block
        pool.write(torch.arange(count), torch.randn(count, pool.latent_dim, generator=g),
                   torch.randn(count, pool.index_dim, generator=g))
        batch = ForwardBatch.from_sequences([[0] * chunk], [context], [list(range(blocks))], [0], block)
        x = torch.randn(1, chunk, config.hidden_size, generator=g)
        for reads in GatedDSA.PAGED_READS:
            layer.paged_reads = reads
            start = time.perf_counter()
            with torch.no_grad(), PeakMemory() as memory:
                layer(x, batch=batch, pool=pool)
            out[f"{reads}_{context}"] = {"peak_mib": memory.peak_bytes / 2**20,
                                         "s_with_peak_memory": time.perf_counter() - start}
    layer.paged_reads = "blocks"
    return out


BENCHES = {"throughput": bench_throughput, "long": bench_long, "prefix": bench_prefix,
           "overhead": bench_overhead, "memory": bench_memory, "dsa_chunk": bench_dsa_chunk}


def main() -> None:
    parser = make_parser(__doc__, default_threads=2)
    parser.add_argument("--only", choices=sorted(BENCHES), action="append", help="run only these (repeatable)")
    parser.add_argument("--preset", default=None, help="model preset (default: small; tiny with --quick)")
    parser.add_argument("--scale", type=int, default=None, help="divide every size by this (default 1; 8 with --quick)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/bench_serving.json)")
    parser.add_argument("--memory-lengths", type=int, nargs="+", default=list(MEMORY_LENGTHS),
                        help="prompt lengths of the memory benchmark (default 65536 131072)")
    args = parser.parse_args()
    apply_threads(args)
    scale = args.scale or (8 if args.quick else 1)
    preset = args.preset or ("tiny" if args.quick else "small")
    torch.manual_seed(0)
    config = ModelConfig.from_preset(preset).replace(max_position_embeddings=262144)
    model = LatentMoEForCausalLM(config).eval()
    result = {"machine": machine_info(preset=preset, scale=scale)}
    for name in args.only or list(BENCHES):
        start = time.perf_counter()
        extra = {"lengths": args.memory_lengths} if name == "memory" else {}
        result[name] = BENCHES[name](model, scale, torch.Generator().manual_seed(1), **extra)
        result[name]["wall_s"] = time.perf_counter() - start
        print(name, result[name], flush=True)
        path = write_json(__file__, result, args.out)  # after each benchmark, so a run cut short keeps what it measured
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
