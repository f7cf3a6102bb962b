"""`latentmoe-lab train`: the language-model run of training/lm.py from the command line."""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

from latentmoe_lab.threads import choose_threads
from latentmoe_lab.training.lm import CHECKPOINT_DIR, PRESET_DEFAULTS, TrainSettings, train
from latentmoe_lab.training.resume import prepare_resume, read_trainer_json

# Flags whose unset value is taken from trainer.json's settings on --resume (the run's own values), and
# their defaults for a fresh run; steps, batch, seq_len, lr and warmup default per preset. Left out, as
# they belong to this session rather than to the run: --stop-at, --out, --nproc, --threads, the layout.
FRESH_DEFAULTS = dict(preset="mini", eval_every=100, eval_rows=64, save_every=0, seed=0, corpus_root=None,
                      held_out_fraction=0.02, sample_tokens=200, guard=True, mtp_depth=0, mtp_weight=0.3)
INHERITED = (*FRESH_DEFAULTS, *PRESET_DEFAULTS["mini"])
NO_FLAG = ("grad_clip", "weight_decay", "min_lr_ratio", "config")  # settings of the Python API only


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train", help="train a preset on the Python standard library (byte tokens)",
        description="Train a preset on this interpreter's own standard-library sources (byte tokens, "
                    "nothing downloaded), with AdamW, warm-up + cosine, gradient clipping, the routing bias "
                    "update and the config's aux / z losses. Writes OUT/trainer_state.json, OUT/report.html "
                    "and OUT/checkpoint (safetensors weights + trainer state; load it with "
                    "LatentMoEForCausalLM.from_pretrained). Unset flags take the preset's defaults: "
                    + "; ".join(f"{name}: {', '.join(f'{k} {v}' for k, v in d.items())}"
                                for name, d in PRESET_DEFAULTS.items())
                    + ". With --resume, unset flags take the run's recorded values, and a flag that changes the "
                      "math (the preset, the schedule, the data, the seed, --eval-rows, --param-dtype, --mtp-depth, "
                      "--mtp-weight) must "
                      "equal it unless --allow-changed-flags; --stop-at, --eval-every, --save-every, "
                      "--sample-tokens, --no-guard, --threads, --nproc and the layout are free.")
    parser.add_argument("--preset", choices=sorted(PRESET_DEFAULTS), help="(default: mini)")
    parser.add_argument("--steps", type=int, help="optimizer steps in the whole run")
    parser.add_argument("--batch", type=int, help="global batch in sequences (split over --nproc)")
    parser.add_argument("--seq-len", type=int, help="tokens (bytes) per sequence")
    parser.add_argument("--lr", type=float, help="peak learning rate")
    parser.add_argument("--warmup", type=int, help="linear warm-up steps")
    parser.add_argument("--eval-every", type=int, help="held-out evaluation every K steps (default: 100)")
    parser.add_argument("--eval-rows", type=int, help="held-out sequences per evaluation (default: 64)")
    parser.add_argument("--save-every", type=int, help="checkpoint every K steps (default: 0, only at the end)")
    parser.add_argument("--stop-at", type=int, default=None,
                        help="stop after this step with a checkpoint, as if interrupted (continue with --resume)")
    parser.add_argument("--out", default="runs/train", help="output directory (default: %(default)s)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from OUT/checkpoint exactly, or refuse (see above)")
    parser.add_argument("--allow-changed-flags", action="store_true",
                        help="with --resume: apply changed flags from the checkpoint's step on (data order and lr "
                             "schedule as if the run had used them; weights and optimizer moments kept) and "
                             "record the changes in trainer.json's changed_flags")
    parser.add_argument("--nproc", type=int, default=None,
                        help="local processes over gloo: data-parallel ones (default: 1), or with the flags below "
                             "their product (the default then)")
    parser.add_argument("--seed", type=int, help="seed for the weights and the data order (default: 0)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per process (default: the cores this process may use, shared by the "
                             "processes; 1 when that leaves 2 or fewer: latentmoe_lab/threads.py)")
    parser.add_argument("--group-timeout", type=float, default=120.0, metavar="SECONDS",
                        help="with several processes: a collective that does not return within this ends the run "
                             "with an error naming the rank and the collective (default: %(default)s)")
    parser.add_argument("--corpus-root", default=None, metavar="DIR",
                        help="train on the *.py files under DIR instead of the standard library")
    parser.add_argument("--held-out-fraction", type=float, help="share of the files held out, by path hash (default: 0.02)")
    parser.add_argument("--sample-tokens", type=int, help="greedy bytes generated after the run (default: 200; 0: none)")
    parser.add_argument("--mtp-depth", type=int,
                        help="train a multi-token prediction head of this many depths with the model (default: 0)")
    parser.add_argument("--mtp-weight", type=float,
                        help="weight of the MTP loss in the objective, in [0, 10] (default: 0.3; needs --mtp-depth)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the training step per block (inductor; minutes of compilation "
                             "first; see RESULTS.md for when it pays). Default: eager")
    parser.add_argument("--no-guard", action="store_true", default=None,
                        help="do not check activations and gradients for NaN/inf")
    native = parser.add_argument_group(
        "torch's distributed engine (docs/design.md §11)",
        "Any of these > 1 trains on torch's DeviceMesh / DTensor / FSDP2 (latentmoe_lab/native) on "
        "fsdp x ep x tp x pp local processes: a sharded pickle-free checkpoint in OUT/checkpoint, plain "
        "safetensors in OUT/export. Example: --nproc 4 --fsdp 2 --ep 2")
    for flag, what in (("fsdp", "FSDP2 shards (dp_shard)"), ("ep", "expert-parallel ranks"),
                       ("tp", "tensor-parallel ranks"), ("pp", "pipeline stages")):
        native.add_argument(f"--{flag}", type=int, default=1, help=f"{what} (default: 1)")
    native.add_argument("--init-from", default=None, metavar="DIR",
                        help="start from this save_pretrained directory (each rank reads only its slices)")
    native.add_argument("--micro-batches", type=int, default=2, help="pipeline micro-batches per step (default: 2)")
    native.add_argument("--schedule", default="gpipe", choices=("gpipe", "1f1b"), help="pipeline schedule")
    native.add_argument("--param-dtype", choices=("fp32", "bf16"),
                        help="FSDP2 mixed precision: the dtype parameters are gathered and used in (default: fp32)")
    parser.set_defaults(func=run)
    return parser


def cli_flag(setting: str) -> str:
    """A TrainSettings field as the flag that sets it: seq_len -> --seq-len."""
    return "--" + setting.replace("_", "-")


def settings_from_args(args: argparse.Namespace, recorded: dict | None = None) -> TrainSettings:
    """The run's settings: the flags given, then (resuming) `recorded`, trainer.json's settings, then defaults."""
    given = {name: getattr(args, name) for name in INHERITED if name != "guard"}
    given["guard"] = None if args.no_guard is None else not args.no_guard
    recorded = recorded or {}
    chosen = {name: recorded[name] for name in NO_FLAG if name in recorded}
    for name, value in given.items():
        chosen[name] = value if value is not None else recorded.get(name, FRESH_DEFAULTS.get(name))
    chosen["preset"] = chosen["preset"] or FRESH_DEFAULTS["preset"]
    for name, default in PRESET_DEFAULTS[chosen["preset"]].items():
        chosen[name] = default if chosen[name] is None else chosen[name]
    return TrainSettings(stop_at=args.stop_at, out=args.out, resume=args.resume, nproc=_nproc(args),
                         threads=args.threads, group_timeout_s=args.group_timeout, compile=args.compile,
                         allow_changed_flags=args.allow_changed_flags, **chosen)


def _nproc(args: argparse.Namespace) -> int:
    if args.nproc is not None:
        return args.nproc
    layout = native_layout_from_args(args)
    return layout.world_size if layout is not None else 1


def native_layout_from_args(args: argparse.Namespace):
    """The NativeLayout the flags ask for, or None for the plain (accelerate) run."""
    from latentmoe_lab.native.layout import NativeLayout

    layout = NativeLayout(dp_shard=args.fsdp, ep=args.ep, tp=args.tp, pp=args.pp, micro_batches=args.micro_batches,
                          schedule=args.schedule, param_dtype=args.param_dtype)
    return layout if layout.world_size > 1 else None


def run(args: argparse.Namespace) -> int:
    # Every flag, path and resume error is raised here, before the corpus or the model is loaded (a ValueError:
    # cli.main prints it, exit status 2).
    meta = read_trainer_json(Path(args.out) / CHECKPOINT_DIR)[1] if args.resume else None
    if meta is not None and args.param_dtype is None:
        args.param_dtype = (meta.get("layout") if isinstance(meta.get("layout"), dict) else {}).get("param_dtype")
    args.param_dtype = args.param_dtype or "fp32"
    settings = settings_from_args(args, None if meta is None else meta["settings"])
    threads, why = choose_threads(args.threads, settings.nproc)
    print(why)
    settings = dataclasses.replace(settings, threads=threads)
    layout = native_layout_from_args(args)
    # torch's engine checks nproc against its layout instead of the plain run's batch % nproc (native/run.py)
    (settings if layout is None else dataclasses.replace(settings, nproc=1)).validate()
    if args.mtp_weight is not None and not settings.mtp_depth:
        raise ValueError("--mtp-weight: only with --mtp-depth N > 0 (without an MTP head there is no MTP loss to "
                         "weight)")
    if layout is not None and settings.mtp_depth:
        raise ValueError("--mtp-depth: only the plain run trains an MTP head (torch's engine partitions the main "
                         "layers; leave out --fsdp/--ep/--tp/--pp)")
    if layout is not None and settings.compile:
        raise ValueError("--compile: only the plain run (leave out --fsdp/--ep/--tp/--pp)")
    if layout is None and args.init_from is not None:
        raise ValueError("init_from: only with --fsdp/--ep/--tp/--pp > 1 (the plain run starts from --seed)")
    if args.init_from is not None and not Path(args.init_from).is_dir():
        raise ValueError(f"--init-from: {args.init_from} is not a directory")
    from latentmoe_lab.checkpoint_dir import RUN, check_output_dir

    check_output_dir(args.out, sources=(args.init_from,), name="--out", kind=RUN)
    if settings.resume:
        point = prepare_resume(settings, Path(settings.out) / CHECKPOINT_DIR, layout=layout, spell=cli_flag)
        for change in point.new_changes:
            print(f"resuming at step {point.step} with {cli_flag(change['setting'])} {change['to']!r} instead of the "
                  f"run's {change['from']!r} (--allow-changed-flags; recorded in trainer.json)", file=sys.stderr)
    if layout is not None:
        from latentmoe_lab.native.run import train_native

        history = train_native(settings, layout, init_from=args.init_from)
    else:
        history = train(settings)
    if history.eval:
        step, loss, bpb = history.eval[-1]
        print(f"held-out after step {int(step)}: loss {loss:.4f} nats = {bpb:.3f} bits per byte "
              f"(uniform: 8.000; perplexity {math.exp(loss):.2f})")
    print(f"{history.tokens_seen:,} tokens in {history.seconds:.1f} s "
          f"({history.tokens_seen / max(history.seconds, 1e-9):,.0f} tokens/s)")
    if history.sample:
        print("greedy sample:\n" + history.sample)
    exported = f", {settings.out}/export (safetensors)" if layout is not None else ""
    print(f"outputs: {settings.out}/trainer_state.json, {settings.out}/report.html, {settings.out}/checkpoint{exported}")
    return 0
