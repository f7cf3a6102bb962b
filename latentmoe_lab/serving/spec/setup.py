"""From the service file's `speculative:` section to a drafter, and what the engine accepts at start."""
from __future__ import annotations

from latentmoe_lab.serving.spec.drafters import Drafter, NgramDrafter
from latentmoe_lab.serving.spec.mtp_drafter import MTPDrafter
from latentmoe_lab.serving.spec.section import SpeculativeSection


def make_drafter(spec: SpeculativeSection, model) -> Drafter | None:
    """The section's drafter, None when it is off. mtp on a model without an MTP head: ValueError naming
    speculative.method. Allocates nothing (the MTP drafter's caches grow per request)."""
    if not spec.enabled:
        return None
    if spec.method == "ngram":
        return NgramDrafter(*spec.lookup_range)
    return MTPDrafter(model)


def check_engine_start(spec: SpeculativeSection, model) -> None:
    """Engine start, before any pool is allocated: the section must name a drafter this model can run, and
    the engine does not verify drafts yet, so an enabled section is refused rather than silently ignored."""
    if make_drafter(spec, model) is not None:
        raise ValueError(f"speculative: method {spec.method!r} is not implemented yet in the engine (drafters "
                         "exist, the verify step does not); leave the speculative section out")
