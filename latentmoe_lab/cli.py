"""`latentmoe-lab`: the command-line entry point.

    latentmoe-lab smoke                 tiny model: image + text prefill, decode, a compact report and an HTML report
    latentmoe-lab info --preset k3-2.8t parameter and byte table for a preset (built on the meta device)
    latentmoe-lab parallel --ep 2 --tp 2 --nproc 4   a parallel layout as local processes, checked against one
"""
from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import time
from collections.abc import Collection

from latentmoe_lab import __version__
from latentmoe_lab.config import PRESETS, ModelConfig
from latentmoe_lab.config_presets import FULL_SCALE

# Every subcommand, in the order `--help` lists them: the function that registers it (with the commands
# registered next to it) and its one-line help. The top-level `--help`, `--version` and a mistyped command
# are answered from this table alone, in well under a second; only the chosen command's module is imported
# (most pull in torch). tests/test_hardening_cli.py checks these helps against the modules' own.
COMMANDS = {
    "smoke": ("latentmoe_lab.cli:add_smoke_parser",
              "run a small preset end to end and report speed, load and cache bytes"),
    "info": ("latentmoe_lab.cli:add_info_parser", "parameter and byte table of a preset"),
    "parallel": ("latentmoe_lab.cli:add_parallel_parser", "run a parallel layout as local processes and check it"),
    "train": ("latentmoe_lab.training.cli:add_parser", "train a preset on the Python standard library (byte tokens)"),
    "align": ("latentmoe_lab.alignment.cli:add_parser",
              "compare a candidate (dtype, backend, parallel layout) with the reference, tap by tap"),
    "quantize": ("latentmoe_lab.quant.cli:add_parser",
                 "quantize a saved model by a recipe and report bytes and held-out bits per byte"),
    "serve": ("latentmoe_lab.server.cli:add_parser", "serve a model over an OpenAI-compatible HTTP API"),
    "soak": ("latentmoe_lab.server.cli:add_parser",
             "soak a server with mixed requests: RSS slope, drift, blocks == slots == 0 after drain"),
    "profile": ("latentmoe_lab.profiling.cli:add_parser",
                "chrome trace + HTML summary of one prefill/decode/train/engine step"),
    "plan-service": ("latentmoe_lab.server.service_cli:add_parser",
                     "per-device memory plan of a service config (nothing is allocated)"),
    "serve-bench": ("latentmoe_lab.server.service_cli:add_parser",
                    "run a synthetic workload through the serving engine and report latencies"),
    "verify": ("latentmoe_lab.verify.cli:add_parser",
               "check that a service file's engine reproduces the reference path on every state-moving path"),
    "ops": ("latentmoe_lab.porting.cli:add_parser",
            "operator inventory of a preset: ATen and custom ops per layer type, FLOPs and bytes (meta device)"),
    "convert": ("latentmoe_lab.cli:add_convert_parser",
                "convert a checkpoint between transformers' format (kimi_linear, deepseek_v32) and ours"),
    "export-notebook": ("latentmoe_lab.viz.export:add_parser",
                        "export executed notebooks to HTML pages that need no network"),
}


def _progress_printer():
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {message} ...", file=sys.stderr, flush=True)

    return progress


def cmd_smoke(args: argparse.Namespace) -> int:
    from latentmoe_lab.report import check_report_path, write_html_report
    from latentmoe_lab.smoke import report_sections, run_smoke

    check_report_path(args.report, "--report")  # before the run, not after it
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


def add_smoke_parser(sub) -> None:
    from latentmoe_lab.smoke import DEFAULT_PROMPT

    smoke = sub.add_parser("smoke", help=COMMANDS["smoke"][1],
                           description="Build a preset with random weights, prefill a mixed image + text prompt, "
                                       "decode greedily, and print parameters, tokens/s, per-layer expert load "
                                       "(also split by text and image tokens) and cache bytes. Also writes a "
                                       "self-contained HTML report with plotly charts.")
    smoke.add_argument("--preset", default="tiny", choices=[p for p in sorted(PRESETS) if p not in FULL_SCALE],
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


def add_info_parser(sub) -> None:
    info = sub.add_parser("info", help=COMMANDS["info"][1],
                          description="Count total and active-per-token parameters by component, and weight "
                                      "bytes per format, by building the preset on the meta device.")
    info.add_argument("--preset", default="k3-2.8t", choices=sorted(PRESETS), help="model preset (default: k3-2.8t)")
    info.add_argument("--json", action="store_true", help="print the counts as JSON")
    info.set_defaults(func=cmd_info)


def add_parallel_parser(sub) -> None:
    from latentmoe_lab.parallel.runs import add_layout_arguments

    par = sub.add_parser("parallel", help=COMMANDS["parallel"][1],
                         description="Launch --nproc local processes (accelerate notebook_launcher, gloo on CPU), "
                                     "shard a small preset with the layout, and compare logits and greedy tokens "
                                     "with one process, and the collectives' bytes with the planner.")
    add_layout_arguments(par)
    par.add_argument("--nproc", type=int, default=None, help="processes; must equal ep*tp*pp*dp*cp (default)")
    par.set_defaults(func=cmd_parallel)


def cmd_convert(args: argparse.Namespace) -> int:
    from latentmoe_lab.interop.convert import convert
    from latentmoe_lab.model import LatentMoEForCausalLM

    out = convert(LatentMoEForCausalLM, args.source, args.out, to=args.to, model_type=args.model_type,
                  max_shard_size=args.max_shard_size)
    print(f"wrote {out}")
    return 0


def add_convert_parser(sub) -> None:
    conv = sub.add_parser("convert", help=COMMANDS["convert"][1],
                          description="Load SRC (a transformers kimi_linear / deepseek_v32 directory, or ours) and "
                                      "write it to --out as ours (--to latentmoe) or as a transformers directory "
                                      "(--to hf). What the target cannot express is refused before writing.")
    conv.add_argument("source", metavar="SRC", help="checkpoint directory to read")
    conv.add_argument("--out", required=True, help="directory to write")
    conv.add_argument("--to", default="latentmoe", choices=["latentmoe", "hf"], help="target format (default: %(default)s)")
    conv.add_argument("--model-type", default=None, help="with --to hf: kimi_linear or deepseek_v32 (default: the "
                                                         "source's own, else by its layers)")
    conv.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (default: %(default)s)")
    conv.set_defaults(func=cmd_convert)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, with a bad flag reported in one line (`PROG: error: ...`, exit status 2) instead of the whole
    usage block first; the subcommand parsers are of this class too (add_subparsers uses the parent's)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser(full: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The parser with the commands in `full` complete (all of them when None), the rest by name and help only."""
    parser = OneLineErrorParser(
        prog="latentmoe-lab",
        description="LatentMoE Lab: a readable reproduction of a 2.8T hybrid-attention sparse MoE "
                    "(Stable LatentMoE experts, 3 KDA : 1 Gated DSA attention).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help="on an error, show the full traceback")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    registrars = {COMMANDS[name][0] for name in (COMMANDS if full is None else full) if name in COMMANDS}
    for name, (registrar, help_line) in COMMANDS.items():
        if name in sub.choices:
            continue  # registered along with an earlier command of the same module
        if registrar in registrars:
            module, function = registrar.split(":")
            getattr(importlib.import_module(module), function)(sub)
        else:
            sub.add_parser(name, help=help_line)
    _accept_debug_everywhere(sub)  # keep last: it reaches every subcommand registered above
    return parser


def _chosen_command(argv: list[str]) -> str | None:
    """The subcommand of argv: its first word that is not an option (the top-level options take no values)."""
    return next((word for word in argv if not word.startswith("-")), None)


def _accept_debug_everywhere(subcommands) -> None:
    """Let `--debug` also follow the subcommand (`latentmoe-lab parallel --ep 3 --debug`), for every subcommand."""
    for command in subcommands.choices.values():
        try:
            command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                 help="on an error, show the full traceback")
        except argparse.ArgumentError:
            pass  # the subcommand declares its own --debug


# Out-of-memory errors that torch raises as RuntimeError: a size given by the user is larger than this machine.
_OUT_OF_MEMORY = re.compile(r"can't allocate memory|not enough memory|out of memory|size calculation overflowed",
                            re.IGNORECASE)


def user_error_message(error: BaseException) -> str | None:
    """One line for an error a user's flag, config or file caused; None for a bug (whose traceback is shown).

    Bad values raise ValueError / TypeError (OverflowError for a number too large for C), a path that is
    missing, a directory, unreadable or a device raises an OSError (named with its path), and a size
    too large for the machine raises MemoryError or torch's allocator RuntimeError.
    """
    if isinstance(error, OSError) and error.filename is not None:
        message = f"{error.filename}: {error.strerror or error}"
    elif isinstance(error, (ValueError, TypeError, OverflowError, OSError)):
        message = str(error) or type(error).__name__
    elif isinstance(error, MemoryError) or (isinstance(error, RuntimeError) and (
            type(error).__name__ == "OutOfMemoryError" or _OUT_OF_MEMORY.search(str(error)))):
        detail = str(error).split("DefaultCPUAllocator: ")[-1] or "MemoryError"
        message = f"out of memory ({detail}): a size in the flags, config or checkpoint is too large for this machine"
    elif isinstance(error, RecursionError):
        message = f"input nested too deeply ({error})"
    else:
        return None
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser([_chosen_command(argv)])
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except Exception as error:  # user errors become one line; anything else is a bug: re-raised
        message = user_error_message(error)
        # a failed parallel run: RankFailure already names each rank and what it was doing (exit status 1)
        launch = sys.modules.get("latentmoe_lab.parallel.launch")
        failed_run = launch is not None and isinstance(error, launch.RankFailure)
        if (message is None and not failed_run) or args.debug:
            raise
        print(f"{parser.prog} {args.command}: error: {message or error}", file=sys.stderr)
        return 2 if message is not None else 1


if __name__ == "__main__":
    sys.exit(main())
