"""`latentmoe-lab train --fsdp 2 --ep 2 ...`: the corpus run of training/lm.py on torch's engine.

The same data order (corpus.batch_rows over the global batch), warm-up + cosine schedule, AdamW,
clipping and routing-bias update as the accelerate run, with the model built per rank by
build_native (no rank holds the whole model) and stepped by NativeTrainer. From a shell it starts
the local processes itself; under torchrun or accelerate launch (WORLD_SIZE set) each process runs
its own rank. Outputs in `out`:

    checkpoint/        sharded, pickle-free (native/checkpoint.py): every K steps and at the end;
                       --resume continues from it under any layout
    export/            plain safetensors (save_pretrained), written at the end of each run (also at --stop-at)
    trainer_state.json, report.html    as the accelerate run writes them
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from latentmoe_lab.checkpoint_checks import check_checkpoint, checked_files, resolve_checkpoint_dir
from latentmoe_lab.checkpoint_dir import RUN, check_output_dir
from latentmoe_lab.native.layout import NativeLayout
from latentmoe_lab.training.lm import History, TrainSettings, progress_bar, warmup_cosine, write_outputs
from latentmoe_lab.training.resume import ResumePoint, finish_resume, history_from, prepare_resume

CHECKPOINT_DIR, EXPORT_DIR, STATE_FILE = "checkpoint", "export", "trainer.json"


def train_native(settings: TrainSettings, layout: NativeLayout, init_from: str | Path | None = None) -> History:
    """Run `settings` under `layout` on layout.world_size local processes; returns rank 0's history.

    init_from: a save_pretrained directory to start from (each rank reads its slices); otherwise each rank
    draws its local shards from settings.seed (not the single-process initialisation: see build.py).
    """
    from latentmoe_lab.parallel.launch import launch

    dataclasses.replace(settings, nproc=1).validate()  # nproc's own rule (batch % nproc) is the plain run's
    layout.validate_for(settings.model_config())
    layout.validate_batch(settings.batch)
    if settings.nproc != layout.world_size:
        raise ValueError(f"nproc: the layout {layout.name} runs on {layout.world_size} processes, got {settings.nproc}")
    if layout.world_size == 1:
        raise ValueError("layout: the native path needs at least one dimension > 1 (use the plain run for 1 process)")
    if settings.out is not None:
        check_output_dir(settings.out, sources=(init_from,), name="out", kind=RUN)
    if init_from is not None:  # every rank would read it: refuse a damaged one here, once, before launching
        source = resolve_checkpoint_dir(init_from, name="init_from")
        check_checkpoint(None, source, checked_files(source))
        init_from = str(init_from)
    # the resume is checked before any process starts (training/resume.py: the same rules as the plain run)
    point = prepare_resume(settings, Path(settings.out) / CHECKPOINT_DIR, layout=layout) if settings.resume else None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # already one of torchrun's / accelerate's processes
        return History(**_run(settings, layout, init_from, point))
    return History(**launch(_run, layout.world_size, args=(settings, layout, init_from, point),
                            timeout_s=settings.timeout_s)[0])


def _run(settings: TrainSettings, layout: NativeLayout, init_from: str | None, point: ResumePoint | None) -> dict:
    from latentmoe_lab.native.build import build_native
    from latentmoe_lab.native.checkpoint import export_safetensors, load_sharded, save_sharded
    from latentmoe_lab.native.layout import build_mesh
    from latentmoe_lab.native.train import NativeTrainer
    from latentmoe_lab.parallel.mesh import init_distributed
    from latentmoe_lab.training.corpus import batch_rows, load_corpus, pack

    init_distributed(settings.group_timeout_s)  # every mesh dim's group inherits it
    if settings.threads is not None:  # after: accelerate's PartialState sets cores / local processes
        torch.set_num_threads(settings.threads)
    main = dist.get_rank() == 0
    config = settings.model_config()
    corpus = load_corpus(settings.corpus_root, settings.held_out_fraction, verbose=main)
    train_rows, held_rows = pack(corpus.train, settings.seq_len), pack(corpus.held_out, settings.seq_len)
    native = build_native(config, layout, build_mesh(layout), checkpoint=init_from, seed=settings.seed)
    trainer = NativeTrainer(native, lr=settings.lr, weight_decay=settings.weight_decay, grad_clip=settings.grad_clip,
                            betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        trainer.optimizer, warmup_cosine(settings.warmup, settings.steps, settings.min_lr_ratio))
    out = Path(settings.out) if settings.out is not None else None
    history = History()
    if point is not None:
        load_sharded(native, point.directory, optimizer=trainer.optimizer)
        history = history_from(History, point)
        finish_resume(trainer.optimizer, scheduler, settings, point, point.directory / "optimizer")

    last = settings.stop_at or settings.steps
    progress = progress_bar(main, history.step, settings.steps, desc="train (native)")
    started = time.perf_counter() - history.seconds
    for step in range(history.step, last):
        batch = train_rows[batch_rows(step, settings.batch, len(train_rows), settings.seed)].long()
        result = trainer.step(batch)
        scheduler.step()
        if not math.isfinite(result["loss"]) or not math.isfinite(result["grad_norm"]):
            raise FloatingPointError(f"step {step + 1}: non-finite loss {result['loss']} or gradient norm "
                                     f"{result['grad_norm']} (rerun without --fsdp/--ep/--tp/--pp to have the "
                                     f"guard name the module)")
        history.step, history.seconds = step + 1, time.perf_counter() - started
        history.train_loss.append(result["loss"])
        history.tokens_seen += settings.batch * settings.seq_len
        if len(result["counts"]):
            load = result["counts"].float()
            history.expert_load.append([step + 1, (load.max(-1).values / load.mean(-1)).tolist()])
        if progress is not None:
            progress.set_postfix(loss=f"{result['loss']:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
            progress.update(1)
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            held = evaluate(native, held_rows, settings.eval_rows, settings.batch)
            history.eval.append([step + 1, held, held / math.log(2)])
        at_end = step + 1 == last
        if out is not None and (at_end or (settings.save_every and (step + 1) % settings.save_every == 0)):
            state = {"step": history.step, "history": asdict(history), "scheduler": scheduler.state_dict(),
                     "settings": asdict(settings), "layout": asdict(layout),
                     "changed_flags": [] if point is None else point.changes}
            save_sharded(native, out / CHECKPOINT_DIR, optimizer=trainer.optimizer, extra_json={STATE_FILE: state})
    if progress is not None:
        progress.close()
    if out is not None and history.step >= last:  # also after --stop-at: the CLI announces OUT/export
        if main:
            export_safetensors(out / CHECKPOINT_DIR, out / EXPORT_DIR)
            if settings.sample_tokens and history.step == settings.steps:
                from latentmoe_lab.model import LatentMoEForCausalLM
                from latentmoe_lab.training.lm import greedy_sample

                history.sample = greedy_sample(LatentMoEForCausalLM.from_pretrained(out / EXPORT_DIR),
                                               settings.sample_tokens)
    # No barrier: the other ranks would wait in a collective, bounded by the group timeout, for as long as rank
    # 0 exports and samples. The launcher holds every rank until all have returned (parallel/launch.py).
    if main and out is not None:
        write_outputs(out, history, settings, config)
    return asdict(history)


@torch.no_grad()
def evaluate(native, held_rows: torch.Tensor, max_rows: int, batch: int) -> float:
    """Mean next-byte cross-entropy (nats) over evenly spaced held-out rows, in chunks of the training batch."""
    from latentmoe_lab.model import causal_lm_loss
    from latentmoe_lab.native.forward import native_logits

    count = max(batch, (min(max_rows, len(held_rows)) // batch) * batch)
    picked = torch.linspace(0, len(held_rows) - 1, count).round().long()
    chunks = [held_rows[picked[i:i + batch]].long() for i in range(0, count, batch)]
    losses = [float(causal_lm_loss(native_logits(native, ids), ids.to(native.device))) for ids in chunks]
    return sum(losses) / len(losses)
