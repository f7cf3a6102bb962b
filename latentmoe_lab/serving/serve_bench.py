"""serve-bench on one engine in this process (docs/design.md §6.6): the workload's flags checked, the
synthetic workload (bench_workload.py) run through an Engine, the latency table and HTML report.

The `serve-bench` and `plan-service` subcommands live in server/service_cli.py: they check a service file's
`server:` section as `serve` does, and a disaggregation: section runs the instance processes of server/.
"""
from __future__ import annotations

import argparse
import math
import sys
import time


def say(message: str) -> None:
    """A progress line on stderr with the wall-clock time."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def check_bench_flags(args: argparse.Namespace, max_model_len: int) -> None:
    """serve-bench's workload flags, named as typed, refused before the model is built."""
    from latentmoe_lab.report import check_report_path

    rules = (("--requests", args.requests >= 1, "must be >= 1"),
             ("--rate", args.rate > 0 and math.isfinite(args.rate), "must be a finite number > 0 (per second)"),
             ("--min-prompt", args.min_prompt >= 1, "must be >= 1"),
             ("--max-prompt", args.max_prompt >= args.min_prompt, f"must be >= --min-prompt ({args.min_prompt})"),
             ("--max-tokens", 1 <= args.max_tokens < max_model_len,
              f"must be >= 1 and below the config's model.max_model_len ({max_model_len})"),
             ("--image-fraction", args.image_fraction is None or 0 <= args.image_fraction <= 1, "must be in [0, 1]"),
             ("--threads", args.threads is None or args.threads >= 1, "must be >= 1"))
    for flag, holds, rule in rules:
        if not holds:
            raise ValueError(f"{flag}: {rule}, got {getattr(args, flag[2:].replace('-', '_'))}")
    if args.min_prompt > max_model_len - args.max_tokens:
        raise ValueError(f"--min-prompt, --max-tokens: {args.min_prompt} + {args.max_tokens} tokens do not fit in "
                         f"the config's model.max_model_len ({max_model_len})")
    check_report_path(args.report, "--report")


def serve_bench_colocated(args: argparse.Namespace, service, load_model) -> int:
    """serve-bench on one engine in this process (server/service_cli.py picks this or the disaggregated run);
    `service` is the loaded ServiceConfig, its flags checked (check_bench_flags); load_model(service) -> the
    model it names (server/loading.py, as `serve` loads it)."""
    from tqdm.auto import tqdm

    from latentmoe_lab.report import write_html_report
    from latentmoe_lab.serving.bench_workload import run_workload, synthetic_workload
    from latentmoe_lab.serving.engine import Engine
    from latentmoe_lab.serving.metrics import format_table, summarize
    from latentmoe_lab.viz.serving import latency_histograms, timeline_figure

    args.image_fraction = 0.25 if args.image_fraction is None else args.image_fraction
    from latentmoe_lab.threads import apply_threads

    threads = apply_threads(args.threads, echo=say)
    if args.threads is not None and not service.parallel.forward_threads:  # the forward process's too
        service.parallel.forward_threads = threads
    say(f"building {service.model.preset or service.model.checkpoint}")
    model = load_model(service)
    engine = Engine(model, service)
    say(f"cache plan:\n{engine.plan.table()}")
    requests = synthetic_workload(args.requests, args.rate, args.min_prompt,
                                  min(args.max_prompt, service.model.max_model_len - args.max_tokens),
                                  args.max_tokens, args.image_fraction, model.config.vocab_size, args.seed,
                                  has_vision=model.config.vision is not None)
    start = time.monotonic()
    with tqdm(total=len(requests), desc="serve-bench") as bar:
        outputs = run_workload(engine, requests, bar)
    elapsed = time.monotonic() - start
    errors = [o for o in outputs if o.error]
    finished = [o.metrics for o in outputs if not o.error]
    stats = engine.stats()
    generated = sum(m.generated_tokens for m in finished)
    summary = format_table(summarize(finished))
    header = (f"{len(outputs)} requests ({len(errors)} failed) at {args.rate}/s in {elapsed:.1f} s: "
              f"{generated / elapsed:.1f} generated tokens/s, {stats['steps']} steps, "
              f"{stats['preemptions']} preemptions, {stats['prefix_hit_tokens']} prefix-hit tokens")
    stat_line = ", ".join(f"{k} {v}" for k, v in stats.items())
    print(header)
    print(summary)
    print(stat_line)
    for out in errors:
        print(f"request {out.request_id} failed: {out.error}")
    path = write_html_report(args.report, "LatentMoE Lab serve-bench", [
        header, summary, stat_line, engine.plan.table(),
        timeline_figure(engine.log.steps, engine.block_manager.num_blocks), latency_histograms(finished)])
    print(f"HTML report: {path}")
    return 0 if not errors else 1
