"""`latentmoe-lab`: the command-line entry point.

    latentmoe-lab smoke                 tiny model: image + text prefill, decode, a compact report and an HTML report
    latentmoe-lab info --preset k3-2.8t parameter and byte table for a preset (built on the meta device)
    latentmoe-lab parallel --ep 2 --tp 2 --nproc 4   a parallel layout as local processes, checked against one
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from latentmoe_lab import __version__
from latentmoe_lab.config import PRESETS, ModelConfig

# What a bad flag, config or file raises anywhere below a subcommand: printed as one line, exit status 2
# (as argparse does for bad syntax). `--debug` shows the traceback instead.
USER_ERRORS = (ValueError, TypeError, FileNotFoundError)


def _progress_printer():
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {message} ...", file=sys.stderr, flush=True)

    return progress


def cmd_smoke(args: argparse.Namespace) -> int:
    from latentmoe_lab.report import write_html_report
    from latentmoe_lab.smoke import report_sections, run_smoke

    progress = _progress_printer()
    report = run_smoke(args.preset, args.prompt, args.new_tokens, args.seed, progress=progress, image=args.image,
                       threads=args.threads, repeats=args.repeats)
    progress("writing the HTML report")
    path = write_html_report(args.report, f"LatentMoE Lab smoke run ({args.preset})", report_sections(report))
    print(report.summary())
    print(f"HTML report: {path}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from latentmoe_lab.meta import count_parameters, parameter_table

    config = ModelConfig.from_preset(args.preset)
    _progress_printer()(f"building {args.preset} on the meta device (no memory is allocated)")
    if args.json:
        print(json.dumps(count_parameters(config), indent=2))
    else:
        print(f"preset {args.preset}: {config.num_layers} layers "
              f"({config.num_kda_layers} KDA, {config.num_dsa_layers} Gated DSA), hidden {config.hidden_size}, "
              f"{config.moe.num_experts} experts top-{config.moe.top_k}, latent {config.moe.latent_size}")
        print(parameter_table(config))
    return 0


def cmd_parallel(args: argparse.Namespace) -> int:
    from latentmoe_lab.parallel.runs import check_run, layout_from_args, layout_summary, report_ok, run_layouts

    pconfig, settings = layout_from_args(args)
    if args.nproc is not None and args.nproc != pconfig.world_size:
        raise ValueError(f"--nproc: layout {pconfig.name()} needs ep*tp*pp*dp*cp = {pconfig.world_size} "
                         f"processes, got {args.nproc}")
    check_run([pconfig], settings, pconfig.world_size)  # every flag, before anything is launched or printed
    _progress_printer()(f"launching {pconfig.world_size} processes for {pconfig.name()}")
    report = run_layouts([pconfig], settings)[0]
    print(layout_summary(report))
    return 0 if report_ok(report) else 1


def build_parser() -> argparse.ArgumentParser:
    from latentmoe_lab.parallel.runs import add_layout_arguments
    from latentmoe_lab.smoke import DEFAULT_PROMPT

    parser = argparse.ArgumentParser(
        prog="latentmoe-lab",
        description="LatentMoE Lab: a readable reproduction of a 2.8T hybrid-attention sparse MoE "
                    "(Stable LatentMoE experts, 3 KDA : 1 Gated DSA attention).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help="on an error, show the full traceback")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    presets = sorted(PRESETS)

    smoke = sub.add_parser("smoke", help="run a small preset end to end and report speed, load and cache bytes",
                           description="Build a preset with random weights, prefill a mixed image + text prompt, "
                                       "decode greedily, and print parameters, tokens/s, per-layer expert load "
                                       "(also split by text and image tokens) and cache bytes. Also writes a "
                                       "self-contained HTML report with plotly charts.")
    smoke.add_argument("--preset", default="tiny", choices=[p for p in presets if p != "k3-2.8t"],
                       help="model preset (default: tiny)")
    smoke.add_argument("--prompt", default=DEFAULT_PROMPT,
                       help="prompt text (byte-level tokens); the image goes at an '<image>' marker, else first")
    smoke.add_argument("--image", default=None, metavar="PATH",
                       help="image file for the prompt (default: a procedurally drawn 112x112 shape)")
    smoke.add_argument("--new-tokens", type=int, default=16, help="tokens to decode (default: 16)")
    smoke.add_argument("--seed", type=int, default=0, help="seed for the random weights (default: 0)")
    smoke.add_argument("--threads", type=int, default=1, help="torch threads while timing (default: 1)")
    smoke.add_argument("--repeats", type=int, default=5,
                       help="timed passes after one warm-up; tokens/s is their median (default: 5)")
    smoke.add_argument("--report", default="reports/smoke.html", help="HTML report path (default: %(default)s)")
    smoke.set_defaults(func=cmd_smoke)

    info = sub.add_parser("info", help="parameter and byte table of a preset",
                          description="Count total and active-per-token parameters by component, and weight "
                                      "bytes per format, by building the preset on the meta device.")
    info.add_argument("--preset", default="k3-2.8t", choices=presets, help="model preset (default: k3-2.8t)")
    info.add_argument("--json", action="store_true", help="print the counts as JSON")
    info.set_defaults(func=cmd_info)

    par = sub.add_parser("parallel", help="run a parallel layout as local processes and check it",
                         description="Launch --nproc local processes (accelerate notebook_launcher, gloo on CPU), "
                                     "shard a small preset with the layout, and compare logits and greedy tokens "
                                     "with one process, and the collectives' bytes with the planner.")
    add_layout_arguments(par)
    par.add_argument("--nproc", type=int, default=None, help="processes; must equal ep*tp*pp*dp*cp (default)")
    par.set_defaults(func=cmd_parallel)
    from latentmoe_lab.training.cli import add_parser as add_train_parser
    add_train_parser(sub)
    from latentmoe_lab.alignment.cli import add_parser as add_align_parser
    add_align_parser(sub)
    from latentmoe_lab.quant.cli import add_parser as add_quantize_parser
    add_quantize_parser(sub)
    from latentmoe_lab.server.cli import add_parser as add_server_parser
    add_server_parser(sub)
    from latentmoe_lab.profiling.cli import add_parser as add_profile_parser
    add_profile_parser(sub)
    from latentmoe_lab.serving.cli import add_parser as add_serving_parser
    add_serving_parser(sub)
    _accept_debug_everywhere(sub)  # keep last: it reaches every subcommand registered above
    return parser


def _accept_debug_everywhere(subcommands) -> None:
    """Let `--debug` also follow the subcommand (`latentmoe-lab parallel --ep 3 --debug`), for every subcommand."""
    for command in subcommands.choices.values():
        try:
            command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                 help="on an error, show the full traceback")
        except argparse.ArgumentError:
            pass  # the subcommand declares its own --debug


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as error:
        if args.debug:
            raise
        print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
