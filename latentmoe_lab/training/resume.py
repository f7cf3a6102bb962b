"""Resuming a training run: it continues exactly, or it is refused (docs/design.md §9).

A checkpoint's trainer.json records the run's settings and how far it got. A resume is checked against
it before the corpus or the model is loaded:

- MODEL_SETTINGS (preset, config) can never change: the checkpoint holds that model.
- MATH_SETTINGS (the schedule, the data, the seed, the evaluation sample, ...) and, on torch's engine,
  the layout's param_dtype must equal the recorded values; a change is refused naming the setting,
  unless allow_changed_flags. Then the run continues from the checkpoint's step as a run started with
  the new values would continue from there (the data position and the lr schedule are functions of the
  step), with the checkpoint's weights and optimizer moments, and the change is appended to trainer.json's
  "changed_flags" as {"step", "setting", "from", "to"}.
- Every other setting is free (about this session, not about the run): stop_at, eval_every, save_every,
  sample_tokens, guard, threads, nproc and the parallel layout (the same math, summed in another order),
  out, timeout_s.
- The counters must agree: trainer.json's step == history.step == len(history.train_loss) ==
  scheduler.last_epoch == every optimizer state's step (check_optimizer_steps, after the load), an
  integer in [0, steps]; and stop_at, when given, must lie after it.

Errors are one-line ValueErrors naming the file and field, or the setting through `spell` (the CLI
passes one that writes "--seq-len" for seq_len).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from latentmoe_lab.checkpoint import load_weights_into, resolve_checkpoint_dir
from latentmoe_lab.training import state as trainer_state
from latentmoe_lab.training.state import JSON_NAME, TENSORS_NAME

MODEL_SETTINGS = ("preset", "config", "mtp_depth")
MATH_SETTINGS = ("steps", "batch", "seq_len", "lr", "warmup", "seed", "corpus_root", "held_out_fraction",
                 "eval_rows", "grad_clip", "weight_decay", "min_lr_ratio", "mtp_weight")
# settings added after runs were recorded without them: a record that lacks one ran with this value
ADDED_SETTINGS = {"mtp_depth": 0, "mtp_weight": 0.3}
# torch's engine: the dtype parameters are gathered and used in, and its value in a plain run's record (no
# "layout" there: the accelerate run keeps everything in fp32)
LAYOUT_MATH_SETTINGS = {"param_dtype": "fp32"}


@dataclass
class ResumePoint:
    """Where a checked resume starts. changes: every allowed change of the run so far, this resume's last."""

    directory: Path  # the checkpoint directory read (DIR, or DIR.previous after an interrupted save)
    meta: dict  # trainer.json
    step: int
    changes: list[dict] = field(default_factory=list)
    new_changes: list[dict] = field(default_factory=list)  # the part of `changes` this resume adds


def read_trainer_json(checkpoint: str | Path) -> tuple[Path, dict]:
    """(the checkpoint directory, its trainer.json) with the top-level fields a resume reads checked for type."""
    try:
        directory = resolve_checkpoint_dir(checkpoint)
    except FileNotFoundError:
        raise FileNotFoundError(f"resume: no checkpoint at {checkpoint}; start the run without --resume") from None
    path = directory / JSON_NAME
    if not path.is_file():
        raise ValueError(f"resume: {path} is missing; {directory} is not a checkpoint of a training run")
    try:
        meta = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    for name in ("settings", "history", "scheduler"):
        if not isinstance(meta.get(name), dict):
            raise ValueError(f"{path}: {name} must be an object, got {_short(meta.get(name))}")
    if not isinstance(meta.get("changed_flags", []), list):
        raise ValueError(f"{path}: changed_flags must be a list, got {_short(meta['changed_flags'])}")
    return directory, meta


def prepare_resume(settings, checkpoint: str | Path, layout=None, spell: Callable[[str], str] = str) -> ResumePoint:
    """Check a resume of `settings` (a TrainSettings) from `checkpoint` before anything heavy is loaded.

    layout: the NativeLayout of a run on torch's engine (its param_dtype is compared too), None otherwise.
    Raises ValueError / FileNotFoundError naming the file and field, or the setting as `spell` writes it.
    """
    directory, meta = read_trainer_json(checkpoint)
    path = directory / JSON_NAME
    step = _counter(meta, path)
    # through JSON, as the record went: tuples become lists, so only real changes differ
    current, recorded = json.loads(json.dumps(asdict(settings))), {**ADDED_SETTINGS, **meta["settings"]}
    names = MODEL_SETTINGS + MATH_SETTINGS
    if layout is not None:
        recorded_layout = meta.get("layout") if isinstance(meta.get("layout"), dict) else {}
        current.update({name: getattr(layout, name) for name in LAYOUT_MATH_SETTINGS})
        recorded.update({name: recorded_layout.get(name, plain) for name, plain in LAYOUT_MATH_SETTINGS.items()})
        names += tuple(LAYOUT_MATH_SETTINGS)
    new_changes = []
    for name in names:
        if name not in recorded:
            raise ValueError(f"{path}: settings.{name} is missing, so a resume cannot tell whether it changed")
        given, before = current[name], recorded[name]
        if given == before:
            continue
        if name in MODEL_SETTINGS:
            raise ValueError(f"{spell(name)}: {_short(given)} differs from the run's {_short(before)}; the "
                             f"checkpoint holds the run's model, which a resume cannot change")
        if not settings.allow_changed_flags:
            raise ValueError(f"{spell(name)}: {_short(given)} differs from the run's {_short(before)}; a resume "
                             f"continues the recorded run exactly (leave the flag out to keep the run's value, or "
                             f"pass {spell('allow_changed_flags')} to apply the change from step {step})")
        new_changes.append({"step": step, "setting": name, "from": before, "to": given})
    if step > settings.steps:
        raise ValueError(f"{path}: step {step} is beyond {spell('steps')} {settings.steps}")
    if settings.stop_at is not None and settings.stop_at <= step:
        raise ValueError(f"{spell('stop_at')}: {settings.stop_at} is not after the checkpoint's step {step}")
    return ResumePoint(directory, meta, step, list(meta.get("changed_flags", [])) + new_changes, new_changes)


def _counter(meta: dict, path: Path) -> int:
    """trainer.json's step, after checking that the history and the scheduler agree with it."""
    step = meta.get("step")
    _check_count(step, path, "step")
    history, last_epoch = meta["history"], meta["scheduler"].get("last_epoch")
    _check_count(history.get("step"), path, "history.step")
    _check_count(last_epoch, path, "scheduler.last_epoch")
    losses = history.get("train_loss")
    if not isinstance(losses, list):
        raise ValueError(f"{path}: history.train_loss must be a list, got {_short(losses)}")
    others = {"history.step": history["step"], "scheduler.last_epoch": last_epoch,
              "len(history.train_loss)": len(losses)}
    differing = [f"{name} is {value}" for name, value in others.items() if value != step]
    if differing:
        raise ValueError(f"{path}: step is {step} but {', '.join(differing)}; the trainer state disagrees with "
                         f"itself, so the run cannot continue exactly")
    return step


def _check_count(value, path: Path, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{path}: {name} must be an integer >= 0, got {_short(value)}")


def history_from(history_class: type, point: ResumePoint):
    """history_class(**trainer.json's history), with an unknown or missing field named with the file."""
    try:
        return history_class(**point.meta["history"])
    except TypeError as error:
        raise ValueError(f"{point.directory / JSON_NAME}: history: {error}") from None


def resume_into(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, settings,
                point: ResumePoint) -> None:
    """The accelerate trainer's load (training/lm.py): weights, the checked optimizer and RNG state, then
    finish_resume."""
    load_weights_into(model, point.directory)
    tensors_path = point.directory / TENSORS_NAME
    trainer_state.restore(optimizer, point.meta, trainer_state.read_trainer_tensors(point.directory), tensors_path)
    finish_resume(optimizer, scheduler, settings, point, tensors_path)


def finish_resume(optimizer: torch.optim.Optimizer, scheduler, settings, point: ResumePoint,
                  optimizer_path: str | Path) -> None:
    """After the optimizer state is loaded (from `optimizer_path`), on either engine: the scheduler from
    trainer.json, `settings`' hyperparameters (apply_settings), and the optimizer's step checked against the
    checkpoint's."""
    try:  # a copy: LambdaLR.load_state_dict pops from and re-inserts into the dict it is given
        scheduler.load_state_dict(dict(point.meta["scheduler"]))
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{point.directory / JSON_NAME}: scheduler: does not fit a LambdaLR "
                         f"({type(error).__name__}: {error})") from None
    apply_settings(optimizer, scheduler, settings)
    check_optimizer_steps(optimizer, point.step, optimizer_path)


def apply_settings(optimizer: torch.optim.Optimizer, scheduler, settings) -> None:
    """Make a restored optimizer and LambdaLR follow `settings`: the settings are the run's hyperparameters,
    the checkpoint gives the moments and the step.

    Without an allowed change this rewrites the values the checkpoint held, the same floats. The peak lr
    goes into base_lrs / initial_lr and the current lr is peak x the schedule's factor at the restored step
    (what LambdaLR computes); weight decay goes into group 0, the decayed group as training/lm.py and
    native/train.py build them (group 1, the vectors, has none).
    """
    scheduler.base_lrs = [settings.lr for _ in optimizer.param_groups]
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = settings.lr
        group["lr"] = settings.lr * factor(scheduler.last_epoch)
    optimizer.param_groups[0]["weight_decay"] = settings.weight_decay


def check_optimizer_steps(optimizer: torch.optim.Optimizer, step: int, where: str | Path) -> None:
    """ValueError unless every parameter's optimizer state (those that had a gradient) is at `step`."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    for index, param in enumerate(params):
        if param not in optimizer.state:  # no gradient before the save: no state, fresh after the load too
            continue
        value = optimizer.state[param].get("step")
        if isinstance(value, torch.Tensor):
            value = float(value.full_tensor() if hasattr(value, "full_tensor") else value)
        if value != step:
            raise ValueError(f"{where}: the optimizer state of parameter {index} is at step {_short(value)}, "
                             f"trainer.json at step {step}; the trainer state disagrees with itself")


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
