"""`latentmoe-lab verify`: is the engine a service file describes exact? (docs/design.md §19)

    latentmoe-lab verify --config configs/service-cpu.yaml
    latentmoe-lab verify --config my-service.yaml --model path/to/checkpoint --prompts 12 --json verify.json
    latentmoe-lab verify --config configs/service-cpu.yaml --inject zero-kda-state      (must exit 1)

Builds the engine the file describes (its layout, workers, speculation, cache tiers, EPLB; P/D instances as
two in-process engines on the role configs), sends the workload of workload.py and compares every request's
tokens and per-token logprobs with the reference path (reference.py). Exit 0: every path equal within the
file's numeric mode; 1: a divergence (named: request, token, path, first divergent layer); 2: a bad flag or a
file `serve` would refuse too. Nothing is written but the --json file and the spill tiers the file names.
"""
from __future__ import annotations

import argparse
import sys

MAX_PROMPTS = 64


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "verify", help="check that a service file's engine reproduces the reference path on every state-moving path",
        description="Drive the engine a service file describes through a workload that walks every path that moves "
                    "or reuses state (chunking, preemption, prefix hits, speculation, P/D, cache tiers, EPLB, "
                    "workers), compare tokens and logprobs with model.generate and full forwards, print a table "
                    "per path. Exit 0 when all are equal, 1 naming the first divergence.")
    p.add_argument("--config", required=True, help="service YAML, e.g. configs/service-cpu.yaml")
    p.add_argument("--model", default=None, help="a checkpoint directory from_pretrained loads (ours or a "
                   "transformers one); default: the file's model section")
    p.add_argument("--prompts", type=int, default=6, help=f"cold prompts (4..{MAX_PROMPTS}); the workload sends "
                   "each cold prompt, a warm variant and a revisit (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    p.add_argument("--inject", default=None, metavar="NAME", help="plant a corruption verify must catch: "
                   "zero-kda-state, attention-only-hit, drop-conv-tail, shift-snapshot, stale-spec-slot")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the table as JSON to PATH")
    p.set_defaults(func=cmd_verify)


def check_flags(args: argparse.Namespace) -> None:
    """Flags named as typed, refused before anything is built."""
    if not 4 <= args.prompts <= MAX_PROMPTS:
        raise ValueError(f"--prompts: must be an integer in [4, {MAX_PROMPTS}], got {args.prompts}")
    if not 1 <= args.max_tokens <= 64:
        raise ValueError(f"--max-tokens: must be an integer in [1, 64], got {args.max_tokens}")
    if args.seed < 0:
        raise ValueError(f"--seed: must be >= 0, got {args.seed}")
    from latentmoe_lab.verify.inject import INJECTIONS

    if args.inject is not None and args.inject not in INJECTIONS:
        raise ValueError(f"--inject: unknown injection {args.inject!r}; choose one of {', '.join(INJECTIONS)}")
    if args.json is not None:
        from latentmoe_lab.report import check_report_path

        check_report_path(args.json, "--json")


def cmd_verify(args: argparse.Namespace) -> int:
    check_flags(args)
    from pathlib import Path

    from latentmoe_lab.verify.run import verify_service

    report = verify_service(args.config, model_dir=args.model, num_prompts=args.prompts,
                            max_tokens=args.max_tokens, seed=args.seed, inject=args.inject)
    print(report.table())
    if args.json is not None:
        Path(args.json).write_text(report.to_json())
        print(f"JSON: {args.json}", file=sys.stderr)
    return 0 if report.passed else 1
