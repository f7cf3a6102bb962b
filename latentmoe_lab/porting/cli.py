"""`latentmoe-lab ops`: the operator inventory of a preset, built on the meta device (porting/inventory.py)."""
from __future__ import annotations

import argparse
import csv
import io
import json
import sys

HELP = "operator inventory of a preset: ATen and custom ops per layer type, FLOPs and bytes (meta device)"


def add_parser(subparsers) -> argparse.ArgumentParser:
    from latentmoe_lab.config import PRESETS

    parser = subparsers.add_parser(
        "ops", help=HELP,
        description="Build the preset on the meta device (nothing is allocated), run one forward with the fused "
                    "paths as torch.ops.latentmoe custom ops, and list every dispatched op per layer type with "
                    "count, shapes, dtypes, FLOPs and bytes, standard or custom work, against the closed-form "
                    "FLOPs per token (docs/design.md §16).")
    parser.add_argument("--preset", default="k3-2.8t", choices=sorted(PRESETS), help="model preset (default: k3-2.8t)")
    parser.add_argument("--phase", default="prefill", choices=("prefill", "decode"),
                        help="prefill: one sequence of --tokens new tokens; decode: --tokens sequences of one "
                             "new token each (default: prefill)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="new tokens (prefill, default 4096) or decoding sequences (decode, default 16)")
    parser.add_argument("--context", type=int, default=None,
                        help="tokens already cached per sequence (default: 0 for prefill, 65536 for decode)")
    parser.add_argument("--images", type=int, default=0,
                        help="prefill only: images of 448 x 448 (256 tokens each, among --tokens) through the "
                             "vision tower (default: 0)")
    parser.add_argument("--top", type=int, default=10, help="ops listed by FLOPs and by bytes (default: 10)")
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="print every row as JSON")
    form.add_argument("--csv", action="store_true", help="print every row as CSV")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from latentmoe_lab.config import ModelConfig
    from latentmoe_lab.porting.flops import expected_flops
    from latentmoe_lab.porting.inventory import operator_inventory
    from latentmoe_lab.porting.report import inventory_rows, inventory_summary

    if args.top < 0:  # a negative count would slice from the end: every op but the last few
        raise ValueError(f"--top: must be an integer >= 0 (ops listed per table), got {args.top}")
    tokens = args.tokens if args.tokens is not None else (4096 if args.phase == "prefill" else 16)
    context = args.context if args.context is not None else (0 if args.phase == "prefill" else 65536)
    config = ModelConfig.from_preset(args.preset)
    print(f"building {args.preset} on the meta device (no memory is allocated) ...", file=sys.stderr, flush=True)
    inventory = operator_inventory(config, args.phase, tokens, context, images=args.images)
    rows = inventory_rows(inventory)
    if args.json:
        print(json.dumps({"preset": args.preset, "phase": args.phase, "tokens": tokens, "context": context,
                          "flops_per_token": inventory.flops_per_token(),
                          "expected_flops_per_token": expected_flops(config, args.phase, tokens, context)["total"]
                          / tokens, "rows": rows}, indent=1))
    elif args.csv:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        print(out.getvalue(), end="")
    else:
        print(inventory_summary(inventory, config, top=args.top))
    return 0
