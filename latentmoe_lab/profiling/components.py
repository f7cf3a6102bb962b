"""Where the time goes: wall time per model component (module hooks) and the heaviest ops (torch.profiler).

Components are the top-level parts of each block, so nothing is counted twice:
embeddings, kda, dsa, moe, dense_ffn, norms + lm_head ("head"), and the vision tower when images are passed.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

COMPONENTS = ("embeddings", "vision", "kda", "dsa", "moe", "dense_ffn", "head")


def component_modules(model) -> dict[nn.Module, str]:
    """Each timed module of a LatentMoEForCausalLM -> its component name."""
    parts = {model.embed_tokens: "embeddings", model.norm: "head", model.lm_head: "head"}
    if getattr(model, "vision", None) is not None:
        parts[model.vision] = "vision"
    for block in model.layers:
        parts[block.attn] = block.attention_type
        parts[block.ffn] = "moe" if block.is_moe else "dense_ffn"
    return parts


@contextmanager
def component_timer(model):
    """Accumulate seconds per component while the block runs. Yields a dict component -> seconds.

    On CUDA each hook synchronises, so the numbers are true per-component times (at some cost in overlap).
    """
    seconds: dict[str, float] = defaultdict(float)
    started: dict[nn.Module, float] = {}
    on_cuda = next(model.parameters()).is_cuda

    def now() -> float:
        if on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def before(module, args):
        started[module] = now()

    def after(module, args, output, name):
        seconds[name] += now() - started.pop(module)

    handles = []
    for module, name in component_modules(model).items():
        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(lambda m, a, o, name=name: after(m, a, o, name)))
    try:
        yield seconds
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def prefill_decode_profile(model, prompt_len: int, decode_steps: int, batch: int = 1,
                           seed: int = 0) -> dict[str, dict[str, float]]:
    """Seconds per component for one prefill of prompt_len tokens and for decode_steps single-token steps.

    Returns {"prefill": {component: s, "wall": s}, "decode": {...}}; "wall" is the phase's end-to-end time,
    and wall minus the component sum is what runs between components (residual adds, cache bookkeeping).
    """
    if prompt_len < 1 or decode_steps < 0 or batch < 1:
        raise ValueError(f"prompt_len, decode_steps, batch: need >= 1, >= 0, >= 1; got "
                         f"{prompt_len}, {decode_steps}, {batch}")
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=generator).to(device)
    cache = model.new_cache()
    result = {}
    with component_timer(model) as seconds:
        start = time.perf_counter()
        logits = model(ids, cache=cache).logits
        result["prefill"] = dict(seconds, wall=time.perf_counter() - start)
    with component_timer(model) as seconds:
        start = time.perf_counter()
        for _ in range(decode_steps):
            logits = model(logits[:, -1:].argmax(-1), cache=cache).logits
        result["decode"] = dict(seconds, wall=time.perf_counter() - start)
    return result


def top_ops(run: Callable[[], object], row_limit: int = 12) -> list[dict]:
    """Run `run()` once under torch.profiler; the ops with the most self CPU time first.

    Each row: {"name", "calls", "self_cpu_ms", "share"} where share is of the profiled self CPU total.
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"name": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
             "share": e.self_cpu_time_total / total} for e in events[:row_limit]]
