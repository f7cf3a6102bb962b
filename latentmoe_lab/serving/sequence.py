"""Sequence: one request's tokens, cache holdings and clock readings, from arrival to its last token.

The one counter that drives everything is `num_computed`: how many of `token_ids` (prompt, then the
generated tokens) already sit in the paged pools. Each step feeds token_ids[num_computed : num_computed + n].
A prefill chunk is n > 1; a decode is the case where only the last sampled token is left (n = 1). When a
step reaches the end of token_ids the sequence samples its next token. A preempted sequence drops its
cache (num_computed = 0) and later recomputes prompt + generated tokens the same way.

Speculative decoding (docs/design.md §12): a decode may carry drafts, kept in draft_ids outside token_ids;
the step then feeds the last token and the drafts (scheduled_ids), and afterwards token_ids gains the
accepted drafts and one more token, num_computed the last token and the accepted drafts.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from latentmoe_lab.serving.logprobs import TokenLogprob
from latentmoe_lab.serving.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class ImageInputs:
    """The images of one prompt: patches [N, C*p*p], grids [I, 2], and a content hash per image."""

    pixel_values: torch.Tensor
    image_grids: torch.Tensor
    digests: list[bytes]
    spans: list[tuple[int, int]]  # half-open placeholder positions of each image in the prompt


@dataclass(eq=False)  # compared by identity: the queues hold the objects themselves
class Sequence:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    images: ImageInputs | None = None
    max_tokens: int | None = None  # params.max_tokens capped by the room left under max_model_len
    arrival_time: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.max_tokens is None:
            self.max_tokens = self.params.max_tokens
        self.token_ids: list[int] = list(self.prompt_ids)
        self.status = Status.WAITING
        self.num_computed = 0
        self.block_table: list[int] = []
        self.slot: int | None = None
        # speculative decoding (docs/design.md §12): K spare KDA slots held beside `slot`; the drafts to verify
        # next, kept outside token_ids; in a verify step, the slots receiving the state after each of its
        # tokens ([slot] + spares); the target's hidden rows not yet handed to the drafter, and how many of
        # this incarnation's positions have one (a prefix hit skips some: the MTP drafter then cannot run)
        self.spare_slots: list[int] = []
        self.draft_ids: list[int] = []
        self.verify_slots: list[int] = []
        self.pending_hidden: list[torch.Tensor] = []
        self.hidden_rows = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.num_registered = 0  # leading full blocks already offered to the prefix cache
        self.image_features: torch.Tensor | None = None  # [placeholders, hidden], computed once
        self.generator = torch.Generator()
        self.generator.manual_seed(self.params.seed if self.params.seed is not None else self.request_id)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0
        # after a failed step (docs/design.md §6.5): the isolation group it runs in, alone with its members,
        # until it has generated more than `isolated_until` tokens; and the failed steps it was retried after
        self.isolation_group: int | None = None
        self.isolated_until = 0
        self.step_retries = 0
        self.first_scheduled_time: float | None = None
        self.token_times: list[float] = []  # monotonic time each generated token was sampled
        self.finish_time: float | None = None
        self._block_hashes: list[bytes] = []
        # params.logprobs: one per generated token; params.prompt_logprobs: prompt tokens 1.. (kept across
        # preemptions: a recompute does not record a position twice)
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens not yet in the cache: the rest of the prompt, or the one last sampled token."""
        return len(self.token_ids) - self.num_computed

    @property
    def scheduled_ids(self) -> list[int]:
        """token_ids and then the drafts: what a step feeds from position num_computed on."""
        return self.token_ids + self.draft_ids if self.draft_ids else self.token_ids

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt positions whose logits are still to be computed (params.prompt_logprobs)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    @property
    def in_prefill(self) -> bool:
        return self.num_remaining > 1

    def block_hashes(self, num_blocks: int, block_size: int) -> list[bytes]:
        """Hash chain of the first `num_blocks` full blocks of token_ids (extends the memo as needed)."""
        while len(self._block_hashes) < num_blocks:
            index = len(self._block_hashes)
            start, end = index * block_size, (index + 1) * block_size
            digest = hashlib.blake2b(digest_size=16)
            digest.update(self._block_hashes[-1] if self._block_hashes else b"root")
            digest.update(torch.tensor(self.token_ids[start:end], dtype=torch.int64).numpy().tobytes())
            if self.images is not None:
                for (span_start, span_end), image_digest in zip(self.images.spans, self.images.digests):
                    if span_start < end and start < span_end:  # this image has placeholders in the block
                        digest.update(image_digest)
            self._block_hashes.append(digest.digest())
        return self._block_hashes[:num_blocks]

    def placeholders_before(self, position: int) -> int:
        """Image placeholder tokens of the prompt before `position`: the offset into image_features."""
        if self.images is None:
            return 0
        return sum(max(0, min(end, position) - start) for start, end in self.images.spans)


def image_digest(patches: torch.Tensor, grid: torch.Tensor) -> bytes:
    """Content hash of one image's patches [n, C*p*p] and grid [2]."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(grid.to(torch.int64).numpy().tobytes())
    digest.update(patches.detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.digest()
