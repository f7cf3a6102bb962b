"""Prefix cache spill: time to first token of a shared-prefix hit served from host or disk vs recomputed.

    .venv/bin/python benchmarks/bench_prefix_spill.py            # small preset, 3 prefixes of 2048 tokens
    .venv/bin/python benchmarks/bench_prefix_spill.py --quick    # tiny preset, 3 prefixes of 256 tokens
    ... --forward-process    every engine's forward in a worker process (parallel.forward_process, as the
                             shipped CPU service file): the spill copies blocks out of and into its pools

The workload: --prefixes long shared prefixes (system prompts), visited round-robin --rounds times, each
request the prefix plus a few tokens of its own and one generated token. The device cache (memory.cache_bytes)
holds one max_model_len sequence and one block more, so the device prefix cache alone can keep only the
prefix just served: every request of the round-robin finds its prefix evicted. Three engines on the same
weights serve the same requests, one at a time, in turn (so that load spikes on the shared machine hit all
three alike):

    recompute   prefix caching on, no spill: the evicted prefix is prefilled again
    host        memory.prefix_cache.host_bytes large enough for every prefix: a hit restores rows + snapshot from RAM
    disk        host_bytes 0, disk_dir a temporary directory: every eviction is written to safetensors
                files and a hit reads them back (checksums checked); the files sit in the OS page cache

A hit is a request after the first round. Reported per engine: the median TTFT over hits, its ratio to
recompute's (target: >= 3x lower), the hits by tier and the bytes moved. Greedy tokens of the three engines
must agree (the spill changes which computation a row comes from, not its value). One torch thread by
default (--threads). Writes benchmarks/bench_prefix_spill.json (_workers with --forward-process, _quick).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.planner import pools_bytes

from common import apply_threads, machine_info, make_parser, write_json

BLOCK = 64


def service(model, prefix_len: int, spill: dict | None, forward_threads: int = 0) -> ServiceConfig:
    """One running sequence, 4 snapshot rows, and blocks for one max_model_len sequence plus one; with
    forward_threads > 0 the forward runs in a worker process with that many torch threads."""
    max_len = prefix_len + 2 * BLOCK
    data = {"model": {"max_model_len": max_len},
            "parallel": {"forward_process": forward_threads > 0, "forward_threads": forward_threads},
            "memory": {"block_size": BLOCK, "max_num_seqs": 1,
                       "prefix_cache": {"snapshot_slots": 4, **(spill or {})}},
            "scheduler": {"prefill_chunk_size": 512, "max_batch_size": 4}}
    probe = ServiceConfig.from_dict(data)
    block, slot = pools_bytes(model.config, probe, 1, 0), pools_bytes(model.config, probe, 0, 1)
    data["memory"]["cache_bytes"] = 5 * slot + (max_len // BLOCK + 1) * block
    return ServiceConfig.from_dict(data)


def main() -> None:
    parser = make_parser(__doc__, default_threads=1)
    parser.add_argument("--prefixes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--forward-process", action="store_true", help="the forward in a worker process")
    args = parser.parse_args()
    apply_threads(args)
    preset, prefix_len, rounds = ("tiny", 256, 2) if args.quick else ("small", 2048, args.rounds)
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(ModelConfig.from_preset(preset)).eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(0, vocab, (prefix_len,), generator=g).tolist() for _ in range(args.prefixes)]
    requests = [prefixes[i % args.prefixes] + torch.randint(0, vocab, (5,), generator=g).tolist()
                for i in range(rounds * args.prefixes)]
    params = SamplingParams(max_tokens=1)
    with tempfile.TemporaryDirectory() as disk_dir:
        workers = args.threads if args.forward_process else 0  # the worker's threads: those of the engine here
        engines = {"recompute": Engine(model, service(model, prefix_len, None, workers)),
                   "host": Engine(model, service(model, prefix_len, {"host_bytes": 1 << 34}, workers)),
                   "disk": Engine(model, service(model, prefix_len, {"host_bytes": 0, "disk_dir": disk_dir}, workers))}
        ttft = {name: [] for name in engines}
        tokens = {name: [] for name in engines}
        start = time.perf_counter()
        for i, prompt in enumerate(requests):
            names = list(engines)[i % 3:] + list(engines)[:i % 3]  # rotate who goes first
            for name in names:
                out = engines[name].generate([prompt], params, use_tqdm=False)[0]
                ttft[name].append(out.metrics.ttft)
                tokens[name].append(out.token_ids)
        wall = time.perf_counter() - start
        stats = {name: engine.stats() for name, engine in engines.items()}
        for engine in engines.values():
            engine.close()  # worker processes (and the disk spill's last writes) before the directory goes
    hits = args.prefixes  # the first round misses everywhere
    base = statistics.median(ttft["recompute"][hits:])
    result = {"machine": machine_info(preset=preset, prefix_len=prefix_len, prefixes=args.prefixes, rounds=rounds,
                                      device_blocks=engines["host"].plan.num_blocks, quick=args.quick,
                                      forward_process=args.forward_process),
              "wall_seconds": round(wall, 2), "tokens_agree": tokens["host"] == tokens["recompute"] == tokens["disk"],
              "engines": {}}
    for name in engines:
        median_hit = statistics.median(ttft[name][hits:])
        s = stats[name]
        result["engines"][name] = {
            "ttft_first_round_median_s": round(statistics.median(ttft[name][:hits]), 5),
            "ttft_hit_median_s": round(median_hit, 5), "ttft_speedup_vs_recompute": round(base / median_hit, 2),
            "prefix_hit_tokens": s["prefix_hit_tokens"],
            **{key: s[key] for key in s if key.startswith(("prefix_hits_", "spill_bytes_", "spill_disk", "spill_host"))}}
        print(f"{name:>10}: TTFT on hits {median_hit * 1e3:8.1f} ms (first round "
              f"{statistics.median(ttft[name][:hits]) * 1e3:8.1f} ms), {base / median_hit:5.2f}x vs recompute, "
              f"hit tokens {s['prefix_hit_tokens']}")
    print(f"greedy tokens agree: {result['tokens_agree']}")
    name = "bench_prefix_spill" + ("_workers" if args.forward_process else "") + ("_quick" if args.quick else "")
    out = write_json(__file__, result, Path(__file__).with_name(f"{name}.json"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
