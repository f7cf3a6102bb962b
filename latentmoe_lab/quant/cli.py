"""`latentmoe-lab quantize`: a saved model -> a quantized checkpoint, with what it saved and what it cost.

    latentmoe-lab quantize --checkpoint DIR --recipe fp8-experts --out DIR2

Prints the byte table (before / after, by component; the after total checked against meta.recipe_bytes) and
held-out bits per byte before and after, on rows of the training corpus's held-out split
(latentmoe_lab.training.corpus: files chosen by name hash). Static recipes calibrate on other held-out rows
than the ones evaluated. Writes DIR2 with quant/checkpoint.py (packed tensors, scales, recipe in config.json).
"""
from __future__ import annotations

import argparse
import copy

import torch

from latentmoe_lab.quant.recipes import RECIPES


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "quantize", help="quantize a saved model by a recipe and report bytes and held-out bits per byte",
        description="Load a save_pretrained directory, quantize it (docs/design.md §7), save the packed checkpoint, "
                    "and print the byte table and held-out bits per byte before and after.")
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="a save_pretrained directory")
    parser.add_argument("--recipe", required=True, choices=sorted(RECIPES), help="quantization recipe")
    parser.add_argument("--out", required=True, metavar="DIR2", help="where the quantized checkpoint goes")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per held-out row (default: 256)")
    parser.add_argument("--eval-rows", type=int, default=32, help="held-out rows evaluated (default: 32)")
    parser.add_argument("--calib-rows", type=int, default=16,
                        help="held-out rows for calibration / SmoothQuant, disjoint from the evaluated ones "
                             "(default: 16)")
    parser.add_argument("--corpus-root", default=None, metavar="DIR",
                        help="directory of *.py files for the corpus (default: this interpreter's stdlib)")
    parser.add_argument("--held-out-fraction", type=float, default=0.02,
                        help="share of files in the held-out split, as in training (default: 0.02)")
    parser.set_defaults(func=run_quantize)
    return parser


def held_out_rows(args) -> tuple[torch.Tensor, torch.Tensor]:
    """(evaluation rows [E, T], calibration rows [C, T]) from the corpus's held-out split, disjoint."""
    from latentmoe_lab.training.corpus import load_corpus, pack

    for name in ("seq_len", "eval_rows", "calib_rows"):
        if getattr(args, name) < (2 if name == "seq_len" else 1):
            raise ValueError(f"--{name.replace('_', '-')}: must be >= {2 if name == 'seq_len' else 1}")
    rows = pack(load_corpus(args.corpus_root, args.held_out_fraction).held_out, args.seq_len)
    if rows.shape[0] < args.eval_rows + args.calib_rows:
        raise ValueError(f"--eval-rows, --calib-rows: the held-out split has {rows.shape[0]} rows of "
                         f"{args.seq_len} tokens, fewer than {args.eval_rows + args.calib_rows}")
    evaluated = torch.linspace(0, rows.shape[0] - 1, args.eval_rows).round().long()  # spread over the files
    rest = torch.ones(rows.shape[0], dtype=torch.bool)
    rest[evaluated] = False
    rest = rest.nonzero().flatten()
    calibration = rest[torch.linspace(0, rest.numel() - 1, args.calib_rows).round().long()]
    return rows[evaluated], rows[calibration]


def run_quantize(args: argparse.Namespace) -> int:
    from latentmoe_lab.checkpoint_checks import CONFIG_NAME, checked_files, resolve_checkpoint_dir
    from latentmoe_lab.checkpoint_dir import check_output_dir
    from latentmoe_lab.checkpoint_integrity import read_json_file
    from latentmoe_lab.meta import format_bytes, recipe_bytes
    from latentmoe_lab.model import LatentMoEForCausalLM
    from latentmoe_lab.quant.checkpoint import QUANT_KEY, save_quantized
    from latentmoe_lab.quant.quantize import quantize_model
    from latentmoe_lab.quant.report import bits_per_byte, byte_table, held_bytes_by_component, top1_agreement

    # paths first: a missing or damaged checkpoint or a forbidden --out must fail before the corpus and model
    # load (the files' headers here; their checksums when the model loads, so the data is read once)
    source = resolve_checkpoint_dir(args.checkpoint, name="--checkpoint")
    check_output_dir(args.out, sources=(args.checkpoint, source), name="--out")
    checked_files(source)
    if QUANT_KEY in read_json_file(source / CONFIG_NAME):
        raise ValueError(f"--checkpoint: {args.checkpoint} is already quantized ({QUANT_KEY} in its {CONFIG_NAME}); "
                         f"quantize the plain checkpoint it came from")
    eval_rows, calib_rows = held_out_rows(args)
    model = LatentMoEForCausalLM.from_pretrained(source).eval()
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[model.embed_tokens.weight.dtype]
    before = held_bytes_by_component(model)
    bpb_before = bits_per_byte(model, eval_rows)
    reference = copy.deepcopy(model)
    recipe = RECIPES[args.recipe]
    calibrate = recipe.activations == "static" or recipe.smooth_alpha is not None
    quantize_model(model, recipe, batches=calib_rows.long().split(8) if calibrate else None)
    after = held_bytes_by_component(model)
    formula = recipe_bytes(model.config, recipe, dtype)["total"]
    if after["total"] != formula:
        raise RuntimeError(f"bytes held {after['total']} != meta.recipe_bytes {formula}: an accounting bug")
    bpb_after = bits_per_byte(model, eval_rows)
    agreement = top1_agreement(reference, model, eval_rows)
    save_quantized(model, args.out)

    print(f"recipe {recipe.name}: weights {recipe.weights or 'none'}, activations {recipe.activations or 'none'}"
          + (f" ({recipe.act_dtype}, {recipe.calibration})" if recipe.activations == "static" else ""))
    print(byte_table(before, after))
    print(f"bytes after == meta.recipe_bytes ({format_bytes(formula)}, exactly {formula:,} B)")
    print(f"held-out bits per byte ({eval_rows.shape[0]} rows x {eval_rows.shape[1]} bytes): "
          f"before {bpb_before:.4f}, after {bpb_after:.4f} ({bpb_after - bpb_before:+.4f}); "
          f"top-1 agreement {agreement:.4f}")
    print(f"quantized checkpoint: {args.out}")
    return 0
