"""A step's logits -> each emitting request's new tokens (docs/design.md §6.5, §12): the sampling half of
Engine.step, after the forward.

Each request samples with its own generator (sampling.py), one token, or after a verify step the accepted
drafts and one more (spec/speculator.py). A row that is not finite fails its request alone. A failure part
way puts every generator back as it was, so the recompute samples the very same tokens again.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from latentmoe_lab.finite import first_non_finite
from latentmoe_lab.serving.logprobs import token_logprobs
from latentmoe_lab.serving.model_runner import record_prompt_logprobs, verify_logit_rows
from latentmoe_lab.serving.sampling import sample_token
from latentmoe_lab.serving.sequence import Sequence


def sample_step(batch, output, speculator, layer_types: list[str],
                fail: Callable[[Sequence, str], None]) -> dict[int, list[int]]:
    """request id -> its new tokens, for the entries of `batch` that emit; fail(seq, message) ends a request
    whose logits are not finite. output: the runner's (.logits [S + P + D, vocab], .finite); speculator: the
    engine's Speculator or None; layer_types: the model's, to name the first non-finite stage."""
    sampled, new_logprobs = {}, []
    logits = output.logits.float()  # S sampling rows, then prompt and verify positions (model_runner.py)
    rows_of = verify_logit_rows(batch)
    if speculator is not None:
        speculator.judged.clear()  # a failed step's verdicts are not counted
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    record_prompt_logprobs(batch, output.logits[len(batch.entries):])
    # a failure part way must not leave some generators advanced: the recompute samples again
    states = [(seq.generator, seq.generator.get_state()) for (seq, _), emits in zip(batch.entries, batch.emits())
              if emits]
    try:
        for index, ((seq, _), emits) in enumerate(zip(batch.entries, batch.emits())):
            rows = rows_of.get(index, [index])
            if not all(finite[r] for r in rows):
                where = first_non_finite(getattr(output, "finite", None), layer_types)
                fail(seq, f"logits: non-finite for this request (first non-finite at {where}); the other "
                          f"requests go on")
            elif emits and seq.max_tokens > 0:
                tokens = sampled[seq.request_id] = (
                    [sample_token(logits[index], seq.params, seq.generator, seq.generated_ids)]
                    if speculator is None else speculator.sample(seq, logits[rows]))
                if seq.params.logprobs is not None:
                    new_logprobs.append((seq, token_logprobs(logits[rows[:len(tokens)]], tokens,
                                                             seq.params.logprobs)))
    except Exception:
        for generator, state in states:
            generator.set_state(state)
        raise
    for seq, logprobs in new_logprobs:  # only once every row sampled: a retried step appends nothing twice
        seq.logprobs += logprobs
    return sampled
