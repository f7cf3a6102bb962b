"""Compare the engine's outputs with the reference path and lay the result out per state-moving path.

A request is compared token for token with the reference's greedy tokens, and its logprobs with the
reference's full-forward logprobs up to the first divergent token. It counts towards every path it walked
(evidence from the engine's own records: prefix_hit_tokens, preemptions, chunk count, drafts, transfers),
so a divergence shows in the rows of the paths the request took; the verdict names the most specific one.

    PathRow(path, requests, tokens, max_gap, failures)       one line of the table
    Divergence(request, wave, path, token_index, ...)        the first request that differs
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

# the engine's own mechanisms, possible under any file: reported, but a workload that did not reach one (a cache
# too large to preempt even in the tight pass) leaves it UNTESTED without failing; every other path is one the
# file turns on, and verify fails when no request walked it
ALWAYS_POSSIBLE = ("batching", "chunked prefill", "preemption")
# most specific first: the path named for a divergent request is the first of these it walked
PATHS = ("p/d import", "tier restore", "prefix hit", "expert migration", "spec verify", "preemption",
         "offload swap-in", "chunked prefill", "worker layout", "batching")


@dataclass
class RequestResult:
    """One request's comparison. paths: the state-moving paths it walked (names from PATHS)."""

    index: int
    wave: str
    paths: list[str]
    tokens: list[int]
    reference_tokens: list[int]
    logprobs: list[float]
    reference_logprobs: list[float]
    error: str | None = None

    @property
    def first_divergent_token(self) -> int | None:
        """Index of the first generated token that differs (or is missing), None when all are equal."""
        for i, expected in enumerate(self.reference_tokens):
            if i >= len(self.tokens) or self.tokens[i] != expected:
                return i
        return None if len(self.tokens) == len(self.reference_tokens) else len(self.reference_tokens)

    def max_gap(self) -> float:
        """Largest |logprob - reference logprob| over the tokens both agree on (inf when a value is missing)."""
        upto = self.first_divergent_token
        upto = len(self.reference_tokens) if upto is None else upto
        if len(self.logprobs) < upto:
            return math.inf
        gaps = [abs(a - b) for a, b in zip(self.logprobs[:upto], self.reference_logprobs[:upto])]
        return max(gaps, default=0.0)

    def passed(self, tolerance: float) -> bool:
        return self.error is None and self.first_divergent_token is None and self.max_gap() <= tolerance


@dataclass
class PathRow:
    path: str
    requests: int = 0
    tokens: int = 0
    max_gap: float = 0.0
    failures: int = 0

    @property
    def verdict(self) -> str:
        """PASS, FAIL, or UNTESTED: the file turns the path on but no request walked it (nothing is proven)."""
        if self.requests == 0:
            return "UNTESTED"
        return "PASS" if self.failures == 0 else "FAIL"


@dataclass
class Divergence:
    """The first request that differs from the reference, and where."""

    request: int
    wave: str
    path: str
    token_index: int | None
    detail: str
    layer: str | None = None  # the first divergent alignment tap, when it could be found


@dataclass
class VerifyReport:
    config: str
    tolerance: float
    mode: str
    rows: list[PathRow] = field(default_factory=list)
    divergence: Divergence | None = None
    injection: str | None = None

    @property
    def passed(self) -> bool:
        return self.divergence is None and all(row.verdict == "PASS" or (row.verdict == "UNTESTED" and
                                                                          row.path in ALWAYS_POSSIBLE)
                                               for row in self.rows)

    def table(self) -> str:
        lines = [f"verify {self.config}: {self.mode}, logprob tolerance {self.tolerance:g}"
                 + (f", injected: {self.injection}" if self.injection else ""),
                 f"{'path':<18}{'requests':>9}{'tokens':>8}{'max |dlogp|':>13}  verdict"]
        for row in self.rows:
            lines.append(f"{row.path:<18}{row.requests:>9}{row.tokens:>8}{row.max_gap:>13.2e}  {row.verdict}")
        if self.divergence is not None:
            d = self.divergence
            where = "" if d.token_index is None else f" at generated token {d.token_index}"
            layer = f"; first divergent layer: {d.layer}" if d.layer else ""
            lines.append(f"FIRST DIVERGENCE: request {d.request} ({d.wave} wave), path {d.path}{where}: "
                         f"{d.detail}{layer}")
        untested = [row.path for row in self.rows if row.verdict == "UNTESTED"]
        if untested:
            lines.append(f"not exercised by the workload: {', '.join(untested)} (raise --prompts; only a path "
                         f"the file turns on fails the run)")
        lines.append("all paths equal the reference" if self.passed else "verify FAILED")
        return "\n".join(lines)

    def to_json(self) -> str:
        body = asdict(self) | {"passed": self.passed}
        body["rows"] = [asdict(r) | {"verdict": r.verdict} for r in self.rows]
        return json.dumps(body, indent=2, default=lambda v: None if isinstance(v, float) and math.isinf(v) else v)


def build_report(results: list[RequestResult], paths_on: list[str], tolerance: float, config: str, mode: str,
                 injection: str | None = None) -> VerifyReport:
    """Rows for every path the file turns on (in PATHS order); the first failing request as the divergence."""
    rows = {p: PathRow(p) for p in PATHS if p in paths_on}
    divergence = None
    for result in results:
        ok = result.passed(tolerance)
        compared = result.first_divergent_token
        compared = len(result.reference_tokens) if compared is None else compared
        for path in result.paths:
            if path not in rows:
                continue
            row = rows[path]
            row.requests += 1
            row.tokens += compared
            row.max_gap = max(row.max_gap, result.max_gap())
            row.failures += not ok
        if not ok and divergence is None:
            path = next((p for p in PATHS if p in result.paths), "batching")
            divergence = Divergence(result.index, result.wave, path, result.first_divergent_token,
                                    _detail(result, tolerance))
    return VerifyReport(config, tolerance, mode, list(rows.values()), divergence, injection)


def _detail(result: RequestResult, tolerance: float) -> str:
    if result.error is not None:
        return f"the engine failed the request: {result.error}"
    i = result.first_divergent_token
    if i is not None:
        got = result.tokens[i] if i < len(result.tokens) else "nothing"
        return f"token {got} where the reference has {result.reference_tokens[i]}"
    return f"logprob gap {result.max_gap():.3e} > tolerance {tolerance:g}"
