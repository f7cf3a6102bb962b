"""Shared plumbing for the CPU benchmark scripts: the --quick/--threads flags and the JSON result file.

The scripts run as `python benchmarks/<name>.py`, which puts this folder on sys.path, so they import
it as `from common import ...`.
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

QUICK_HELP = "a few small sizes and repeats: checks the harness, not the numbers"


def make_parser(doc: str, default_threads: int | None, quick_help: str = QUICK_HELP,
                full_doc: bool = False) -> argparse.ArgumentParser:
    """A parser with --quick and --threads; the script adds its own flags.

    The description is the first line of doc, or all of it, unwrapped, with full_doc=True.
    """
    if full_doc:
        parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    else:
        parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    if default_threads is None:
        threads_help = "torch threads (default: torch's own)"
    else:
        threads_help = (f"torch threads (default {default_threads}: on the shared 2-core machine two OpenMP "
                        "threads stall on every small op whenever the other core is busy)")
    parser.add_argument("--threads", type=int, default=default_threads, help=threads_help)
    return parser


def apply_threads(args: argparse.Namespace) -> None:
    """Set torch's thread count from --threads, if given."""
    if args.threads:
        torch.set_num_threads(args.threads)


def machine_info(**extra) -> dict:
    """Platform, torch threads and torch version, then any extra fields."""
    return dict(platform=platform.platform(), threads=torch.get_num_threads(), torch=torch.__version__, **extra)


def write_json(script_file: str, result: dict, out: Path | None = None) -> Path:
    """Write result as indented JSON to out, by default next to the script (bench_x.py -> bench_x.json)."""
    out = Path(script_file).with_suffix(".json") if out is None else out
    out.write_text(json.dumps(result, indent=2))
    return out
