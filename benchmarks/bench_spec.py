"""Speculative decoding: output tokens/s with drafts (ngram, mtp) over without, in one process (docs/design.md §12).

Two parts, each at every --threads count:

    grid     per prompt set (--prompt-sets: held-out code, chat-formatted multi-turn chats) and batch size
             (max_num_seqs, --batches): the engine without a speculative section, then each method with a
             fixed K and with `speculative.adaptive` (--adaptive)
    context  batch 1, prompts of each --contexts length (the held-out files concatenated; every length ends at
             the same cut points, so only the context before them grows), --context-new-tokens each.
             Pass 1: each method at a fixed K, for acceptance per position and mean accepted length against
             context length. Pass 2, the gating: each method with adaptive K and `speculative.max_context`
             chosen from pass 1 (choose_max_context: drafts stop past the point after which no swept length's
             accepted length paid for its drafts)

Every run of every round is checked: its greedy tokens must equal the first run without speculation's
(greedy speculation is exact). The runs of one comparison take turns for --repeats rounds and the best of each
counts (a shared machine's load then hits them alike). Reported: decode tokens/s (tokens emitted by steps
without prefill over their time), its ratio over the baseline, the same per CPU-second of this process, the
end-to-end ratio (prefill included), the mean accepted length (tokens per verify step: accepted drafts + 1),
the acceptance rate per draft position, the drafts per emitted token, the CPU milliseconds of a decode step
and the drafter's part of them, and "full": the decode ratio over the steps that ran all `batch` sequences
(a closed set of requests ends with a tail of few running sequences, longer with speculation, since the
sequences finish at different steps; "full" is the steady state of a full batch). os.getloadavg() before and
after.

    python benchmarks/bench_spec.py --checkpoint DIR     a save_pretrained model with an MTP head (`make model-mtp`)
    python benchmarks/bench_spec.py --random mini        the same model shape with random weights
    python benchmarks/bench_spec.py --quick              a smoke run: tiny random model, few tokens, seconds

Contexts past the checkpoint's max_position_embeddings run with that limit raised in the loaded config (the
rotary angles are computed from positions, no weight depends on it): the mini preset has 8192 positions and
was trained on 128-token sequences, so every length here is already past what it saw. Prompts:
benchmarks/spec_prompts.py.
"""
from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig

from common import machine_info, write_json
from spec_prompts import chat_prompts, code_prompts, context_prompts, describe_prompts

PAYS = 1.0  # a context length pays for its drafts when the always-K run's decode ratio reaches this


@dataclass(frozen=True)
class Variant:
    """One engine of a comparison: method None is the baseline (no speculative section)."""

    method: str | None = None
    adaptive: bool = False
    max_context: int | None = None
    draft_cost: float | None = None  # with adaptive: speculative.draft_cost (None: the package's default)

    @property
    def label(self) -> str:
        if self.method is None:
            return "off"
        cap = "" if self.max_context is None else f"+cap{self.max_context}"
        cost = "" if self.draft_cost is None else f"(c={self.draft_cost:g})"
        return self.method + ("+adaptive" + cost if self.adaptive else "") + cap

    def section(self, k: int) -> dict | None:
        if self.method is None:
            return None
        spec = {"method": self.method, "num_speculative_tokens": k}
        if self.adaptive:
            spec["adaptive"] = True
            if self.draft_cost is not None:
                spec["draft_cost"] = self.draft_cost
        if self.max_context is not None:
            spec["max_context"] = self.max_context
        return spec


OFF = Variant()


def service(variant: Variant, k: int, batch: int, max_model_len: int) -> ServiceConfig:
    cache_bytes = max(64 << 20, (16 << 10) * max_model_len * batch)  # room for every sequence at full length
    return ServiceConfig.from_dict({"model": {"max_model_len": max_model_len},
                                    "memory": {"cache_bytes": cache_bytes, "block_size": 64, "max_num_seqs": batch},
                                    "scheduler": {"prefill_chunk_size": 512}, "speculative": variant.section(k)})


def timed_drafter(engine) -> list[float]:
    """Wraps the engine's drafter so that its propose_batch CPU seconds add up in the returned one-item list."""
    seconds = [0.0]
    if engine.speculator is not None:
        drafter = engine.speculator.drafter
        propose = drafter.propose_batch

        def timed(requests):
            start = time.process_time()
            drafts = propose(requests)
            seconds[0] += time.process_time() - start
            return drafts

        drafter.propose_batch = timed
    return seconds


def run(model, prompts, variant: Variant, k: int, batch: int, new_tokens: int) -> dict:
    """Every prompt through one engine; decode tokens/s counts the tokens emitted by steps without prefill
    tokens over those steps' time, end-to-end tokens/s all generated tokens over the whole run; the decode
    steps' CPU milliseconds each and the drafter's share of them."""
    engine = Engine(model, service(variant, k, batch, len(max(prompts, key=len)) + new_tokens + 8))
    drafter_seconds = timed_drafter(engine)
    ids = [engine.add_request(p, SamplingParams(max_tokens=new_tokens)) for p in prompts]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    decode_tokens, decode_steps, decode_seconds, decode_cpu, decode_drafter = 0, 0, 0.0, 0.0, 0.0
    full_tokens, full_seconds = 0, 0.0  # decode steps with `batch` sequences: the steady state, no tail
    start = time.perf_counter()
    while engine.has_unfinished():
        step_start, cpu_start, drafter_start = time.perf_counter(), time.process_time(), drafter_seconds[0]
        outputs = engine.step()
        emitted = sum(len(o.new_token_ids) for o in outputs)
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
        if engine.log.steps[-1].prefill_tokens == 0:
            decode_tokens += emitted
            decode_steps += 1
            decode_seconds += time.perf_counter() - step_start
            decode_cpu += time.process_time() - cpu_start
            decode_drafter += drafter_seconds[0] - drafter_start
            if len(outputs) == batch:
                full_tokens += emitted
                full_seconds += time.perf_counter() - step_start
    seconds = time.perf_counter() - start
    stats, generated = engine.stats(), sum(map(len, tokens.values()))
    return {"tokens": [tokens[i] for i in ids], "tok_s": decode_tokens / decode_seconds,
            "tok_cpu_s": decode_tokens / decode_cpu, "e2e_tok_s": generated / seconds,
            "full_tok_s": full_tokens / full_seconds if full_seconds else float("nan"),
            "mean_accepted_length": stats["spec_mean_accepted_length"],
            "acceptance_per_position": [round(r, 3) for r in stats["spec_acceptance_rate_per_position"]],
            "drafts_per_token": stats["spec_draft_tokens"] / generated,
            "step_cpu_ms": 1000 * decode_cpu / decode_steps, "drafter_cpu_ms": 1000 * decode_drafter / decode_steps}


def compare(model, prompts, variants: list[Variant], k: int, batch: int, new_tokens: int, repeats: int) -> dict:
    """variants[0] is OFF. They take turns for `repeats` rounds; every run's greedy tokens are checked equal to
    the first run's. Returns {label: the run with the best decode tok/s}."""
    best: dict[str, dict] = {}
    reference = None
    for _ in range(repeats):
        for variant in variants:
            result = run(model, prompts, variant, k, batch, new_tokens)
            if reference is None:
                reference = result["tokens"]
            elif result["tokens"] != reference:
                raise SystemExit(f"{variant.label} (batch {batch}): greedy tokens differ from the run without "
                                 "speculation")
            if variant.label not in best or result["tok_s"] > best[variant.label]["tok_s"]:
                best[variant.label] = result
    return best


def rows_of(best: dict, variants: list[Variant], **fields) -> list[dict]:
    """One row per speculative variant: its figures and their ratios over the baseline's."""
    base, rows = best[OFF.label], []
    for variant in variants[1:]:
        spec = best[variant.label]
        rows.append({**fields, "method": variant.method, "adaptive": variant.adaptive,
                     "max_context": variant.max_context, "draft_cost": variant.draft_cost, "label": variant.label,
                     "tok_s": spec["tok_s"], "baseline_tok_s": base["tok_s"], "ratio": spec["tok_s"] / base["tok_s"],
                     "cpu_ratio": spec["tok_cpu_s"] / base["tok_cpu_s"],
                     "e2e_ratio": spec["e2e_tok_s"] / base["e2e_tok_s"],
                     "full_batch_ratio": spec["full_tok_s"] / base["full_tok_s"],
                     "mean_accepted_length": spec["mean_accepted_length"],
                     "acceptance_per_position": spec["acceptance_per_position"],
                     "drafts_per_token": spec["drafts_per_token"], "step_cpu_ms": spec["step_cpu_ms"],
                     "drafter_cpu_ms": spec["drafter_cpu_ms"], "baseline_step_cpu_ms": base["step_cpu_ms"]})
    return rows


HEADER = (f"{'variant':>28} {'tok/s':>8} {'ratio':>6} {'cpu':>5} {'e2e':>5} {'full':>5} {'acc len':>7} "
          f"{'drafts/tok':>10} {'ms/step':>7} {'drafter':>7}  acceptance per position   (ms: CPU per decode step, "
          "the drafter's part)")


def print_rows(title: str, base_tok_s: float, rows: list[dict]) -> None:
    print(f"-- {title}   (off: {base_tok_s:.1f} decode tok/s, {rows[0]['baseline_step_cpu_ms']:.1f} CPU ms/step)",
          flush=True)
    for row in rows:
        print(f"{row['label']:>28} {row['tok_s']:>8.1f} {row['ratio']:>6.2f} {row['cpu_ratio']:>5.2f} "
              f"{row['e2e_ratio']:>5.2f} {row['full_batch_ratio']:>5.2f} {row['mean_accepted_length']:>7.2f} "
              f"{row['drafts_per_token']:>10.2f} {row['step_cpu_ms']:>7.1f} {row['drafter_cpu_ms']:>7.1f}  "
              f"{row['acceptance_per_position']}", flush=True)


def grid(model, args, methods: list[str], threads: int) -> list[dict]:
    """Every prompt set x batch: off, then each method at fixed K and (per --adaptive) adaptive."""
    adaptive = {"off": [False], "on": [True], "both": [False, True]}[args.adaptive]
    variants = [OFF] + [Variant(m, a, draft_cost=cost) for m in methods for a in adaptive
                        for cost in (args.draft_cost if a else [None])]
    prompt_sets = {"code": code_prompts(args.prompts, args.prompt_bytes),
                   "chat": chat_prompts(args.prompts, args.prompt_bytes)}
    rows = []
    for name in args.prompt_sets:
        prompts = prompt_sets[name]
        for batch in args.batches:
            best = compare(model, prompts, variants, args.k, batch, args.new_tokens, args.repeats)
            part = rows_of(best, variants, part="grid", prompts=name, threads=threads, batch=batch,
                           prompt_tokens=describe_prompts(prompts), new_tokens=args.new_tokens)
            print_rows(f"{name}: {describe_prompts(prompts)}, batch {batch}, {threads} thread(s)",
                       best[OFF.label]["tok_s"], part)
            rows += part
    return rows


def choose_max_context(ratios: dict[int, float], new_tokens: int) -> int | None:
    """speculative.max_context from the always-K pass: {context length: decode ratio over off}.

    A length pays when its ratio reaches PAYS (its mean accepted length beat the break-even one, length /
    ratio, of the same runs). None (no cap) when the longest length pays. Else the cap lies between the
    longest paying length below the failing tail and the tail's first length: their geometric mean, at least
    that paying length + new_tokens (its prompts draft to their end); 1 (never draft) when none pays."""
    lengths = sorted(ratios)
    if ratios[lengths[-1]] >= PAYS:
        return None
    tail = len(lengths) - 1
    while tail > 0 and ratios[lengths[tail - 1]] < PAYS:
        tail -= 1
    if tail == 0:
        return 1
    paying, failing = lengths[tail - 1], lengths[tail]
    return max(paying + new_tokens, round(math.sqrt(paying * failing)))


def context_sweep(model, args, methods: list[str], threads: int) -> tuple[list[dict], dict]:
    """Batch 1 at each --contexts length: always K (pass 1), then adaptive + the chosen max_context (pass 2)."""
    lengths = sorted(args.contexts)
    prompt_sets = {n: context_prompts(max(1, min(args.context_prompts, args.context_budget // n)), n, lengths[-1])
                   for n in lengths}
    rows, caps, new = [], {}, args.context_new_tokens
    always = [OFF] + [Variant(m) for m in methods]
    for n in lengths:
        best = compare(model, prompt_sets[n], always, args.k, 1, new, args.context_repeats)
        part = rows_of(best, always, part="context", gating=False, context=n, threads=threads,
                       prompts=len(prompt_sets[n]), new_tokens=new)
        print_rows(f"context {n}: {describe_prompts(prompt_sets[n])}, batch 1, always K", best[OFF.label]["tok_s"],
                   part)
        rows += part
    for method in methods:
        caps[method] = choose_max_context({r["context"]: r["ratio"] for r in rows if r["method"] == method}, new)
        print(f"{method}: max_context {caps[method]} (choose_max_context)", flush=True)
    gated = [OFF] + [Variant(m, True, caps[m], cost) for m in methods for cost in args.draft_cost]
    for n in lengths:
        best = compare(model, prompt_sets[n], gated, args.k, 1, new, args.context_repeats)
        part = rows_of(best, gated, part="context", gating=True, context=n, threads=threads,
                       prompts=len(prompt_sets[n]), new_tokens=new)
        print_rows(f"context {n}: gated (adaptive + max_context)", best[OFF.label]["tok_s"], part)
        rows += part
    return rows, caps


def load_model(args):
    """(model, label): the checkpoint in fp32, or a random model with an MTP head; positions raised to fit
    the longest context prompt + its new tokens."""
    if args.checkpoint:
        model = LatentMoEForCausalLM.from_pretrained(args.checkpoint).float().eval()
        label = f"checkpoint {args.checkpoint}"
    else:
        torch.manual_seed(0)
        model = LatentMoEForCausalLM(ModelConfig.from_preset(args.random or "mini").replace(mtp_depth=1)).eval()
        label = f"random {args.random or 'mini'}"
    needed = max(args.contexts, default=0) + args.context_new_tokens + 8
    if needed > model.config.max_position_embeddings:
        print(f"max_position_embeddings {model.config.max_position_embeddings} -> {needed} for the longest context "
              "(rotary angles come from positions; no weight changes)")
        model.config = model.config.replace(max_position_embeddings=needed)
    return model, label


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny random model, 2 prompts, 8 tokens, batches 1 and 2, contexts 64 and 128")
    parser.add_argument("--threads", type=int, nargs="+", default=[1], help="torch thread counts, a pass each")
    parser.add_argument("--checkpoint", help="save_pretrained directory of a model (with an MTP head for mtp)")
    parser.add_argument("--random", default=None, help="preset of a random-weight model (with mtp_depth 1)")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--adaptive", choices=("off", "on", "both"), default="both",
                        help="grid: fixed K, speculative.adaptive (k per sequence in 0..K), or both")
    parser.add_argument("--draft-cost", type=float, nargs="+", default=[None],
                        help="speculative.draft_cost of the adaptive runs, one run per value (default: the package's)")
    parser.add_argument("--prompt-sets", nargs="*", choices=("code", "chat"), default=["code", "chat"])
    parser.add_argument("--prompts", type=int, default=8, help="grid prompts per set")
    parser.add_argument("--prompt-bytes", type=int, default=384)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=2, help="grid rounds of (off, variants...); best of each")
    parser.add_argument("--contexts", type=int, nargs="*", default=[256, 1024, 4096, 16384],
                        help="context sweep lengths in tokens (none: no sweep)")
    parser.add_argument("--context-prompts", type=int, default=4, help="at most this many prompts per length")
    parser.add_argument("--context-budget", type=int, default=8192,
                        help="prompt tokens per length: min(--context-prompts, budget // length) prompts, >= 1")
    parser.add_argument("--context-new-tokens", type=int, default=48)
    parser.add_argument("--context-repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.random, args.prompts, args.new_tokens, args.batches, args.repeats = "tiny", 2, 8, [1, 2], 1
        args.contexts, args.context_prompts, args.context_new_tokens = [64, 128], 1, 8
    return args


def main() -> None:
    args = parse_args()
    load_before = os.getloadavg()
    model, label = load_model(args)
    methods = ["ngram"] + (["mtp"] if model.config.mtp_depth > 0 else [])
    print(f"{label}: K={args.k}, load average {load_before[0]:.2f} / {load_before[1]:.2f} / {load_before[2]:.2f} "
          "(a shared machine: figures under that load)\n" + HEADER, flush=True)
    rows, caps = [], {}
    start = time.perf_counter()
    for threads in args.threads:
        torch.set_num_threads(threads)
        rows += grid(model, args, methods, threads) if args.prompt_sets else []
        if args.contexts:
            sweep, caps[threads] = context_sweep(model, args, methods, threads)
            rows += sweep
    load_after = os.getloadavg()
    print(f"{time.perf_counter() - start:.0f} s; load average after {load_after[0]:.2f} / {load_after[1]:.2f} / "
          f"{load_after[2]:.2f}")
    if args.out:
        settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
        write_json(__file__, {"model": label, "machine": machine_info(), "settings": settings,
                              "loadavg_before": load_before, "loadavg_after": load_after,
                              "seconds": time.perf_counter() - start, "max_context": caps, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
