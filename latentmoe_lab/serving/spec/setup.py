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


def check_engine_start(spec: SpeculativeSection, model, layout=None) -> Drafter | None:
    """Engine start, before any pool is allocated: the section's drafter (None when off), after checking that
    this model and layout can run it. The MTP drafter reads the target's hidden states, which only the
    in-process forward returns: with worker processes (layout not None) it is refused, naming the layout;
    the n-gram drafter needs only tokens and runs with every layout (ForwardBatch.spec_slots travels to
    the workers with the step)."""
    drafter = make_drafter(spec, model)
    if drafter is not None and drafter.name == "mtp" and layout is not None:
        raise ValueError(f"speculative.method: 'mtp' needs the target's hidden states in the engine's process, "
                         f"which the worker layout (tp={layout.tp}, ep={layout.ep}, pp={layout.pp}, "
                         "forward process or worker ranks) does not return; use method ngram there")
    return drafter
