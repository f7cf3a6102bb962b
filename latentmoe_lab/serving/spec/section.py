"""The service file's `speculative:` section (serving/config.py lists its keys; docs/design.md §12)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from latentmoe_lab.config_fields import describe

SPEC_METHODS = ("ngram", "mtp")
MAX_SPECULATIVE_TOKENS = 8


@dataclass
class SpeculativeSection:
    method: str | None = None  # None: off
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def lookup_range(self) -> tuple[int, int]:
        """(prompt_lookup_min, prompt_lookup_max) of the n-gram drafter, defaults filled in."""
        low = 1 if self.prompt_lookup_min is None else self.prompt_lookup_min
        return low, max(4, low) if self.prompt_lookup_max is None else self.prompt_lookup_max


def check_speculative(spec: SpeculativeSection) -> None:
    """The speculative: section on its own; what needs the model (an MTP head) is checked at engine start."""
    if spec.method is None:
        given = [key for key, value in asdict(spec).items() if value is not None]
        _check(not given, "speculative.method", f"required when the section sets {given[0] if given else ''} "
               f"(one of {list(SPEC_METHODS)}; leave the section out for no speculative decoding)")
        return
    _choice("speculative.method", spec.method, SPEC_METHODS)
    k = spec.num_speculative_tokens
    _check(k is not None, "speculative.num_speculative_tokens", f"required with speculative.method "
           f"(draft tokens per step, 1..{MAX_SPECULATIVE_TOKENS})")
    _check(1 <= k <= MAX_SPECULATIVE_TOKENS, "speculative.num_speculative_tokens",
           f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {describe(k)}")
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        value = getattr(spec, key)
        _check(value is None or spec.method == "ngram", f"speculative.{key}",
               f"only with method ngram (the method is {spec.method})")
        _check(value is None or value >= 1, f"speculative.{key}", f"must be an integer >= 1, got {describe(value)}")
    low, high = spec.lookup_range
    _check(low <= high, "speculative.prompt_lookup_max",
           f"({high}) must be >= speculative.prompt_lookup_min ({low})")


def _check(ok: bool, path: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"{path}: {rule}")


def _choice(path: str, value: Any, choices: tuple[str, ...]) -> None:
    _check(value in choices, path, f"must be one of {list(choices)}, got {describe(value)}")
