"""Language-model training on the standard-library corpus (docs/design.md §9).

One step, identical on every process:

    ids      = the rank's slice of the global batch (corpus.batch_rows: fixed by the step number)
    loss     = CE(next byte) + aux_loss (moe.aux_loss_alpha balance loss + moe.z_loss_coef z-loss)
               + mtp_weight * mtp_loss (with mtp_depth > 0: the multi-token prediction head, mtp.py)
    backward through accelerate (DDP over gloo when there are several processes: gradients averaged)
    clip the global gradient norm, AdamW step, warm-up + cosine learning rate
    routing bias b <- b + u * sign(mean(c) - c) on the expert counts summed over all processes

With equal shards the averaged gradient of the per-rank means equals the gradient of the global mean,
and the summed counts equal the one-process counts, so N processes follow the one-process run.
A non-finite loss or gradient norm stops the run: the step is replayed under a NonFiniteGuard, which
names the first module whose activation or gradient went non-finite (training/guard.py).

Outputs in `out`: trainer_state.json (curves), report.html (plotly), checkpoint/ (weights, config,
optimizer, scheduler, RNG and step: `resume=True` continues exactly where the saved run stopped, or is
refused before anything heavy is loaded; training/resume.py says which settings may change).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch

from latentmoe_lab.checkpoint import save_checkpoint
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.parallel.eplb.load import ExpertLoadRecorder
from latentmoe_lab.training import state as trainer_state
from latentmoe_lab.training.corpus import batch_rows, load_corpus, pack
from latentmoe_lab.training.guard import replay_with_guard
from latentmoe_lab.training.resume import ResumePoint, history_from, prepare_resume, resume_into

CHECKPOINT_DIR = "checkpoint"
MAX_MTP_WEIGHT = 10.0  # the MTP loss's weight against the main loss's 1 (DeepSeek-V3 trains with 0.3 and 0.1)

# Defaults of `latentmoe-lab train` per preset: (steps, global batch, seq_len, lr, warmup).
# mini: sized so that 2 CPU cores reach <= 3.0 held-out bits per byte in 10 minutes (see RESULTS.md). Its
# 8 x 128 batch stays: 16 x 128, 8 x 256 and 16 x 256 ran at the same tokens/s within 5% and 32 x 128 and
# 64 x 64 slower (one thread, RESULTS.md "Training speed"): the step is per-token work, not per-op overhead.
PRESET_DEFAULTS = {
    "tiny": dict(steps=200, batch=8, seq_len=128, lr=3e-3, warmup=20),
    "mini": dict(steps=450, batch=8, seq_len=128, lr=3e-3, warmup=30),
    "small": dict(steps=50, batch=4, seq_len=256, lr=3e-3, warmup=10),
}


@dataclass
class TrainSettings:
    """Everything a run depends on. batch is the global batch (split over nproc processes)."""

    preset: str = "mini"
    steps: int = 450
    batch: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 30
    eval_every: int = 100
    save_every: int = 0  # 0: only at the end (and at stop_at)
    out: str | None = None
    resume: bool = False
    nproc: int = 1
    seed: int = 0
    threads: int | None = None
    stop_at: int | None = None  # stop after this step (a checkpoint is saved) as if interrupted
    eval_rows: int = 64
    grad_clip: float = 1.0
    weight_decay: float = 0.1
    min_lr_ratio: float = 0.1
    guard: bool = True
    corpus_root: str | None = None
    held_out_fraction: float = 0.02
    config: dict | None = None  # a ModelConfig as a dict, instead of the preset
    sample_tokens: int = 200
    timeout_s: float = 3600.0  # the whole run, per process (the launcher's watchdog)
    group_timeout_s: float = 120.0  # one collective: a rank waiting longer fails, naming it (not a silent hang)
    allow_changed_flags: bool = False  # resume: apply changed MATH_SETTINGS (training/resume.py) instead of refusing
    mtp_depth: int = 0  # MTP head depths trained with the model (0: the config's own, none in the presets)
    mtp_weight: float = 0.3  # the MTP loss's weight in the objective
    compile: bool = False  # torch.compile the training forward + backward per region (compiled.compile_training)

    def model_config(self) -> ModelConfig:
        config = ModelConfig.from_dict(self.config) if self.config is not None else ModelConfig.from_preset(self.preset)
        return config.replace(mtp_depth=self.mtp_depth) if self.mtp_depth else config

    def validate(self) -> None:
        for name in ("steps", "batch", "seq_len", "eval_every", "nproc", "eval_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        for name in ("warmup", "save_every", "sample_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an integer >= 0, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr: must be a finite number > 0, got {self.lr!r}")
        if isinstance(self.mtp_depth, bool) or not isinstance(self.mtp_depth, int) or self.mtp_depth < 0:
            raise ValueError(f"mtp_depth: must be an integer >= 0, got {self.mtp_depth!r}")
        if not (isinstance(self.mtp_weight, (int, float)) and not isinstance(self.mtp_weight, bool)
                and math.isfinite(self.mtp_weight) and 0 <= self.mtp_weight <= MAX_MTP_WEIGHT):
            raise ValueError(f"mtp_weight: must be a number in [0, {MAX_MTP_WEIGHT:g}] (the main loss has weight 1; "
                             f"a larger weight overflows the gradients), got {self.mtp_weight!r}")
        configured = self.config.get("mtp_depth", 0) if isinstance(self.config, dict) else 0
        if self.mtp_depth and configured and configured != self.mtp_depth:
            raise ValueError(f"mtp_depth: {self.mtp_depth} differs from the config's mtp_depth {configured!r}; "
                             "set one of them")
        depth = self.mtp_depth or configured
        if isinstance(depth, int) and isinstance(self.seq_len, int) and depth > self.seq_len - 2:
            raise ValueError(f"mtp_depth: must be at most seq_len - 2 = {self.seq_len - 2} (depth k predicts the "
                             f"token k + 1 past the next one; deeper depths have no target in a row of {self.seq_len} "
                             f"tokens), got {depth}")
        if self.batch % self.nproc:
            raise ValueError(f"batch: the global batch ({self.batch}) must be divisible by nproc ({self.nproc})")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise ValueError(f"stop_at: must lie in [1, steps={self.steps}], got {self.stop_at!r}")
        if (self.resume or self.stop_at is not None) and self.out is None:
            raise ValueError("out: resume and stop_at need an output directory for the checkpoint")
        if self.allow_changed_flags and not self.resume:
            raise ValueError("allow_changed_flags: only with resume (it lets a resume change the run's settings)")
        if self.corpus_root is not None and not Path(self.corpus_root).is_dir():
            raise ValueError(f"corpus_root: {self.corpus_root} is not a directory")
        if not (isinstance(self.held_out_fraction, (int, float)) and 0 < self.held_out_fraction < 1):
            raise ValueError(f"held_out_fraction: must lie in (0, 1), got {self.held_out_fraction!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads: must be >= 1, got {self.threads!r}")
        timeout = self.group_timeout_s
        if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and 0 < timeout <= 3600):
            raise ValueError(f"group_timeout_s: must be a number of seconds in (0, 3600], got {timeout!r}")


@dataclass
class History:
    """What trainer_state.json holds. eval rows are [step, held-out loss (nats), bits per byte];
    mtp_loss is the MTP head's training loss per step (empty without a head);
    expert_load rows are [step, max/mean tokens per expert for each MoE layer]; expert_window is the tokens
    per [MoE layer][expert] over the last eval_every steps (the load balancer's input, parallel/eplb/rebalance.py)."""

    step: int = 0
    train_loss: list[float] = field(default_factory=list)
    eval: list[list[float]] = field(default_factory=list)
    tokens_seen: int = 0
    seconds: float = 0.0
    expert_load: list[list] = field(default_factory=list)
    mtp_loss: list[float] = field(default_factory=list)
    expert_window: list[list[int]] = field(default_factory=list)
    sample: str = ""


def warmup_cosine(warmup: int, total: int, min_ratio: float):
    """lr multiplier at scheduler step s: linear 1/warmup .. 1, then cosine down to min_ratio at `total`."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def train(settings: TrainSettings) -> History:
    """Run (or resume) a training run; with nproc > 1 on local gloo processes. Returns rank 0's history."""
    settings.validate()
    # checked here, before any process starts, the corpus or the model is loaded
    point = prepare_resume(settings, Path(settings.out) / CHECKPOINT_DIR) if settings.resume else None
    if settings.nproc == 1:
        from accelerate.state import AcceleratorState

        try:
            return History(**_run(settings, point))
        finally:
            # accelerate keeps its state per process, and notebook_launcher refuses to start workers
            # from a process that already holds one: leave none behind for a later multi-process run.
            AcceleratorState._reset_state(reset_partial_state=True)
    from latentmoe_lab.parallel.launch import launch

    return History(**launch(_run, settings.nproc, args=(settings, point), timeout_s=settings.timeout_s)[0])


def _moe_layers(model: LatentMoEForCausalLM) -> list[LatentMoE]:
    return [block.ffn for block in model.layers if isinstance(block.ffn, LatentMoE)]


def _run(settings: TrainSettings, point: ResumePoint | None) -> dict:
    """One process of the run, resumed from `point` if given; returns asdict(History) (launch hands back plain
    data only)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[
        # The lightning indexer only picks positions (a top-k), so this loss gives its weights no gradient
        # (its KL warm-up is training/indexer.py); DDP must not wait for those gradients.
        DistributedDataParallelKwargs(find_unused_parameters=True),
        InitProcessGroupKwargs(timeout=timedelta(seconds=settings.group_timeout_s))])
    rank, world, main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    config = settings.model_config()
    corpus = load_corpus(settings.corpus_root, settings.held_out_fraction, verbose=main)
    train_rows, held_rows = pack(corpus.train, settings.seq_len), pack(corpus.held_out, settings.seq_len)

    torch.manual_seed(settings.seed)
    model = LatentMoEForCausalLM(config)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    # fused: one kernel over all parameters instead of ~10 ops per tensor (mini on one CPU thread: 26 ms against
    # 115 ms a step, RESULTS.md "Training speed"); the same update to float rounding, and resume stays exact
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=settings.lr, betas=(0.9, 0.95),
                                  fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(settings.warmup, settings.steps, settings.min_lr_ratio))
    history = History()
    out = Path(settings.out) if settings.out is not None else None
    changes = [] if point is None else point.changes
    if point is not None:
        resume_into(model, optimizer, scheduler, settings, point)
        history = history_from(History, point)
    moe_layers = _moe_layers(model)
    load_recorder = ExpertLoadRecorder(len(moe_layers), config.moe.num_experts, settings.eval_every)
    # Only the model is prepared: accelerate's scheduler wrapper would step once per process.
    if settings.compile:
        from latentmoe_lab.compiled import compile_training

        compile_training(model)  # before DDP wraps it: the regions are the model's own blocks
    model, optimizer = accelerator.prepare(model, optimizer)
    inner = accelerator.unwrap_model(model)

    last = settings.stop_at or settings.steps
    progress = progress_bar(main, history.step, settings.steps)
    started, tokens_at_start = time.perf_counter() - history.seconds, history.tokens_seen
    window = time.perf_counter()
    for step in range(history.step, last):
        model.train()
        ids = train_rows[batch_rows(step, settings.batch, len(train_rows), settings.seed, rank, world)]
        ids = ids.long().to(accelerator.device)
        output = model(ids, labels=ids)
        total = _loss_of(output, settings.mtp_weight)
        accelerator.backward(total)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), settings.grad_clip)
        if settings.guard and not (torch.isfinite(total.detach()) and torch.isfinite(grad_norm)):
            # eager, so that the guard's hooks see every module (and the routing checks run)
            with torch.compiler.set_stance("force_eager"):
                replay_with_guard(inner, lambda: _loss_of(inner(ids, labels=ids), settings.mtp_weight).backward(),
                                  step + 1)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        counts = accelerator.reduce(torch.stack([layer.last_expert_counts for layer in moe_layers]), "sum")
        for layer, layer_counts in zip(moe_layers, counts):
            if layer.bias_rule == "quantile":  # each rank's quantiles of its own tokens, averaged: one bias on all
                layer.set_bias(accelerator.reduce(layer.target_bias(), "mean"))
            else:
                layer.update_bias(layer_counts)
        load_recorder.record(counts)
        loss = float(accelerator.reduce(output.loss.detach(), "mean"))
        history.step = step + 1
        history.train_loss.append(loss)
        if output.mtp_loss is not None:
            history.mtp_loss.append(float(accelerator.reduce(output.mtp_loss.detach(), "mean")))
        history.tokens_seen += settings.batch * settings.seq_len
        history.seconds = time.perf_counter() - started
        load = counts.float()
        history.expert_load.append([step + 1, (load.max(-1).values / load.mean(-1)).tolist()])
        if progress is not None:
            rate = (history.tokens_seen - tokens_at_start) / max(time.perf_counter() - window, 1e-9)
            mtp = {"mtp": f"{history.mtp_loss[-1]:.3f}"} if output.mtp_loss is not None else {}
            progress.set_postfix(loss=f"{loss:.3f}", **mtp, tok_s=f"{rate:,.0f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
            progress.update(1)
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            held_loss = evaluate(inner, held_rows, settings.eval_rows, accelerator)
            history.eval.append([step + 1, held_loss, held_loss / math.log(2)])
            history.expert_window = load_recorder.window.tolist()
            if progress is not None:
                progress.write(f"step {step + 1}: held-out loss {held_loss:.4f}, "
                               f"{held_loss / math.log(2):.3f} bits per byte")
        at_end = step + 1 == last
        if out is not None and (at_end or (settings.save_every and (step + 1) % settings.save_every == 0)):
            _save(accelerator, inner, optimizer, scheduler, history, settings, changes, out)
    if progress is not None:
        progress.close()
    if main and history.step == settings.steps and settings.sample_tokens:
        history.sample = greedy_sample(inner, settings.sample_tokens)
    if main and out is not None:
        write_outputs(out, history, settings, config)
    return asdict(history)


def _loss_of(output, mtp_weight: float) -> torch.Tensor:
    total = output.loss + output.aux_loss
    return total if output.mtp_loss is None else total + mtp_weight * output.mtp_loss


def progress_bar(main: bool, start: int, total: int, desc: str = "train"):
    """tqdm over the run's steps on the main process; None elsewhere."""
    if not main:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc=desc, unit="step", dynamic_ncols=True)


@torch.no_grad()
def evaluate(model: LatentMoEForCausalLM, held_rows: torch.Tensor, max_rows: int, accelerator) -> float:
    """Mean next-byte cross-entropy (nats) over up to max_rows evenly spaced held-out rows, all processes."""
    model.eval()
    count = min(max_rows, len(held_rows))
    picked = torch.linspace(0, len(held_rows) - 1, count).round().long()
    mine = picked[accelerator.process_index::accelerator.num_processes]
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # (summed loss, targets)
    for start in range(0, len(mine), 8):
        ids = held_rows[mine[start:start + 8]].long().to(accelerator.device)
        targets = ids[:, 1:].numel()
        total += torch.tensor([float(model(ids, labels=ids).loss) * targets, targets],
                              dtype=torch.float64, device=accelerator.device)
    total = accelerator.reduce(total, "sum")
    model.train()
    return float(total[0] / total[1])


@torch.no_grad()
def greedy_sample(model: LatentMoEForCausalLM, new_tokens: int, prompt: str = "import os\n\n\ndef ") -> str:
    """The prompt and `new_tokens` greedy bytes, decoded (undecodable bytes as U+FFFD)."""
    from latentmoe_lab.tokenizer import ByteTokenizer

    model.eval()
    tokenizer = ByteTokenizer(model.config.vocab_size)
    ids = model.generate(tokenizer.encode(prompt).to(model.embed_tokens.weight.device), max_new_tokens=new_tokens)
    return tokenizer.decode(ids[0].cpu())


def _save(accelerator, model, optimizer, scheduler, history, settings, changes: list[dict], out: Path) -> None:
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        extra = {"history": asdict(history), "settings": asdict(settings), "changed_flags": changes}
        tensors, body = trainer_state.trainer_files(history.step, optimizer.optimizer if hasattr(
            optimizer, "optimizer") else optimizer, scheduler, extra)
        save_checkpoint(model, out / CHECKPOINT_DIR, extra_tensors=tensors, extra_json=body)
        write_outputs(out, history, settings, model.config)
    accelerator.wait_for_everyone()


def write_outputs(out: Path, history: History, settings: TrainSettings, config: ModelConfig) -> None:
    from latentmoe_lab.training.summary import write_training_report

    out.mkdir(parents=True, exist_ok=True)
    state = {key: value for key, value in asdict(history).items()}
    tmp = out / "trainer_state.json.tmp"
    tmp.write_text(json.dumps(state))
    tmp.replace(out / "trainer_state.json")
    write_training_report(out / "report.html", history, settings, config)
