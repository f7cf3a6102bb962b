"""The trained model served by default: checkpoints/mini-stdlib, built by `make model`.

`make model` trains the mini preset on this interpreter's standard library with `latentmoe-lab train` (into
runs/mini-stdlib) and then exports it here:

    python -m latentmoe_lab.trained_model export runs/mini-stdlib checkpoints/mini-stdlib
    python -m latentmoe_lab.trained_model demo       # a greedy completion of a Python prompt, as make demo shows

The exported directory is a save_pretrained checkpoint in bf16 (weights, config.json, the Hugging Face tokenizer
files) plus the run's training report:

    training.json       the run's settings and its last held-out evaluation (what `describe` prints)
    trainer_state.json  the run's curves;  report.html  its plotly report

`configs/service-cpu.yaml` names the directory as `model.checkpoint_if_present`: `latentmoe-lab serve` serves it
when it exists and its random preset otherwise, and says which (`announce`, `no_checkpoint_line`).

The directory is built, not shipped: `make model` is deterministic (one seed, fixed processes and threads) and
always matches the model code of the checkout, where a committed file would go stale with the architecture and
grow the history by ~15 MB per retraining.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

DEFAULT_DIR = Path("checkpoints/mini-stdlib")
TRAINING_FILE = "training.json"
REPORT_FILES = ("trainer_state.json", "report.html")
DEMO_PROMPT = "import os\n\n\ndef "


def export(run_dir: str | Path, out_dir: str | Path = DEFAULT_DIR) -> Path:
    """A finished `latentmoe-lab train --out RUN_DIR` run -> out_dir (bf16 weights + its report). Returns out_dir."""
    from latentmoe_lab.checkpoint import save_checkpoint
    from latentmoe_lab.model import LatentMoEForCausalLM
    from latentmoe_lab.training.lm import CHECKPOINT_DIR

    run_dir = Path(run_dir)
    missing = [name for name in (*REPORT_FILES, f"{CHECKPOINT_DIR}/trainer.json") if not (run_dir / name).is_file()]
    if missing:
        raise ValueError(f"run_dir: {run_dir} is not a finished `latentmoe-lab train --out` run (missing {missing})")
    trainer = json.loads((run_dir / CHECKPOINT_DIR / "trainer.json").read_text())
    history = trainer["history"]
    if not history["eval"]:
        raise ValueError(f"run_dir: {run_dir} has no held-out evaluation; train with --eval-every <= --steps")
    step, loss, bits_per_byte = history["eval"][-1]
    training = {"corpus": trainer["settings"]["corpus_root"] or "the Python standard library",
                "settings": trainer["settings"], "steps_done": trainer["step"], "tokens_seen": history["tokens_seen"],
                "train_seconds": history["seconds"],
                "held_out": {"step": step, "loss_nats": loss, "bits_per_byte": bits_per_byte},
                "sample": history["sample"]}
    model = LatentMoEForCausalLM.from_pretrained(run_dir / CHECKPOINT_DIR, dtype=torch.bfloat16)
    out_dir = save_checkpoint(model, out_dir, extra_json={TRAINING_FILE: training})
    for name in REPORT_FILES:
        shutil.copyfile(run_dir / name, out_dir / name)
    return out_dir


def describe(directory: str | Path) -> str:
    """'trained 240 steps of the mini preset on ..., held-out 2.95 bits/byte' from training.json ('' without one)."""
    path = Path(directory) / TRAINING_FILE
    if not path.is_file():
        return ""
    training = json.loads(path.read_text())
    held_out = training["held_out"]
    return (f"trained {training['steps_done']} steps of the {training['settings']['preset']} preset on "
            f"{training['corpus']}, held-out {held_out['bits_per_byte']:.2f} bits/byte")


def announce(directory: str | Path) -> str:
    """The line a server or the demo prints about the checkpoint it runs."""
    details = describe(directory)
    return f"serving {directory}" + (f" ({details})" if details else "")


def no_checkpoint_line(directory: str | Path, preset: str) -> str:
    """The line printed when the trained checkpoint is absent and a random preset runs instead."""
    return f"no trained checkpoint at {directory}: random {preset} model; run make model"


def trained_or_none(directory: str | Path) -> Path | None:
    """directory when it holds a checkpoint (config.json), else None."""
    directory = Path(directory)
    return directory if (directory / "config.json").is_file() else None


def no_model_demo_line(directory: str | Path) -> str:
    """The demo's one line when no trained model exists: what to run to make one."""
    return (f"no trained model at {directory} yet: `make model` trains one (~6 min on 2 cores), "
            f"then `make demo` shows its completion of {DEMO_PROMPT!r}")


def demo(directory: str | Path = DEFAULT_DIR, new_tokens: int = 160) -> str:
    """A greedy completion of DEMO_PROMPT by the trained model, after a line naming it; without one, the one
    line of no_model_demo_line (a random model's completion is byte noise: nothing to show)."""
    from latentmoe_lab.model import LatentMoEForCausalLM
    from latentmoe_lab.training.lm import greedy_sample

    found = trained_or_none(directory)
    if found is None:
        return no_model_demo_line(directory)
    model = LatentMoEForCausalLM.from_pretrained(found, dtype=torch.float32)
    details = describe(found)
    line = f"greedy completion by {found}" + (f" ({details})" if details else "")
    return line + ":\n" + greedy_sample(model, new_tokens, DEMO_PROMPT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m latentmoe_lab.trained_model", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export_parser = commands.add_parser("export", help="a train run -> a bf16 checkpoint with its report")
    export_parser.add_argument("run_dir", help="the --out directory of a finished `latentmoe-lab train` run")
    export_parser.add_argument("out_dir", nargs="?", default=str(DEFAULT_DIR), help="(default: %(default)s)")
    demo_parser = commands.add_parser("demo", help="a greedy completion of a Python prompt")
    demo_parser.add_argument("--checkpoint", default=str(DEFAULT_DIR), help="(default: %(default)s)")
    demo_parser.add_argument("--new-tokens", type=int, default=160, help="greedy bytes (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            out_dir = export(args.run_dir, args.out_dir)
            print(f"wrote {out_dir}: {describe(out_dir)}")
        else:
            if args.new_tokens < 1:
                raise ValueError(f"--new-tokens: must be >= 1, got {args.new_tokens}")
            print(demo(args.checkpoint, args.new_tokens))
    except (ValueError, TypeError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
