"""The steps to trace: one prefill, one decode step, one training step or one serving-engine step as a callable.

Each factory does its set-up once (random prompt, cache, optimizer) and returns a no-argument callable
that runs one step, so `trace(fn, path)` can warm it up and record a single call:

    prefill_step(model, batch, prompt_len)    a fresh cache, the whole prompt in one forward
    decode_step(model, batch, prompt_len)     the prompt prefilled once; each call decodes one token for all rows
    train_step(model, batch, seq_len)         forward with labels, loss + router losses, backward, AdamW step
    engine_step(engine)                       Engine.step() (the engine, built by the caller, takes the model)
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def _prompt(model, batch: int, length: int, seed: int) -> torch.Tensor:
    if batch < 1 or length < 1:
        raise ValueError(f"batch and prompt/sequence length: need >= 1 each, got {batch} and {length}")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=generator)
    return ids.to(next(model.parameters()).device)


def prefill_step(model, batch: int, prompt_len: int, seed: int = 0) -> Callable[[], torch.Tensor]:
    """Each call: a new cache and one forward over ids [batch, prompt_len]; returns the last logits [batch, vocab]."""
    ids = _prompt(model, batch, prompt_len, seed)

    @torch.no_grad()
    def run() -> torch.Tensor:
        return model(ids, cache=model.new_cache()).logits[:, -1]

    return run


def decode_step(model, batch: int, prompt_len: int, seed: int = 0) -> Callable[[], torch.Tensor]:
    """Prefill ids [batch, prompt_len] once; each call feeds the greedy next token [batch, 1] (the cache grows)."""
    ids = _prompt(model, batch, prompt_len, seed)
    cache = model.new_cache()
    with torch.no_grad():
        state = {"next": model(ids, cache=cache).logits[:, -1:].argmax(-1)}

    @torch.no_grad()
    def run() -> torch.Tensor:
        logits = model(state["next"], cache=cache).logits
        state["next"] = logits[:, -1:].argmax(-1)
        return logits

    return run


def train_step(model, batch: int, seq_len: int, lr: float = 1e-4, seed: int = 0) -> Callable[[], float]:
    """Each call: loss = CE + aux on ids [batch, seq_len], backward, one AdamW step; returns the loss."""
    ids = _prompt(model, batch, seq_len, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()

    def run() -> float:
        optimizer.zero_grad(set_to_none=True)
        output = model(ids, labels=ids)
        loss = output.loss + output.aux_loss
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return run


def engine_step(engine) -> Callable[[], list]:
    """Each call: one Engine.step() (decodes of the running requests, then prefill chunks of waiting ones)."""
    if not hasattr(engine, "step") or not hasattr(engine, "has_unfinished"):
        raise TypeError(f"engine: expected a serving Engine, got {type(engine).__name__}")

    def run() -> list:
        if not engine.has_unfinished():
            raise ValueError("engine: no unfinished request left to step; add requests or lower the steps traced")
        return engine.step()

    return run
