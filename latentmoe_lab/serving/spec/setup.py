"""From the service file's `speculative:` section to a drafter, checked when the engine starts."""
from __future__ import annotations

from latentmoe_lab.serving.spec.drafters import Drafter, NgramDrafter
from latentmoe_lab.serving.spec.mtp_batched import BatchedMTPDrafter
from latentmoe_lab.serving.spec.section import SpeculativeSection


def make_drafter(spec: SpeculativeSection, model) -> Drafter | None:
    """The section's drafter, None when it is off. mtp on a model without an MTP head: ValueError naming
    speculative.method. Allocates next to nothing (the batched MTP drafter's pools start at 16 blocks
    and grow with the requests it serves), so the engine calls it before any pool. Both drafters run with
    every layout: ngram reads tokens alone, and the MTP head runs on the engine's copy of the model, fed
    with the hidden rows that the in-process runner or the worker group's answer rank returns
    (ForwardBatch.hidden_index)."""
    if not spec.enabled:
        return None
    if spec.method == "ngram":
        return NgramDrafter(*spec.lookup_range)
    return BatchedMTPDrafter(model)
