"""Subcommands `plan-service` and `serve-bench` (registered in latentmoe_lab/cli.py through add_parser). Both read
a service file as `serve` does (its `server:` section checked too, server/settings.py); serve-bench runs one
engine here (serving/serve_bench.py) or, with a disaggregation: section, its instance processes
(server/disagg_bench.py). They live in server/ because serving/ never imports server/.

    latentmoe-lab plan-service configs/service-example.yaml        per-device memory plan, nothing allocated
    latentmoe-lab serve-bench --config configs/service-cpu.yaml    synthetic workload -> metrics + reports/serve.html
    latentmoe-lab serve-bench --config configs/service-cpu-pd.yaml the same through prefill + decode instance
                                                                   processes; the report shows their timelines
"""
from __future__ import annotations

import argparse

from latentmoe_lab.config import PRESETS


def add_parser(subparsers) -> None:
    plan = subparsers.add_parser(
        "plan-service", help="per-device memory plan of a service config (nothing is allocated)",
        description="Read a service YAML and print, per pipeline stage, one device's weights, activations and "
                    "paged caches (DSA blocks, KDA slots, prefix snapshots), and one full-length sequence's cache.")
    add_config_arguments(plan, "configs/service-example.yaml")
    plan.add_argument("--preset", default=None, choices=sorted(PRESETS),
                      help="model preset to plan instead of the model the file serves (default: the checkpoint or "
                           "preset `serve` would run, else k3-2.8t)")
    plan.set_defaults(func=cmd_plan_service)
    bench = subparsers.add_parser(
        "serve-bench", help="run a synthetic workload through the serving engine and report latencies",
        description="Poisson arrivals of mixed-length prompts (some with an image) through Engine; prints the "
                    "TTFT / TPOT / ITL / queue / e2e table and engine stats, writes an HTML report. A service file "
                    "with a disaggregation: section runs them (text only) through its prefill and decode instance "
                    "processes instead: latencies per role, each instance's steps and the transfers between them.")
    add_config_arguments(bench, "configs/service-cpu.yaml")
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



def add_config_arguments(parser, example: str) -> None:
    """The service file as `FILE` or `--config FILE` (plan-service and serve-bench alike), and --checkpoint."""
    parser.add_argument("file", nargs="?", default=None, metavar="FILE", help=f"service YAML, e.g. {example}")
    parser.add_argument("--config", default=None, metavar="FILE", help="the same, as `serve` takes it")
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="a save_pretrained directory instead of the file's model, as `serve --checkpoint`")


def service_path(args: argparse.Namespace) -> str:
    if (args.file is None) == (args.config is None):
        raise ValueError("--config: give the service file once, as FILE or as --config FILE")
    return args.file or args.config


def cmd_plan_service(args: argparse.Namespace) -> int:
    from latentmoe_lab.config import ModelConfig
    from latentmoe_lab.server.loading import resolve_service, served_model_config, source_line
    from latentmoe_lab.serving.serve_bench import say
    from latentmoe_lab.serving.service_plan import service_plan_text

    service = resolve_service(service_path(args), args.checkpoint)[0]  # what `serve` would run
    served = None if args.preset else served_model_config(service)
    config = served or ModelConfig.from_preset(args.preset or "k3-2.8t")
    say(f"{source_line(service) if served else 'planning preset ' + (args.preset or 'k3-2.8t')}; planned on the "
        "meta device (no memory is allocated)")
    for line in here_lines(service, config):
        print(line)
    print(service_plan_text(service, config))
    return 0


def here_lines(service, config) -> list[str]:
    """What `serve` holds on this machine, first: each engine's (each P/D role's) cache pools as planned from
    memory.cache_bytes; the device plan that follows is for planning a GPU deployment."""
    from latentmoe_lab.serving.disagg.section import role_config
    from latentmoe_lab.serving.config import serving_layout
    from latentmoe_lab.serving.planner import default_cache_budget, plan_cache
    from latentmoe_lab.serving.service_plan import cpu_budget_text

    roles = [("", service)] if not service.disaggregation.enabled else [
        (f"{role} instances ({getattr(service.disaggregation, role + '_instances')}): ", role_config(service, role))
        for role in ("prefill", "decode")]
    lines = []
    for label, role_service in roles:
        line = f"here: {label}{cpu_budget_text(config, role_service)}"
        if serving_layout(config, role_service.parallel) is None:  # one engine process: its pools as sized
            budget = role_service.memory.cache_bytes or default_cache_budget(config, role_service)[0]
            try:
                plan = plan_cache(config, role_service, budget)
            except ValueError as error:  # a file planned for a GPU only: say why it does not run here
                line += f"; not on this machine: {error}"
            else:
                sequences = plan.num_blocks * plan.block_size / role_service.model.max_model_len
                line += (f" -> {plan.num_blocks} blocks of {plan.block_size} tokens ({sequences:.2f} sequences of "
                         f"model.max_model_len), {plan.num_slots} KDA slots")
        lines.append(line)
    return lines + ["the plan below is per device of the GPU that memory.gpu_memory_utilization plans for "
                    "(planning only):"]


def cmd_serve_bench(args: argparse.Namespace) -> int:
    from latentmoe_lab.server.loading import resolve_service
    from latentmoe_lab.serving.serve_bench import check_bench_flags, say, serve_bench_colocated

    args.config, args.file = service_path(args), None  # one spelling from here on
    service = resolve_service(args.config, args.checkpoint)[0]  # the model `serve` would run
    check_bench_flags(args, service.model.max_model_len)
    if service.disaggregation.enabled:  # instance processes per role (docs/design.md §13.2)
        from latentmoe_lab.server.disagg_bench import serve_bench_disagg

        return serve_bench_disagg(args, say)
    from latentmoe_lab.server.loading import load_model

    return serve_bench_colocated(args, service, load_model)
