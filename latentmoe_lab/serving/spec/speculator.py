"""The engine's side of speculative decoding (docs/design.md §12): drafts in, verified tokens out, counters.

Per step, for the engine:

    engine.step()
      scheduler.schedule()       a decode with drafts becomes a verify entry: 1 + d tokens, d + 1 spec slots
      runner.run()               logits at every verify position (model_runner.verify_logit_rows), and with
                                 the mtp method every new token's hidden state
      Speculator.sample()        verify.py per sequence -> the emitted tokens, cut at a stop or max_tokens
      scheduler.finish_step()    slot of the last accepted token kept, rejected blocks freed (spec/slots.py)
      Speculator.after_step()    hidden rows handed on, drafts proposed for the next step, counters

A request proposes at most min(k, tokens it may still generate - 1) drafts, k = K or, with
speculative.adaptive, what its own acceptance is worth (spec/draft_count.py; 0 past max_context): a step
emits the accepted drafts plus one, so it never overshoots max_tokens. The step's drafting requests go to
the drafter together (propose_batch: the MTP head runs once per depth for all of them). The MTP drafter
needs the target's hidden state at the positions it drafts from; after a prefix hit, a spill restore or an
import from a prefill instance the request has the row of the position before its first computed one,
kept with the KDA slot it resumed from (spec/hidden_rows.py), and its drafter starts there.

What a request's tokens depend on. Greedy: the prompt, the params and the weights, drafts or not (each
emitted token is the target's pick). Sampled with a seed: the seed, the prompt, the params, the method and K
and the logits, never on what the engine served before. So its first token is never drafted (a plain draw,
as a P/D prefill instance makes it before the hand-over), and with mtp none is: MTP drafts hang on the
hidden rows the drafter holds, which start where a prefix hit, an import or a preemption left the request.
ngram drafts from the tokens alone, so a seeded request's drafts, and with them its draws, are the same
wherever it runs. The logits are bit-identical across batch compositions, chunks and prefix hits under
scheduler.batch_invariant (docs/design.md §6.5); without it float rounding may, rarely, tip a draw.
Sampled without a seed: drafted throughout, each token distributed as the target's sampling gives it,
reproducible by nobody.
"""
from __future__ import annotations

import torch

from latentmoe_lab.serving.sequence import Sequence, Status
from latentmoe_lab.serving.spec.draft_count import DraftCount
from latentmoe_lab.serving.spec.drafters import DraftInput, Drafter
from latentmoe_lab.serving.spec.section import SpeculativeSection
from latentmoe_lab.serving.spec.verify import verify_drafts


class Speculator:
    def __init__(self, drafter: Drafter, spec: SpeculativeSection):
        self.drafter = drafter
        self.k = spec.num_speculative_tokens
        self.draft_count = DraftCount(spec)  # this step's k per sequence (spec/draft_count.py)
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
        if seq.status is Status.FINISHED:  # a preempted one keeps its acceptance record for its recompute
            self.draft_count.forget(seq.request_id)

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
        for seq, _ in entries:  # the same counts per request (RequestMetrics.spec_accepted_tokens)
            drafts, accepted = self.judged.get(seq.request_id, (0, 0))
            seq.spec_draft_tokens += drafts
            seq.spec_accepted_tokens += accepted
            if seq.status is not Status.FINISHED:  # a finished one was forgotten already (finish_step)
                self.draft_count.observe(seq.request_id, drafts, accepted)
        self.judged.clear()
        start = 0
        for (seq, n), kept in zip(entries, committed):
            if self.needs_hidden and hidden is not None and seq.status is Status.RUNNING:
                if self.draft_count.past_context(len(seq.token_ids)):  # it drafts no more: its MTP rows go
                    seq.pending_hidden, seq.hidden_rows = [], 0
                    self.drafter.release(seq.request_id)
                else:
                    seq.pending_hidden.append(hidden[start:start + kept])
                    seq.hidden_rows += kept
            start += n
        self._propose([seq for seq, _ in entries])

    def take_restored_row(self, seq: Sequence, row: torch.Tensor | None) -> None:
        """row [hidden]: the target's hidden row at position num_computed - 1, kept with the KDA slot row a
        sequence resumed from (a prefix hit, a spill restore, an import; spec/hidden_rows.py), or None. A
        sequence with no rows of its own yet starts its MTP history there; any other ignores it."""
        if (self.needs_hidden and row is not None and seq.hidden_rows == 0 and seq.num_computed > 0
                and not self.draft_count.past_context(len(seq.token_ids))):
            seq.pending_hidden, seq.hidden_rows = [row[None]], 1

    def start_imported(self, seq: Sequence, row: torch.Tensor | None) -> None:
        """A sequence a transfer entered as running, ready to decode its first token (transport/transfer.py):
        its carried hidden row taken, its drafts proposed now, so its first step verifies them as a colocated
        request's would."""
        self.take_restored_row(seq, row)
        self._propose([seq])

    def _propose(self, seqs: list[Sequence]) -> None:
        """Drafts for every sequence ready to decode, in one propose_batch."""
        asking, requests = [], []
        for seq in seqs:
            if seq.status is Status.RUNNING and seq.num_remaining == 1 and not seq.draft_ids:
                request = self._draft_request(seq)
                if request is not None:
                    asking.append(seq)
                    requests.append(request)
        if requests:
            for seq, (_, _, k), drafts in zip(asking, requests, self.drafter.propose_batch(requests)):
                seq.draft_ids = drafts[:k]

    def _draft_request(self, seq: Sequence) -> tuple[int, DraftInput, int] | None:
        """(request_id, DraftInput, k) for the drafter, or None: no drafts for this sequence this step. The
        MTP input starts at the first position the sequence has a hidden row for (0, or the row before a
        hit): its tokens from there and the rows not yet handed over."""
        k = min(self.draft_count.choose(seq.request_id, len(seq.token_ids)),
                seq.max_tokens - len(seq.generated_ids) - 1)
        if k < 1:
            return None
        if seq.params.seed is not None and not seq.params.greedy and (self.needs_hidden or not seq.generated_ids):
            return None  # a seeded sample's draws must not hang on the drafter's state (see the module docstring)
        if not self.needs_hidden:
            return seq.request_id, DraftInput(seq.token_ids), k
        if seq.hidden_rows == 0:  # resumed from a slot row without a hidden row: none computed here yet
            return None
        rows = torch.cat(seq.pending_hidden)
        seq.pending_hidden = []
        return seq.request_id, DraftInput(seq.token_ids[seq.num_computed - seq.hidden_rows:], rows), k

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
