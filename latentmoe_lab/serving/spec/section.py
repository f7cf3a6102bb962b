"""The service file's `speculative:` section (serving/config.py lists its keys; docs/design.md §12)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from latentmoe_lab.config_fields import check, check_choice, describe

SPEC_METHODS = ("ngram", "mtp")
MAX_SPECULATIVE_TOKENS = 8
# one draft token's cost in plain decode steps of its sequence: from the quiet-machine rows of
# benchmarks/RESULTS.md (ngram, K = 3, 2.59 tokens per verify step) read as speed-up = 2.59 / (1 + 3c):
# c = 0.16 at batch 1 (1.77x) and 0.36 at batch 8 (1.25x), one thread; 0.25 lies between
DEFAULT_DRAFT_COST = 0.25
DEFAULT_PROBE_INTERVAL = 8


@dataclass
class SpeculativeSection:
    method: str | None = None  # None: off
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    adaptive: bool | None = None  # K per sequence from its acceptance (spec/draft_count.py); default: always K
    draft_cost: float | None = None  # with adaptive: a draft token's cost / a plain decode's (DEFAULT_DRAFT_COST)
    probe_interval: int | None = None  # with adaptive: steps at K = 0 before a 1-draft probe (DEFAULT_PROBE_INTERVAL)
    max_context: int | None = None  # no drafts for a sequence past this many tokens (default: no limit)
    enabled: bool = True  # false: the section stays, off; a section that sets nothing else is off too

    def __post_init__(self) -> None:
        if self.enabled is True and self.method is None and not keys_given(self):
            self.enabled = False

    @property
    def lookup_range(self) -> tuple[int, int]:
        """(prompt_lookup_min, prompt_lookup_max) of the n-gram drafter, defaults filled in."""
        low = 1 if self.prompt_lookup_min is None else self.prompt_lookup_min
        return low, max(4, low) if self.prompt_lookup_max is None else self.prompt_lookup_max

    @property
    def adaptive_settings(self) -> tuple[float, int]:
        """(draft_cost, probe_interval) of the adaptive draft count, defaults filled in."""
        return (DEFAULT_DRAFT_COST if self.draft_cost is None else self.draft_cost,
                DEFAULT_PROBE_INTERVAL if self.probe_interval is None else self.probe_interval)


def check_speculative(spec: SpeculativeSection) -> None:
    """The speculative: section on its own (its keys' types checked; nothing more when it is off); what needs the
    model (an MTP head) is checked at engine start."""
    if not spec.enabled:
        return
    check(spec.method is not None, "speculative.method", f"required when the section sets "
          f"{(keys_given(spec) or [''])[0]} (one of {list(SPEC_METHODS)}; leave the section out for no speculative "
          f"decoding)")
    check_choice("speculative.method", spec.method, SPEC_METHODS)
    k = spec.num_speculative_tokens
    check(k is not None, "speculative.num_speculative_tokens", f"required with speculative.method "
          f"(draft tokens per step, 1..{MAX_SPECULATIVE_TOKENS})")
    check(1 <= k <= MAX_SPECULATIVE_TOKENS, "speculative.num_speculative_tokens",
          f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {describe(k)}")
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        check(getattr(spec, key) is None or spec.method == "ngram", f"speculative.{key}",
              f"only with method ngram (the method is {spec.method})")
    for key in ("draft_cost", "probe_interval"):
        check(getattr(spec, key) is None or spec.adaptive, f"speculative.{key}", "only with speculative.adaptive: true")
    check(spec.draft_cost is None or 0 < spec.draft_cost <= 10, "speculative.draft_cost",
          f"must be a number in (0, 10] (a draft token's cost in plain decode steps), got {describe(spec.draft_cost)}")
    for key in ("prompt_lookup_min", "prompt_lookup_max", "probe_interval", "max_context"):
        value = getattr(spec, key)
        check(value is None or value >= 1, f"speculative.{key}", f"must be an integer >= 1, got {describe(value)}")
    low, high = spec.lookup_range
    check(low <= high, "speculative.prompt_lookup_max",
          f"({high}) must be >= speculative.prompt_lookup_min ({low})")


def keys_given(spec: SpeculativeSection) -> list[str]:
    """The keys the section sets besides `enabled`."""
    return [key for key, value in asdict(spec).items() if value is not None and key != "enabled"]
