"""The prompts `latentmoe-lab verify` sends: built to walk every state-moving path a service file turns on.

Three waves, each submitted whole (so requests share steps, compete for the cache and get preempted):

    cold    a shared system prefix ending INSIDE a block, then per-request text; one prompt ending exactly on
            a block edge; one longer than a prefill chunk (chunked prefill); repetitive text, where the n-gram
            drafter's drafts are accepted, beside random text, where they are rejected
    warm    the cold prompts cut at split points (inside a block and on block edges) and continued with new
            text: prefix hits on the cold wave's blocks and KDA snapshots, then a tail to compute
    revisit the cold prompts again, after the engine dropped its device prefix cache: with spill tiers on,
            their hits come back from host or disk

Every prompt fits in model.max_model_len with `max_tokens` to generate. Token ids avoid the vision tower's
special ids (the processor's placeholders), so a prompt is plain text for every model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

WAVES = ("cold", "warm", "revisit")


@dataclass(frozen=True)
class VerifyPrompt:
    """One request of the workload: its wave, its token ids, and why it is there."""

    wave: str
    token_ids: list[int]
    purpose: str


def build_workload(num_prompts: int, vocab_size: int, block_size: int, chunk_size: int, max_prompt_len: int,
                   seed: int, text_vocab: int | None = None) -> list[VerifyPrompt]:
    """num_prompts cold prompts (>= 4), as many warm ones, and the cold ones again as the revisit wave.

    block_size: the paged cache's block (memory.block_size); chunk_size: the step's prefill budget
    (scheduler.prefill_chunk_size); max_prompt_len: the longest prompt allowed (max_model_len - max_tokens).
    text_vocab: draw ids below this (default: min(vocab_size, 256), the byte range of the byte tokenizer).
    """
    if num_prompts < 4:
        raise ValueError(f"num_prompts: must be >= 4 (one prompt per kind of cold prompt), got {num_prompts}")
    if max_prompt_len < 2 * block_size + 2:
        raise ValueError(f"max_prompt_len: {max_prompt_len} leaves no room for a prefix of two blocks "
                         f"(block_size {block_size}); raise model.max_model_len")
    g = torch.Generator().manual_seed(seed)
    high = min(vocab_size, 256) if text_vocab is None else text_vocab

    def text(n: int) -> list[int]:
        return torch.randint(1, high, (n,), generator=g).tolist()

    system_len = min(2 * block_size + block_size // 2 + 1, max_prompt_len - 4)  # ends inside block 3
    system = text(system_len)
    long_len = min(max(chunk_size + block_size + 3, 3 * block_size + 5), max_prompt_len)
    motif = text(5)
    cold = [VerifyPrompt("cold", system + text(3), "shared prefix, split inside a block"),
            VerifyPrompt("cold", text(2 * block_size), "ends on a block edge"),
            VerifyPrompt("cold", text(long_len), "longer than a prefill chunk"),
            VerifyPrompt("cold", (motif * (max_prompt_len // 5))[:min(4 * block_size, max_prompt_len)],
                         "repetitive text (accepted n-gram drafts)")]
    while len(cold) < num_prompts:
        extra = int(torch.randint(1, max(2, min(2 * block_size, max_prompt_len - system_len)), (1,), generator=g))
        cold.append(VerifyPrompt("cold", system + text(extra), "shared prefix, per-request text"))
    warm = []
    for i, prompt in enumerate(cold):
        ids = prompt.token_ids
        cuts = [block_size, len(ids) // 2, len(ids) - 1, 2 * block_size]
        cut = max(1, min(cuts[i % len(cuts)], len(ids)))
        tail = text(int(torch.randint(1, block_size + 2, (1,), generator=g)))
        warm.append(VerifyPrompt("warm", (ids[:cut] + tail)[:max_prompt_len],
                                 f"prefix of a cold prompt cut at {cut}, new tail"))
    revisit = [VerifyPrompt("revisit", p.token_ids, "cold prompt again, device prefix cache dropped") for p in cold]
    return cold + warm + revisit


def long_prompts(count: int, length: int, workload: list[VerifyPrompt]) -> list[VerifyPrompt]:
    """`count` prompts of `length` tokens for the tight-cache pass (two of them cannot both fit there): each is
    a cold prompt repeated and cut, so they share prefixes with the workload and add no new randomness."""
    cold = [p.token_ids for p in workload if p.wave == "cold"]
    return [VerifyPrompt("cold", (cold[i % len(cold)] * (length // len(cold[i % len(cold)]) + 1))[:length],
                         "as long as the tight cache holds") for i in range(count)]
