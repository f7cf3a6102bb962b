"""Subcommands `plan-service` and `serve-bench` (registered in latentmoe_lab/cli.py through add_parser).

    latentmoe-lab plan-service configs/service-example.yaml        per-device memory plan, nothing allocated
    latentmoe-lab serve-bench --config configs/service-cpu.yaml    synthetic workload -> metrics + reports/serve.html
    latentmoe-lab serve-bench --config configs/service-cpu-pd.yaml the same through prefill + decode instance
                                                                   processes; the report shows their timelines
"""
from __future__ import annotations

import argparse
import math
import sys
import time

from latentmoe_lab.config import PRESETS


def add_parser(subparsers) -> None:
    plan = subparsers.add_parser(
        "plan-service", help="per-device memory plan of a service config (nothing is allocated)",
        description="Read a service YAML and print, per pipeline stage, one device's weights, activations and "
                    "paged caches (DSA blocks, KDA slots, prefix snapshots), and one full-length sequence's cache.")
    plan.add_argument("config", help="service YAML, e.g. configs/service-example.yaml")
    plan.add_argument("--preset", default=None, choices=sorted(PRESETS),
                      help="model preset to plan (default: model.preset of the config, else k3-2.8t)")
    plan.set_defaults(func=cmd_plan_service)

    bench = subparsers.add_parser(
        "serve-bench", help="run a synthetic workload through the serving engine and report latencies",
        description="Poisson arrivals of mixed-length prompts (some with an image) through Engine; prints the "
                    "TTFT / TPOT / ITL / queue / e2e table and engine stats, writes an HTML report. A service file "
                    "with a disaggregation: section runs them (text only) through its prefill and decode instance "
                    "processes instead: latencies per role, each instance's steps and the transfers between them.")
    bench.add_argument("--config", required=True, help="service YAML that runs here, e.g. configs/service-cpu.yaml")
    bench.add_argument("--requests", type=int, default=24, help="number of requests (default: %(default)s)")
    bench.add_argument("--rate", type=float, default=4.0, help="arrivals per second (default: %(default)s)")
    bench.add_argument("--min-prompt", type=int, default=16, help="shortest prompt (default: %(default)s)")
    bench.add_argument("--max-prompt", type=int, default=512, help="longest prompt (default: %(default)s)")
    bench.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default: %(default)s)")
    bench.add_argument("--image-fraction", type=float, default=None,
                       help="share of prompts carrying an image (default: 0.25; 0 with a disaggregation: section)")
    bench.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    bench.add_argument("--threads", type=int, default=None,
                       help="torch threads, also of the forward process (default: from the cores available, 1 "
                            "when 2 or fewer: latentmoe_lab/threads.py); with a disaggregation: section, each "
                            "instance's (default: parallel.forward_threads)")
    bench.add_argument("--report", default="reports/serve.html", help="HTML report path (default: %(default)s)")
    bench.set_defaults(func=cmd_serve_bench)


def _say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cmd_plan_service(args: argparse.Namespace) -> int:
    from latentmoe_lab.config import ModelConfig
    from latentmoe_lab.serving.config import ServiceConfig
    from latentmoe_lab.serving.service_plan import service_plan_text

    service = ServiceConfig.from_yaml(args.config)
    preset = args.preset or service.model.preset or "k3-2.8t"
    config = ModelConfig.from_preset(preset)
    _say(f"planning {preset} on the meta device (no memory is allocated)")
    print(service_plan_text(service, config))
    return 0


def load_model(service):
    """The model a service config names: model.checkpoint (from_pretrained) or model.preset (random weights)."""
    import torch

    from latentmoe_lab.config import ModelConfig
    from latentmoe_lab.model import LatentMoEForCausalLM

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if service.model.dtype not in dtypes:
        raise ValueError(f"model.dtype: {service.model.dtype!r} is for planning; the engine runs "
                         f"{sorted(dtypes)} weights")
    if service.model.checkpoint:
        return LatentMoEForCausalLM.from_pretrained(service.model.checkpoint,
                                                    dtype=dtypes[service.model.dtype]).eval()
    if not service.model.preset:
        raise ValueError("model.preset: give model.preset or model.checkpoint to run the engine")
    torch.manual_seed(service.model.seed)
    model = LatentMoEForCausalLM(ModelConfig.from_preset(service.model.preset))
    return model.to(dtypes[service.model.dtype]).eval()


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


def cmd_serve_bench(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from latentmoe_lab.report import write_html_report
    from latentmoe_lab.serving.config import ServiceConfig
    from latentmoe_lab.serving.engine import Engine
    from latentmoe_lab.serving.metrics import format_table, summarize
    from latentmoe_lab.serving.workload import run_workload, synthetic_workload
    from latentmoe_lab.viz.serving import latency_histograms, timeline_figure

    service = ServiceConfig.from_yaml(args.config)
    check_bench_flags(args, service.model.max_model_len)
    if service.disaggregation.enabled:  # instance processes per role (docs/design.md §13.2)
        from latentmoe_lab.server.disagg_bench import serve_bench_disagg

        return serve_bench_disagg(args, _say)
    args.image_fraction = 0.25 if args.image_fraction is None else args.image_fraction
    from latentmoe_lab.threads import apply_threads

    threads = apply_threads(args.threads, echo=_say)
    if args.threads is not None and not service.parallel.forward_threads:  # the forward process's too
        service.parallel.forward_threads = threads
    _say(f"building {service.model.preset or service.model.checkpoint}")
    model = load_model(service)
    engine = Engine(model, service)
    _say(f"cache plan:\n{engine.plan.table()}")
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
