"""The engine's side of speculative decoding (docs/design.md §12): drafts in, verified tokens out, counters.

Per step, for the engine:

    engine.step()
      scheduler.schedule()       a decode with drafts becomes a verify entry: 1 + d tokens, d + 1 spec slots
      runner.run()               logits at every verify position (model_runner.verify_logit_rows), and with
                                 the mtp method every new token's hidden state
      Speculator.sample()        verify.py per sequence -> the emitted tokens, cut at a stop or max_tokens
      scheduler.finish_step()    slot of the last accepted token kept, rejected blocks freed (spec/slots.py)
      Speculator.after_step()    hidden rows handed on, drafts proposed for the next step, counters

A request proposes at most min(K, tokens it may still generate - 1) drafts: a step emits the accepted
drafts plus one, so it never overshoots max_tokens. The MTP drafter needs the target's hidden state at
every position of the request; after a prefix hit some were never computed, and that request then runs
without drafts (its tokens are the same, only slower).
"""
from __future__ import annotations

import torch

from latentmoe_lab.serving.sequence import Sequence, Status
from latentmoe_lab.serving.spec.drafters import DraftInput, Drafter
from latentmoe_lab.serving.spec.section import SpeculativeSection
from latentmoe_lab.serving.spec.verify import verify_drafts


class Speculator:
    def __init__(self, drafter: Drafter, spec: SpeculativeSection):
        self.drafter = drafter
        self.k = spec.num_speculative_tokens
        self.needs_hidden = drafter.name == "mtp"
        self.draft_tokens = 0  # drafts verified (vLLM: spec_decode_num_draft_tokens)
        self.accepted_tokens = 0  # of them accepted (spec_decode_num_accepted_tokens)
        self.accepted_per_position = [0] * self.k  # draft position i accepted (..._accepted_tokens_per_pos)
        self.drafts_per_position = [0] * self.k  # draft position i verified
        self.verify_steps = 0
        # request id -> (drafts, accepted) judged by this step's sampling; counted once the step succeeded
        # (after_step), dropped when it failed (the engine clears it before sampling a step)
        self.judged: dict[int, tuple[int, int]] = {}

    def forget(self, seq: Sequence) -> None:
        """A preempted or finished sequence: its drafts, hidden rows and the drafter's state go."""
        seq.draft_ids, seq.verify_slots, seq.pending_hidden, seq.hidden_rows = [], [], [], 0
        self.drafter.release(seq.request_id)

    def sample(self, seq: Sequence, rows: torch.Tensor) -> list[int]:
        """rows [1 + drafts, vocab]: the sequence's logits over its verify positions -> its emitted tokens
        (the accepted drafts and one more, cut after a stop token or at max_tokens)."""
        tokens = verify_drafts(rows, seq.draft_ids, seq.params, seq.generator, seq.generated_ids)
        if seq.draft_ids:
            self.judged[seq.request_id] = (len(seq.draft_ids), len(tokens) - 1)
        tokens = tokens[:max(1, seq.max_tokens - len(seq.generated_ids))]
        stop = next((i for i, t in enumerate(tokens) if t in seq.params.stop_token_ids), None)
        return tokens if stop is None else tokens[:stop + 1]

    def _count(self, drafts: int, accepted: int) -> None:
        self.verify_steps += 1
        self.draft_tokens += drafts
        self.accepted_tokens += accepted
        for position in range(drafts):
            self.drafts_per_position[position] += 1
            self.accepted_per_position[position] += position < accepted

    def after_step(self, entries: list[tuple[Sequence, int]], committed: list[int],
                   hidden: torch.Tensor | None) -> None:
        """committed[i]: how many of entry i's new tokens are now real (all of a chunk; of a verify step the
        last token and the accepted drafts); hidden [total, hidden] (mtp) in entry order. Hands each
        sequence's committed hidden rows on, then proposes drafts for the ones ready to decode."""
        for drafts, accepted in self.judged.values():
            self._count(drafts, accepted)
        self.judged.clear()
        start = 0
        for (seq, n), kept in zip(entries, committed):
            if self.needs_hidden and hidden is not None and seq.status is Status.RUNNING:
                seq.pending_hidden.append(hidden[start:start + kept])
                seq.hidden_rows += kept
            start += n
        for seq, _ in entries:
            if seq.status is Status.RUNNING and seq.num_remaining == 1 and not seq.draft_ids:
                seq.draft_ids = self._propose(seq)

    def _propose(self, seq: Sequence) -> list[int]:
        k = min(self.k, seq.max_tokens - len(seq.generated_ids) - 1)
        if k < 1:
            return []
        if not self.needs_hidden:
            return self.drafter.propose(seq.request_id, DraftInput(seq.token_ids), k)[:k]
        if seq.hidden_rows != seq.num_computed:  # a prefix hit skipped positions: no MTP input for them
            return []
        rows = torch.cat(seq.pending_hidden)
        seq.pending_hidden = []
        return self.drafter.propose(seq.request_id, DraftInput(seq.token_ids, rows), k)[:k]

    def stats(self) -> dict:
        """Engine.stats()'s spec_* entries (vLLM's spec_decode_* counters, /metrics; tokens per verify step)."""
        return {"spec_draft_tokens": self.draft_tokens, "spec_accepted_tokens": self.accepted_tokens,
                "spec_verify_steps": self.verify_steps,
                "spec_accepted_per_position": list(self.accepted_per_position),
                "spec_acceptance_rate_per_position": [a / d if d else 0.0 for a, d in
                                                      zip(self.accepted_per_position, self.drafts_per_position)],
                # tokens per verify step: accepted drafts + the one every step emits
                "spec_mean_accepted_length": (1 + self.accepted_tokens / self.verify_steps) if self.verify_steps
                else 0.0}


def spec_stats(speculator: Speculator | None) -> dict:
    """speculator.stats(), or the same keys at zero when speculative decoding is off."""
    if speculator is not None:
        return speculator.stats()
    return {"spec_draft_tokens": 0, "spec_accepted_tokens": 0, "spec_verify_steps": 0, "spec_accepted_per_position": [],
            "spec_acceptance_rate_per_position": [], "spec_mean_accepted_length": 0.0}
