"""How many drafts a sequence proposes this step: 0 .. K, from its own recent acceptance (docs/design.md §12).

Without `speculative.adaptive` every sequence drafts K (while its context is at most max_context). With it,
each sequence keeps a_i, an exponential moving average (weight ACCEPTANCE_WEIGHT per observation, starting
at 1: a new sequence drafts K) of the chance that draft i is accepted given drafts 1 .. i-1 were. A verify
step of d drafts of which j were accepted observes positions 1 .. min(j + 1, d): accepted up to j, rejected
at j + 1; the later positions were not judged and keep their estimates. Then, with E(k) = sum_{i<=k}
prod_{m<=i} a_m the expected accepted drafts and c = speculative.draft_cost the cost of one draft token
(its verify token in the target's forward and its share of drafting) in units of what a plain decode
step costs the sequence, k maximises the expected tokens per unit cost

    k = argmax_{0 <= k <= K} (1 + E(k)) / (1 + c k)        (ties: the smaller k; k = 0 scores 1)

so a draft runs only where its expected tokens beat its cost. A sequence at k = 0 is judged no more, so
after probe_interval steps in a row at 0 it drafts one token as a probe, whose verdict updates a_1.
A context longer than max_context drafts nothing (acceptance falls with context length). The state
lives per request id and survives preemption (a recompute continues with it); the engine drops it when
the request finishes. K depends on the request's own verify verdicts only, never on timing or on other
requests, so a seeded request's drafts (and draws) stay a function of its own tokens.
"""
from __future__ import annotations

from latentmoe_lab.serving.spec.section import SpeculativeSection

ACCEPTANCE_WEIGHT = 0.3  # the EMA's weight on the newest verdict: 5 rejections in a row take a_1 from 1 to 0.17


class DraftCount:
    def __init__(self, spec: SpeculativeSection):
        self.k = spec.num_speculative_tokens
        self.adaptive, self.max_context = bool(spec.adaptive), spec.max_context
        self.cost, self.probe_interval = spec.adaptive_settings
        self.acceptance: dict[int, list[float]] = {}  # request id -> a_1 .. a_K
        self.idle: dict[int, int] = {}  # request id -> steps in a row at k = 0

    def past_context(self, context: int) -> bool:
        """True when a sequence of `context` tokens drafts no more (max_context)."""
        return self.max_context is not None and context > self.max_context

    def choose(self, request_id: int, context: int) -> int:
        """Drafts for the request's next step, given `context` tokens (prompt + generated)."""
        if self.past_context(context):
            return 0
        if not self.adaptive:
            return self.k
        k = best_draft_count(self.acceptance.setdefault(request_id, [1.0] * self.k), self.cost)
        if k > 0:
            self.idle[request_id] = 0
            return k
        self.idle[request_id] = self.idle.get(request_id, 0) + 1
        if self.idle[request_id] >= self.probe_interval:
            self.idle[request_id] = 0
            return 1  # the probe
        return 0

    def observe(self, request_id: int, drafts: int, accepted: int) -> None:
        """A verify step of the request judged `drafts` drafts and accepted the first `accepted`."""
        if not self.adaptive or drafts == 0:
            return
        estimates = self.acceptance.setdefault(request_id, [1.0] * self.k)
        for position in range(min(accepted + 1, drafts)):
            verdict = 1.0 if position < accepted else 0.0
            estimates[position] += ACCEPTANCE_WEIGHT * (verdict - estimates[position])

    def forget(self, request_id: int) -> None:
        self.acceptance.pop(request_id, None)
        self.idle.pop(request_id, None)


def best_draft_count(acceptance: list[float], cost: float) -> int:
    """argmax over k = 0 .. len(acceptance) of (1 + E(k)) / (1 + cost k), the smallest k on ties."""
    best, best_score, expected, reach = 0, 1.0, 0.0, 1.0
    for k, rate in enumerate(acceptance, start=1):
        reach *= rate  # the chance that drafts 1 .. k are all accepted
        expected += reach
        score = (1.0 + expected) / (1.0 + cost * k)
        if score > best_score:
            best, best_score = k, score
    return best
