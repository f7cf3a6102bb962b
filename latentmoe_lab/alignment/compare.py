"""compare(reference, candidate, inputs): every tap side by side, and the first divergence (docs/design.md §8).

    report = compare(model, cast_candidate(model, torch.bfloat16), input_ids)
    print(report.table())               # one row per tap, in forward order
    report.first_divergence             # the first row past a threshold, or None
    report.to_html("reports/align-bf16.html")

A candidate is either a module with the reference's structure (another dtype, another backend,
swapped layers), or any object with `record(inputs, subset) -> Recording` (a parallel layout that
runs in other processes and gathers its taps, see candidates.py).

Thresholds bound one metric each; a row diverges when any metric it has is past its bound, or when
the candidate holds inf / NaN there. The defaults separate "numerically close" from "broken" on the
tiny and small presets in fp32 vs bf16; pass your own for a stricter port.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from latentmoe_lab.alignment import metrics
from latentmoe_lab.alignment.taps import ExpertChoice, Recording, TapPoint, TokenSubset, record_taps

# metric -> (default bound, "max": the metric must stay <= bound | "min": >= bound)
THRESHOLDS: dict[str, tuple[float, str]] = {
    "rel_l2": (0.05, "max"),
    "routing_flips": (0.10, "max"),
    "kl_mean": (0.01, "max"),
    "cosine": (0.0, "min"),
    "sqnr_db": (-math.inf, "min"),
    "top1_agreement": (0.0, "min"),
    "max_abs": (math.inf, "max"),
    "rel_diff": (math.inf, "max"),
    "weight_max_abs": (math.inf, "max"),
    "kl_max": (math.inf, "max"),
}

# The values a metric can take where they are not [0, inf): bounds outside them are refused.
_METRIC_RANGES = {"cosine": (-1.0, 1.0), "top1_agreement": (0.0, 1.0), "routing_flips": (0.0, 1.0),
                  "sqnr_db": (-math.inf, math.inf)}


@dataclass
class TapRow:
    """One tap's comparison. Dense metrics are None on the experts tap; routing / logits fields are None
    elsewhere. max_abs_at: (row, token position in the input, feature) of the largest error.
    rel_l2_same_route (MoE FFN output): relative L2 over the tokens whose expert set did not flip. A flipped
    token gets other experts and an O(1) different output, so rel_l2 mixes arithmetic error with routing
    decisions; this column is the arithmetic part alone."""

    name: str
    kind: str
    layer: int | None
    shape: tuple[int, ...]
    nonfinite: int = 0
    cosine: float | None = None
    rel_l2: float | None = None
    rel_diff: float | None = None
    sqnr_db: float | None = None
    max_abs: float | None = None
    max_abs_at: tuple[int, ...] | None = None
    routing_flips: float | None = None
    weight_max_abs: float | None = None
    rel_l2_same_route: float | None = None
    kl_mean: float | None = None
    kl_max: float | None = None
    top1_agreement: float | None = None
    bpb_delta: float | None = None
    exceeded: tuple[str, ...] = ()

    @property
    def diverged(self) -> bool:
        return bool(self.exceeded)


def _resolve_thresholds(thresholds: Mapping[str, float] | None) -> dict[str, tuple[float, str]]:
    resolved = dict(THRESHOLDS)
    for name, bound in (thresholds or {}).items():
        if name not in THRESHOLDS:
            raise ValueError(f"thresholds: unknown metric {name!r}; known: {sorted(THRESHOLDS)}")
        if not isinstance(bound, (int, float)) or isinstance(bound, bool) or math.isnan(bound):
            raise ValueError(f"thresholds: {name} needs a number, got {bound!r}")
        low, high = _METRIC_RANGES.get(name, (0.0, math.inf))
        if not low <= bound <= high:  # a bound outside the metric's values would flag, or pass, every tap
            raise ValueError(f"thresholds: {name} takes values in [{low:g}, {high:g}], got {bound!r}")
        resolved[name] = (float(bound), THRESHOLDS[name][1])
    return resolved


def _exceeded(row: TapRow, thresholds: dict[str, tuple[float, str]]) -> tuple[str, ...]:
    out = ["nonfinite"] if row.nonfinite else []
    for name, (bound, direction) in thresholds.items():
        value = getattr(row, name)
        if value is None:
            continue
        if math.isnan(value) or (value > bound if direction == "max" else value < bound):
            out.append(name)
    return tuple(out)


def _input_ids(inputs) -> torch.Tensor:
    ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else inputs
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("inputs: expected input_ids [B, T] or a mapping of forward arguments with 'input_ids'")
    return ids


def record(model, inputs, subset: TokenSubset = TokenSubset()) -> Recording:
    """One forward of `model` (a module, or an object with .record) on inputs, with every tap recorded."""
    if not isinstance(model, nn.Module):
        if not callable(getattr(model, "record", None)):
            raise TypeError(f"model: expected an nn.Module or an object with record(inputs, subset), "
                            f"got {type(model).__name__}")
        return model.record(inputs, subset)
    _input_ids(inputs)
    with torch.no_grad(), record_taps(model, subset) as recording:
        model(**inputs) if isinstance(inputs, Mapping) else model(inputs)
    return recording


def compare_recordings(reference: Recording, candidate: Recording, input_ids: torch.Tensor | None = None,
                       thresholds: Mapping[str, float] | None = None, allow_missing: bool = False) -> list[TapRow]:
    """One TapRow per tap both recordings hold, in tap order. input_ids [B, T] give the bpb targets.
    allow_missing: the candidate stopped part way (its forward raised); compare the taps it reached."""
    bounds = _resolve_thresholds(thresholds)
    missing = [n for n in reference.names() if n not in candidate]
    if missing and not allow_missing:
        raise ValueError(f"candidate: did not record the taps {missing}")
    rows = [_row(p, reference, candidate, input_ids, bounds) for p in reference.points
            if p.name in reference and p.name in candidate]
    for row in rows:
        experts = f"layers.{row.layer}.moe.experts"
        same_tokens = all(n in reference and n in candidate and torch.equal(reference.positions[n], candidate.positions[n])
                          for n in (row.name, experts))
        if row.kind == "ffn" and same_tokens:
            row.rel_l2_same_route = _same_route_rel_l2(reference[row.name], candidate[row.name],
                                                       reference[experts], candidate[experts])
    return rows


def _same_route_rel_l2(ref: torch.Tensor, cand: torch.Tensor, ref_choice: ExpertChoice,
                       cand_choice: ExpertChoice) -> float | None:
    """rel L2 of an FFN output [B, t, hidden] over the tokens whose expert set is unchanged; None if none is."""
    if ref_choice.indices.shape[:2] != ref.shape[:2]:
        return None  # the two taps kept different tokens
    same = (ref_choice.indices.sort(-1).values == cand_choice.indices.sort(-1).values).all(-1)  # [B, t]
    return metrics.relative_l2(ref[same], cand[same]) if bool(same.any()) else None


def _row(point: TapPoint, reference: Recording, candidate: Recording, input_ids, bounds) -> TapRow:
    ref, cand = reference[point.name], candidate[point.name]
    positions = candidate.positions[point.name]
    if not torch.equal(positions, reference.positions[point.name]):
        ref = _at_positions(ref, reference.positions[point.name], positions, point.name)
    row = TapRow(point.name, point.kind, point.layer, tuple(ref.shape))
    if isinstance(ref, ExpertChoice):
        diff = metrics.routing_diff(ref, cand)
        row.routing_flips, row.weight_max_abs = diff.flip_rate, diff.weight_max_abs
        row.nonfinite = int((~torch.isfinite(cand.weights)).sum())
    else:
        row.nonfinite = int((~torch.isfinite(cand)).sum())
        row.cosine, row.rel_l2 = metrics.cosine(ref, cand), metrics.relative_l2(ref, cand)
        row.rel_diff, row.sqnr_db = metrics.rel_diff(ref, cand), metrics.sqnr_db(ref, cand)
        row.max_abs, at = metrics.max_abs_error(ref, cand)
        row.max_abs_at = (at[0], int(positions[at[1]]), *at[2:]) if len(at) >= 2 else at
        if point.kind == "logits":
            kl = metrics.kl_per_token(ref, cand)
            row.kl_mean, row.kl_max = float(kl.mean()), float(kl.max())
            row.top1_agreement = metrics.top1_agreement(ref, cand)
            row.bpb_delta = _bpb_delta(ref, cand, positions, input_ids)
    row.exceeded = _exceeded(row, bounds)
    return row


def _at_positions(value, kept: torch.Tensor, wanted: torch.Tensor, name: str):
    """The reference's tokens at the candidate's positions (the engine computes logits at chunk ends only)."""
    lookup = {int(p): i for i, p in enumerate(kept)}
    if any(int(p) not in lookup for p in wanted):
        raise ValueError(f"candidate: tap {name} holds token positions the reference did not keep")
    index = torch.tensor([lookup[int(p)] for p in wanted], dtype=torch.long)
    if isinstance(value, ExpertChoice):
        return ExpertChoice(value.indices[:, index], value.weights[:, index])
    return value[:, index]


def _bpb_delta(ref: torch.Tensor, cand: torch.Tensor, positions: torch.Tensor, input_ids) -> float | None:
    """Next-token bits-per-byte delta over the kept positions that have a next token in input_ids."""
    if input_ids is None:
        return None
    has_next = positions < input_ids.shape[1] - 1
    if not bool(has_next.any()):
        return None
    targets = input_ids.cpu()[:, positions[has_next] + 1]  # [B, t]
    return metrics.bpb_delta(ref[:, has_next], cand[:, has_next], targets)


@dataclass
class AlignmentReport:
    """rows: one TapRow per tap in forward order; thresholds: metric -> (bound, direction)."""

    rows: list[TapRow]
    thresholds: dict[str, tuple[float, str]]
    candidate_name: str = "candidate"
    candidate_error: str | None = None  # the candidate's forward raised this after the last row's tap

    @property
    def first_divergence(self) -> TapRow | None:
        return next((row for row in self.rows if row.diverged), None)

    def row(self, name: str) -> TapRow:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(f"no tap {name!r} in this report")

    def as_dicts(self) -> list[dict]:
        return [asdict(row) for row in self.rows]

    def summary(self) -> str:
        first = self.first_divergence
        logits = next((r for r in self.rows if r.kind == "logits"), None)
        moe = [r.routing_flips for r in self.rows if r.routing_flips is not None]
        lines = [f"alignment of {self.candidate_name} against the reference: {len(self.rows)} taps",
                 "first divergence: " + ("none (every tap within its thresholds)" if first is None else
                                         f"{first.name} ({', '.join(first.exceeded)})")]
        if self.candidate_error is not None:
            lines.append(f"the candidate's forward stopped after tap {self.rows[-1].name if self.rows else '(none)'}: "
                         f"{self.candidate_error}")
        if first is not None and first.rel_l2_same_route is not None:
            lines.append(f"  (its rel L2 on the tokens whose expert set did not flip: {first.rel_l2_same_route:.3e})")
        if logits is not None:
            lines.append(f"logits: KL mean {logits.kl_mean:.3e} nats, max {logits.kl_max:.3e}; top-1 agreement "
                         f"{logits.top1_agreement:.4f}; rel L2 {logits.rel_l2:.3e}"
                         + ("" if logits.bpb_delta is None else f"; bits/byte delta {logits.bpb_delta:+.3e}"))
        if moe:
            lines.append(f"routing flips per MoE layer: {', '.join(f'{f:.3f}' for f in moe)}")
        return "\n".join(lines)

    def table(self) -> str:
        """Fixed-width text: one line per tap; '!' marks rows past a threshold. w_err: max router weight error
        on unflipped tokens; l2_kept: rel_l2_same_route."""
        header = (f"{'tap':<28}{'cosine':>10}{'rel_l2':>10}{'rel_diff':>10}{'sqnr_dB':>9}{'max_abs':>10}"
                  f"  {'at (b, t, i)':<16}{'flips':>7}{'w_err':>9}{'l2_kept':>9}{'kl':>10}{'top1':>7}")
        lines = [header, "-" * len(header)]
        for r in self.rows:
            at = "" if r.max_abs_at is None else str(tuple(r.max_abs_at))
            lines.append(f"{('! ' if r.diverged else '  ') + r.name:<28}{_fmt(r.cosine, '.6f'):>10}"
                         f"{_fmt(r.rel_l2):>10}{_fmt(r.rel_diff):>10}{_fmt(r.sqnr_db, '.1f'):>9}"
                         f"{_fmt(r.max_abs):>10}  {at:<16}{_fmt(r.routing_flips, '.3f'):>7}"
                         f"{_fmt(r.weight_max_abs):>9}{_fmt(r.rel_l2_same_route):>9}{_fmt(r.kl_mean):>10}"
                         f"{_fmt(r.top1_agreement, '.3f'):>7}")
        return "\n".join(lines)

    def figure(self):
        from latentmoe_lab.viz.alignment import alignment_figure

        return alignment_figure(self.as_dicts(), title=f"Alignment of {self.candidate_name}",
                                first_divergence=None if self.first_divergence is None else self.first_divergence.name)

    def to_html(self, path: str | Path, extra: Sequence[str] = ()) -> Path:
        """Summary, thresholds, table, `extra` text blocks (e.g. a bisection table), then the figure."""
        from latentmoe_lab.report import write_html_report

        bounds = ", ".join(f"{k} {'<=' if d == 'max' else '>='} {v:g}" for k, (v, d) in self.thresholds.items()
                           if math.isfinite(v) and not (d == "min" and v == 0.0))
        return write_html_report(path, f"Alignment: {self.candidate_name}",
                                 [self.summary() + f"\nthresholds: {bounds}", self.table(), *extra, self.figure()])


def _fmt(value: float | None, spec: str = ".2e") -> str:
    return "" if value is None else format(value, spec)


def compare(reference, candidate, inputs, thresholds: Mapping[str, float] | None = None,
            subset: TokenSubset = TokenSubset(), name: str | None = None) -> AlignmentReport:
    """Run reference and candidate on the same inputs (input_ids [B, T] or a mapping of forward arguments)
    with every tap recorded on `subset`, and compare tap by tap. thresholds: metric -> bound, merged
    into THRESHOLDS ("max" metrics must stay <= bound, "min" metrics >= bound)."""
    bounds = _resolve_thresholds(thresholds)
    ref_rec = record(reference, inputs, subset)
    cand_rec, failure = _record_candidate(candidate, inputs, subset)
    rows = compare_recordings(ref_rec, cand_rec, _input_ids(inputs), thresholds, allow_missing=failure is not None)
    label = name or getattr(candidate, "name", None) or type(candidate).__name__
    return AlignmentReport(rows, bounds, label if isinstance(label, str) else type(candidate).__name__, failure)


def _record_candidate(candidate, inputs, subset: TokenSubset) -> tuple[Recording, str | None]:
    """record(candidate), but a module whose forward raises part way keeps the taps it reached.

    The reference already ran on the same inputs, so an error here is the candidate's: a NaN that the
    router refuses, say. The report then shows where the values went bad instead of a traceback.
    """
    if not isinstance(candidate, nn.Module):
        return record(candidate, inputs, subset), None
    recording = None
    try:
        with torch.no_grad(), record_taps(candidate, subset) as recording:
            candidate(**inputs) if isinstance(inputs, Mapping) else candidate(inputs)
    except (ValueError, RuntimeError, FloatingPointError) as error:
        if recording is None:
            raise
        return recording, f"{type(error).__name__}: {error}"
    return recording, None

