"""`latentmoe-lab align`: one candidate against the reference, tap by tap (docs/design.md §8).

    latentmoe-lab align --checkpoint DIR --candidate bf16      a saved model (save_pretrained) in bf16
    latentmoe-lab align --preset tiny --candidate ep2          a seeded random model, EP2 in 2 processes
    latentmoe-lab align --candidate int8-w8a8 --bisect         a quantization recipe, and which layer hurts most
    latentmoe-lab align --candidate triton                     Triton kernels (interpreter on CPU)

Writes reports/align-<candidate>.html (table, first divergence, figure) and prints the summary. Exit status 1
when the candidate's forward stopped part way (a NaN, an error): the report then holds the taps it reached.
Inputs: --text FILE (held-out text, byte tokens, cut into --batch rows of --seq-len) or seeded random ids.
Quantization recipes that calibrate (static, SmoothQuant) see seeded random ids, never the compared inputs.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

LAYOUTS = ("ep2", "tp2", "pp2")
ENGINES = {"engine": "auto", "fp8-kv": "fp8"}  # candidate -> the engine's memory.kv_cache_dtype
ENGINE_CHUNK = 16  # prefill chunk of the engine candidates: a 64-token prompt runs as 4 chunks
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def add_parser(subparsers) -> argparse.ArgumentParser:
    from latentmoe_lab.config import PRESETS
    from latentmoe_lab.config_presets import FULL_SCALE
    from latentmoe_lab.quant.recipes import RECIPES

    from latentmoe_lab.porting.op_table import PROFILES

    candidates = (*_DTYPES, "triton", *LAYOUTS, *ENGINES, *RECIPES, *(f"sim-{p}" for p in PROFILES))
    parser = subparsers.add_parser(
        "align", help="compare a candidate (dtype, backend, parallel layout) with the reference, tap by tap",
        description="Run the reference model and a candidate built from it on the same tokens, record every "
                    "tap (embeddings, attention / FFN / residual per block, router logits and choices, final norm, "
                    "logits), print the first tap past a threshold and write an HTML report.")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", metavar="DIR", default=None,
                        help="a save_pretrained directory (default: a seeded random --preset model)")
    source.add_argument("--preset", default="tiny", choices=[p for p in sorted(PRESETS) if p not in FULL_SCALE],
                        help="preset of the random reference model (default: tiny)")
    parser.add_argument("--candidate", required=True, choices=candidates, metavar="CANDIDATE",
                        help=f"what to compare: {', '.join(candidates)}")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random model and ids (default: 0)")
    parser.add_argument("--text", metavar="FILE", default=None, help="held-out text for the inputs (UTF-8)")
    parser.add_argument("--batch", type=int, default=2, help="input rows (default: 2)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per row (default: 64)")
    parser.add_argument("--stride", type=int, default=1, help="taps keep every stride-th token (default: 1)")
    parser.add_argument("--max-tokens", type=int, default=None, help="taps keep at most this many tokens per row")
    parser.add_argument("--threshold", action="append", default=[], metavar="METRIC=VALUE",
                        help="override a threshold, e.g. rel_l2=0.1 (repeatable)")
    parser.add_argument("--bisect", action="store_true",
                        help="also swap single layers to find the one behind the final error (module candidates)")
    parser.add_argument("--report", default=None, help="HTML path (default: reports/align-<candidate>.html)")
    parser.set_defaults(func=run_align)
    return parser


def _thresholds(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--threshold: expected METRIC=NUMBER, got {item!r}")
    return out


def _reference(args):
    from latentmoe_lab.config import ModelConfig
    from latentmoe_lab.model import LatentMoEForCausalLM

    if args.checkpoint is not None:
        return LatentMoEForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    torch.manual_seed(args.seed)
    return LatentMoEForCausalLM(ModelConfig.from_preset(args.preset)).eval()


def _check_flags(args) -> None:
    """Every flag that can be checked without the model, before it is loaded."""
    from latentmoe_lab.alignment.compare import _resolve_thresholds
    from latentmoe_lab.report import check_report_path

    if args.batch < 1 or args.seq_len < 1:
        raise ValueError(f"--batch, --seq-len: must be >= 1, got {args.batch} and {args.seq_len}")
    if args.text is not None and not Path(args.text).is_file():
        raise ValueError(f"--text: {args.text} is not a file")
    if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
        raise ValueError(f"--checkpoint: {args.checkpoint} is not a directory")
    if args.stride < 1 or (args.max_tokens is not None and args.max_tokens < 1):
        raise ValueError(f"--stride, --max-tokens: must be >= 1, got {args.stride} and {args.max_tokens}")
    try:
        _resolve_thresholds(_thresholds(args.threshold))
    except ValueError as error:
        raise ValueError(str(error).replace("thresholds: ", "--threshold: ", 1)) from None
    check_report_path(_report_path(args), "--report")


def _report_path(args) -> str:
    return args.report if args.report is not None else f"reports/align-{args.candidate}.html"


def _inputs(args, vocab_size: int) -> torch.Tensor:
    need = args.batch * args.seq_len
    if args.text is None:
        return torch.randint(0, vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(args.seed))
    data = Path(args.text).read_bytes()
    if len(data) < need:
        raise ValueError(f"--text: {args.text} holds {len(data)} bytes, --batch x --seq-len needs {need}")
    return torch.tensor(list(data[:need]), dtype=torch.int64).reshape(args.batch, args.seq_len)


def _prepare_triton() -> None:
    """On CPU the kernels run in triton's interpreter, which must be chosen before triton is imported."""
    if torch.cuda.is_available():
        return
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--candidate triton: triton was imported without TRITON_INTERPRET=1; "
                         "run `TRITON_INTERPRET=1 latentmoe-lab align --candidate triton`")
    os.environ["TRITON_INTERPRET"] = "1"


def build_candidate(name: str, reference, calibration: torch.Tensor):
    """The candidate called `name`; calibration [B, T]: the ids a calibrating recipe may look at."""
    from latentmoe_lab.alignment.candidates import (BackendCandidate, EngineCandidate, ParallelCandidate,
                                                    cast_candidate, quantized_candidate)
    from latentmoe_lab.parallel.config import ParallelConfig

    if name in _DTYPES:
        return cast_candidate(reference, _DTYPES[name])
    if name.startswith("sim-"):  # the simulated accelerator with a numerics profile (docs/design.md §16)
        from latentmoe_lab.porting.sim_device import SimDeviceCandidate

        return SimDeviceCandidate(reference, name.removeprefix("sim-"))
    if name == "triton":
        _prepare_triton()
        return BackendCandidate(reference, "triton")
    if name in LAYOUTS:
        return ParallelCandidate(reference, ParallelConfig.from_layout(name.upper()))
    if name in ENGINES:
        from latentmoe_lab.serving import ServiceConfig

        service = ServiceConfig.from_dict({
            "model": {"max_model_len": calibration.shape[1] + 1},
            "memory": {"kv_cache_dtype": ENGINES[name], "cache_bytes": 32 << 20, "max_num_seqs": 1, "block_size": 16},
            "scheduler": {"prefill_chunk_size": ENGINE_CHUNK}})
        return EngineCandidate(reference, service, name)
    return quantized_candidate(reference, name, batches=[calibration])


def run_align(args: argparse.Namespace) -> int:
    from latentmoe_lab.alignment.bisect import bisect_layers
    from latentmoe_lab.alignment.candidates import BackendCandidate
    from latentmoe_lab.alignment.compare import compare
    from latentmoe_lab.alignment.taps import TokenSubset

    _check_flags(args)
    thresholds = _thresholds(args.threshold)
    model = _reference(args)
    device = torch.device("cuda" if args.candidate == "triton" and torch.cuda.is_available() else "cpu")
    model = model.to(device)
    ids = _inputs(args, model.config.vocab_size).to(device)
    calibration = torch.randint(0, model.config.vocab_size, tuple(ids.shape),
                                generator=torch.Generator().manual_seed(args.seed + 1)).to(device)
    candidate = build_candidate(args.candidate, model, calibration)
    # the reference always runs the PyTorch ops, also on CUDA where "auto" would pick the kernels
    report = compare(BackendCandidate(model, "torch"), candidate, ids, thresholds,
                     TokenSubset(args.stride, args.max_tokens), name=args.candidate)
    print(report.summary())
    extra = []
    if args.bisect:
        if not isinstance(candidate, torch.nn.Module) or isinstance(candidate, BackendCandidate):
            raise ValueError(f"--bisect: needs a candidate with its own weights (a dtype or a recipe), "
                             f"not {args.candidate}")
        extra.append(bisect_layers(model, candidate, ids).table())
        print(extra[0])
    path = report.to_html(_report_path(args), extra)
    print(f"HTML report: {path}")
    if report.candidate_error is not None:  # taps compared up to the stop are in the report; the run failed
        print(f"latentmoe-lab align: the candidate {args.candidate} stopped before the logits: "
              f"{report.candidate_error}", file=sys.stderr)
        return 1
    return 0
