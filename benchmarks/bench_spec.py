"""Speculative decoding: output tokens/s with drafts (ngram, mtp) over without, in one process (docs/design.md §12).

For each torch thread count and batch size (max_num_seqs), the same greedy requests run through an Engine
without a speculative section and with each method; every spec run's tokens must equal the baseline's
(greedy speculation is exact). The runs take turns for --repeats rounds and the best of each counts (a shared
machine's load then hits them alike). Reported: decode tokens/s (tokens emitted by steps without prefill over
their time), its ratio over the baseline, the same per CPU-second of this process (steadier than wall time on
a shared machine; with 2 threads it counts both), the end-to-end ratio (prefill included), the mean accepted
length (tokens per verify step: accepted drafts + 1) and the acceptance rate per draft position.

    python benchmarks/bench_spec.py --checkpoint DIR     a save_pretrained model with an MTP head (train it
                                                          with --mtp-depth 1, export with trained_model export)
    python benchmarks/bench_spec.py --random mini        the same model shape with random weights
    python benchmarks/bench_spec.py --quick              a smoke run: tiny random model, few tokens

Prompts: the first --prompt-bytes bytes of the first 16 held-out files of the training corpus (the stdlib).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.training.corpus import is_held_out, source_files, stdlib_root


def code_prompts(count: int, prompt_bytes: int) -> list[list[int]]:
    """The first prompt_bytes bytes (byte tokens) of the first `count` held-out corpus files."""
    root, prompts = stdlib_root(), []
    for path in source_files(root):  # the corpus's held-out split, chosen by path alone (nothing else is read)
        relative = path.relative_to(root).as_posix()
        if is_held_out(relative, 0.02) and len(prompts) < count:
            text = f"# file: {relative}\n" + path.read_bytes().decode("utf-8", errors="replace")
            prompts.append(list(text.encode("utf-8")[:prompt_bytes]))
    return prompts


def service(method: str | None, k: int, batch: int, max_model_len: int, adaptive: bool = False) -> ServiceConfig:
    spec = None if method is None else {"method": method, "num_speculative_tokens": k, "adaptive": adaptive}
    return ServiceConfig.from_dict({"model": {"max_model_len": max_model_len},
                                    "memory": {"cache_bytes": 64 << 20, "block_size": 64, "max_num_seqs": batch},
                                    "scheduler": {"prefill_chunk_size": 512}, "speculative": spec})


def run(model, prompts, method, k, batch, new_tokens, adaptive=False) -> dict:
    """Every prompt through one engine; decode tokens/s counts the tokens emitted by steps without prefill
    tokens over those steps' time, end-to-end tokens/s all generated tokens over the whole run."""
    engine = Engine(model, service(method, k, batch, len(max(prompts, key=len)) + new_tokens + 8, adaptive))
    ids = [engine.add_request(p, SamplingParams(max_tokens=new_tokens)) for p in prompts]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    decode_tokens, decode_seconds, decode_cpu = 0, 0.0, 0.0
    start = time.perf_counter()
    while engine.has_unfinished():
        step_start, cpu_start = time.perf_counter(), time.process_time()
        outputs = engine.step()
        emitted = sum(len(o.new_token_ids) for o in outputs)
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
        if engine.log.steps[-1].prefill_tokens == 0:
            decode_tokens += emitted
            decode_seconds += time.perf_counter() - step_start
            decode_cpu += time.process_time() - cpu_start
    seconds = time.perf_counter() - start
    stats = engine.stats()
    return {"tokens": [tokens[i] for i in ids], "tok_s": decode_tokens / decode_seconds,
            "tok_cpu_s": decode_tokens / decode_cpu,
            "e2e_tok_s": sum(map(len, tokens.values())) / seconds,
            "mean_accepted_length": stats["spec_mean_accepted_length"],
            "acceptance_per_position": [round(r, 3) for r in stats["spec_acceptance_rate_per_position"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="save_pretrained directory of a model (with an MTP head for mtp)")
    parser.add_argument("--random", default=None, help="preset of a random-weight model (with mtp_depth 1)")
    parser.add_argument("--quick", action="store_true", help="tiny random model, 4 prompts, 16 tokens")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--adaptive", action="store_true", help="speculative.adaptive: k per sequence in 0..K "
                        "from its acceptance (serving/spec/draft_count.py)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-bytes", type=int, default=384)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=2, help="rounds of (off, methods...); best of each")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.random, args.new_tokens, args.prompts, args.batches, args.threads = "tiny", 16, 4, [1, 4], [1]
        args.repeats = 1
    if args.checkpoint:
        model = LatentMoEForCausalLM.from_pretrained(args.checkpoint).float().eval()
        label = f"checkpoint {args.checkpoint}"
    else:
        torch.manual_seed(0)
        model = LatentMoEForCausalLM(ModelConfig.from_preset(args.random or "mini").replace(mtp_depth=1)).eval()
        label = f"random {args.random or 'mini'}"
    methods = ["ngram"] + (["mtp"] if model.config.mtp_depth > 0 else [])
    prompts = code_prompts(args.prompts, args.prompt_bytes)
    rows = []
    print(f"{label}: {len(prompts)} prompts of {args.prompt_bytes} bytes, {args.new_tokens} new tokens, K={args.k}"
          + (" (adaptive)" if args.adaptive else ""))
    print(f"{'threads':>7} {'batch':>5} {'method':>6} {'tok/s':>8} {'ratio':>6} {'cpu ratio':>9} {'e2e ratio':>9} "
          f"{'accepted len':>12}  per position   (tok/s: decode steps only; cpu: per CPU-second of this process; "
          "e2e: prefill included)")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batches:
            # the methods take turns, --repeats rounds, best of each: a shared machine's load hits all alike
            best: dict = {}
            for _ in range(args.repeats):
                for method in [None] + methods:
                    result = run(model, prompts, method, args.k, batch, args.new_tokens, args.adaptive)
                    if method not in best or result["tok_s"] > best[method]["tok_s"]:
                        best[method] = result
            base = best[None]
            print(f"{threads:>7} {batch:>5} {'off':>6} {base['tok_s']:>8.1f} {1.0:>6.2f} {1.0:>9.2f} {1.0:>9.2f}")
            for method in methods:
                spec = best[method]
                if spec["tokens"] != base["tokens"]:
                    raise SystemExit(f"{method}: greedy tokens differ from the run without speculation")
                ratio, e2e = spec["tok_s"] / base["tok_s"], spec["e2e_tok_s"] / base["e2e_tok_s"]
                cpu = spec["tok_cpu_s"] / base["tok_cpu_s"]
                print(f"{threads:>7} {batch:>5} {method:>6} {spec['tok_s']:>8.1f} {ratio:>6.2f} {cpu:>9.2f} "
                      f"{e2e:>9.2f} {spec['mean_accepted_length']:>12.2f}  {spec['acceptance_per_position']}")
                rows.append({"model": label, "threads": threads, "batch": batch, "method": method,
                             "adaptive": args.adaptive,
                             "tok_s": spec["tok_s"], "baseline_tok_s": base["tok_s"], "ratio": ratio,
                             "e2e_ratio": e2e, "cpu_ratio": cpu,
                             "mean_accepted_length": spec["mean_accepted_length"],
                             "acceptance_per_position": spec["acceptance_per_position"]})
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
