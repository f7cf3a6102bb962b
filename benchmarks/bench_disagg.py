"""Prefill/decode disaggregation (issue 27): one colocated engine against one prefill + one decode instance.

    .venv/bin/python benchmarks/bench_disagg.py            # 8 prompts of 8k tokens among 32 chat requests
    .venv/bin/python benchmarks/bench_disagg.py --quick    # 2 prompts of 1k among 8: checks the harness
    .venv/bin/python benchmarks/bench_disagg.py --long-tokens 2048 --modes 1P1D,colocated_1thread --repeats 3
                                                           # a shorter shape, two modes interleaved, the
                                                           # median run of each (by p99 TPOT of the short requests)

The workload: 32 short chat requests (64-token prompts, 64 new tokens) arriving every --gap seconds, and 8
long prompts (8192 tokens, 64 new tokens) arriving among them (every fifth arrival), greedy, tiny preset with
max_position_embeddings raised to 16384 (served from a checkpoint written here, so both modes load it).
colocated  one engine (its forward in a worker process with 2 torch threads, as `serve` runs it): a step
           holds the decodes of the running requests and a prefill chunk (scheduler.prefill_chunk_size 512);
           also with 1 thread (colocated_1thread): on a shared 2-core machine two OpenMP threads stall on
           every small op whenever the other core is busy, which the 2-thread figure then includes
1P1D       a prefill instance and a decode instance, 1 torch thread each (configs/service-cpu-pd.yaml's
           shape): the decode instance's steps hold decodes only
Both are driven through the server's worker interface (submit / deliver, what the HTTP handlers call), so
the figures leave out HTTP and client parsing, the same for both. Measured per request from its submit:
TTFT, TPOT (mean interval of its tokens 2..n); throughput = generated tokens / (last finish - first
arrival); for 1P1D the transfers (bytes, seconds from export start on the prefill side to import done on
the decode side) per 1k prompt tokens and against the request's TTFT. Targets: p99 TPOT of the short
requests >= 3x lower with 1P1D, throughput within 0.8x of colocated. Writes benchmarks/bench_disagg.json.
"""
from __future__ import annotations

import dataclasses
import os
import random
import statistics
import tempfile
from pathlib import Path

import torch
from common import machine_info, make_parser, write_json

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.server.disagg_worker import DisaggWorker
from latentmoe_lab.server.drive import drive
from latentmoe_lab.server.loading import load_model
from latentmoe_lab.server.settings import split_service_dict
from latentmoe_lab.server.worker import EngineWorker
from latentmoe_lab.serving import SamplingParams
from latentmoe_lab.serving.bench_workload import WorkloadRequest

FULL = {"short": 32, "long": 8, "long_tokens": 8192, "new_tokens": 64, "gap_s": 0.25}
QUICK = {"short": 8, "long": 2, "long_tokens": 1024, "new_tokens": 16, "gap_s": 0.1}


MODES = {"colocated": 2, "colocated_1thread": 1, "1P1D": 1}  # mode -> torch threads of each forward process


def service(checkpoint: str, max_model_len: int, mode: str) -> dict:
    base = {"model": {"name": "bench-pd", "checkpoint": checkpoint, "max_model_len": max_model_len},
            "memory": {"max_num_seqs": 48, "block_size": 64, "cache_bytes": 96_000_000},
            "scheduler": {"max_batch_size": 128, "prefill_chunk_size": 512}}
    if mode != "1P1D":
        return {**base, "parallel": {"forward_process": True, "forward_threads": MODES[mode]}}
    return {**base, "parallel": {"forward_threads": 1},
            "disaggregation": {"prefill_instances": 1, "decode_instances": 1, "transport": "pipe"}}


def workload(shape: dict, seed: int = 0) -> list[dict]:
    """Arrivals in order: every fifth is a long prompt; prompts are random bytes (no prefix shared)."""
    rng = random.Random(seed)
    kinds = ["short"] * shape["short"]
    for i in range(shape["long"]):
        kinds.insert(min(len(kinds), 2 + 5 * i), "long")
    return [{"kind": kind, "at": i * shape["gap_s"],
             "prompt": [rng.randrange(3, 256) for _ in range(64 if kind == "short" else shape["long_tokens"])]}
            for i, kind in enumerate(kinds)]


def run(worker, requests: list[dict], new_tokens: int) -> list[dict]:
    """Submit at the arrival times (server/drive.py); per request its kind, submit time, token times and end."""
    driven = drive(worker, [WorkloadRequest(r["at"], r["prompt"], SamplingParams(max_tokens=new_tokens))
                            for r in requests])
    return [{"kind": r["kind"], **dataclasses.asdict(record)} for r, record in zip(requests, driven)]


def summary(records: list[dict]) -> dict:
    def p99(values):
        return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else values[0]

    ttft = [r["times"][0] - r["submitted"] for r in records]
    tpot_short = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in records
                  if r["kind"] == "short" and len(r["times"]) > 1]
    span = max(r["end"] for r in records) - min(r["submitted"] for r in records)
    generated = sum(len(r["ids"]) for r in records)
    return {"p99_tpot_short_s": p99(tpot_short), "p50_tpot_short_s": statistics.median(tpot_short),
            "p99_ttft_s": p99(ttft), "p50_ttft_s": statistics.median(ttft),
            "p99_ttft_short_s": p99([t for t, r in zip(ttft, records) if r["kind"] == "short"]),
            "seconds": span, "generated_tokens": generated, "throughput_tok_s": generated / span,
            "total_tokens_s": (generated + sum(r["prompt_tokens"] for r in records)) / span}


def transfers(worker: DisaggWorker, records: list[dict]) -> dict:
    by_key = {r["key"]: r for r in records}
    rows = [(by_key[t.key], t.size, t.seconds, t.prompt_tokens) for t in worker.transfers
            if t.key in by_key]  # not the warm-up's
    long_rows = [row for row in rows if row[0]["kind"] == "long"] or rows
    return {"count": len(rows), "bytes": sum(row[1] for row in rows),
            "seconds_per_1k_prompt_tokens": statistics.median(row[2] / row[3] * 1000 for row in long_rows),
            "bytes_per_prompt_token": statistics.median(row[1] / row[3] for row in long_rows),
            "share_of_ttft_long": statistics.median(row[2] / (row[0]["times"][0] - row[0]["submitted"])
                                                    for row in long_rows)}


def run_mode(mode: str, checkpoint: str, max_model_len: int, shape: dict, requests: list[dict]) -> tuple[dict, list]:
    engine_config, settings = split_service_dict(service(checkpoint, max_model_len, mode))
    worker = (DisaggWorker(engine_config, settings, load_model) if mode == "1P1D"
              else EngineWorker(engine_config, settings, lambda: load_model(engine_config)))
    worker.start()
    try:
        run(worker, workload({**shape, "short": 2, "long": 0}, seed=1), 4)  # warm-up
        records = run(worker, requests, shape["new_tokens"])
        result = summary(records)
        if mode == "1P1D":
            result["transfers"] = transfers(worker, records)
        return result, [r["ids"] for r in records]
    finally:
        worker.stop()


def median_run(runs: list[dict]) -> dict:
    """The repeat whose p99 TPOT of the short requests is the median (the lower one of an even count), every
    figure from that one run (transfers included), never a row mixed from several runs; all runs under "runs"."""
    chosen = statistics.median_low(run["p99_tpot_short_s"] for run in runs)
    index = next(i for i, run in enumerate(runs) if run["p99_tpot_short_s"] == chosen)
    return runs[index] | {"median_of": "p99_tpot_short_s", "run_index": index, "runs": runs}


def main() -> None:
    parser = make_parser(__doc__, None, full_doc=True)
    parser.add_argument("--gap", type=float, default=None, help="seconds between arrivals (default: the shape's)")
    parser.add_argument("--long-tokens", type=int, default=None,
                        help="tokens of a long prompt (default: the shape's, 8192; fewer on a busy machine)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of %(default)s")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each mode, interleaved; each mode's median run (by p99 short TPOT) reported")
    parser.add_argument("--out", default=None, help="JSON path (default: next to the script)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if "1P1D" not in modes or not set(modes) <= set(MODES):
        raise SystemExit(f"--modes: 1P1D and some of {list(MODES)}, got {args.modes!r}")
    shape = dict(QUICK if args.quick else FULL)
    shape["gap_s"] = args.gap or shape["gap_s"]
    shape["long_tokens"] = args.long_tokens or shape["long_tokens"]
    torch.set_num_threads(1)  # this process only routes; the forwards run in their processes
    requests = workload(shape)
    max_model_len = shape["long_tokens"] + shape["new_tokens"] + 64
    runs, outputs = {mode: [] for mode in modes}, {mode: [] for mode in modes}  # outputs: every repeat's ids
    with tempfile.TemporaryDirectory() as checkpoint:
        config = dataclasses.replace(ModelConfig.from_preset("tiny"), max_position_embeddings=16384)
        torch.manual_seed(0)
        LatentMoEForCausalLM(config).save_pretrained(checkpoint)
        for repeat in range(args.repeats):
            for mode in modes:
                figures, ids = run_mode(mode, checkpoint, max_model_len, shape, requests)
                outputs[mode].append(ids)
                figures["load_average"] = os.getloadavg()[0]
                runs[mode].append(figures)
                print(repeat, mode, {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()},
                      flush=True)
    results = {mode: median_run(mode_runs) for mode, mode_runs in runs.items()}
    split = results["1P1D"]
    ratios = {baseline: {"tpot_short_p99": results[baseline]["p99_tpot_short_s"] / split["p99_tpot_short_s"],
                         "ttft_p99": results[baseline]["p99_ttft_s"] / split["p99_ttft_s"],
                         "throughput_1p1d_over_baseline":
                             split["throughput_tok_s"] / results[baseline]["throughput_tok_s"]}
              for baseline in modes if baseline != "1P1D"}
    equal = all(ids == outputs["1P1D"][0] for repeats in outputs.values() for ids in repeats)
    result = machine_info(shape=shape, repeats=args.repeats, modes=results, ratios=ratios, outputs_equal=equal)
    for baseline, ratio in ratios.items():
        print(f"{baseline} / 1P1D: p99 TPOT (short) {ratio['tpot_short_p99']:.2f}x (target >= 3), p99 TTFT "
              f"{ratio['ttft_p99']:.2f}x; throughput 1P1D / {baseline} {ratio['throughput_1p1d_over_baseline']:.2f} "
              f"(target >= 0.8)")
    print(f"outputs equal in every mode and repeat: {result['outputs_equal']}")
    default = Path(__file__).with_name("bench_disagg_quick.json" if args.quick else "bench_disagg.json")
    print(f"wrote {write_json(__file__, result, Path(args.out) if args.out else default)}")


if __name__ == "__main__":
    main()
