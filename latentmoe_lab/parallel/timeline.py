"""Per-rank timelines of a parallel forward: when each rank computes and when it communicates.

    timelines = record_timelines(ParallelConfig(ep=2, tp=2))     # 4 local processes, one forward
    overlap_fraction(comm_intervals, compute_intervals)        # share of All-to-All time under compute

Every rank records, on one clock (time.perf_counter = CLOCK_MONOTONIC, shared by the processes of a
machine): its collectives (parallel/comm.py CommEvent: start, end when waited on, bytes), and its
compute spans from forward hooks on the modules (attention, routed experts, shared experts, the rest
of each MoE layer). viz/profiling.py draws them as a Gantt chart.

What the overlap means on gloo: `all_to_all_single(async_op=True)` hands the exchange to gloo's
worker thread, and the rank goes on with the shared experts; the All-to-All's interval runs from the
call to the moment `wait()` returns. The shared experts' interval lies inside it, so the overlap
fraction is real in the sense of wall time on the timeline. Whether the bytes actually move while
the shared experts compute is up to gloo's thread and the free cores: on a 2-core machine shared by
4 ranks, the worker thread and the matmuls compete for the same cores, so the wall time saved is
smaller than the fraction suggests (docs/design.md §2, parallel/ row; the planner's time model is the
account for real hardware).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch

from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.launch import launch
from latentmoe_lab.parallel.runs import RunSettings, build_reference, default_settings


@dataclass(frozen=True)
class Interval:
    rank: int
    kind: str  # "comm" or "compute"
    name: str  # comm: "<op> <tag>"; compute: attn, moe.experts, moe.shared, moe (router, projections)
    start: float  # seconds on the shared clock
    end: float
    nbytes: int = 0

    def __post_init__(self) -> None:
        if not self.end >= self.start:
            raise ValueError(f"interval {self.name!r}: end ({self.end}) must be >= start ({self.start})")


def overlap_fraction(comm: Iterable[Interval], compute: Iterable[Interval]) -> float:
    """Share of the communication time (union of `comm`) that runs while some `compute` interval runs.

    Intervals of all ranks may be passed; they are matched rank by rank (a rank's compute hides only its
    own communication) and the shares are weighted by communication time. 0.0 when there is no
    communication time at all.
    """
    comm, compute = list(comm), list(compute)
    covered = total = 0.0
    for rank in {i.rank for i in comm}:
        mine = _union([(i.start, i.end) for i in comm if i.rank == rank])
        busy = _union([(i.start, i.end) for i in compute if i.rank == rank])
        total += sum(end - start for start, end in mine)
        covered += sum(_overlap(span, busy) for span in mine)
    return covered / total if total > 0 else 0.0


def _union(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _overlap(span: tuple[float, float], busy: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(span[1], b) - max(span[0], a)) for a, b in busy)


# ------------------------------------------------------------------------------------ recording
COMPUTE_PARTS = {"attn": "attn", "ffn.experts": "moe.experts", "ffn.layer.experts": "moe.experts",
                 "ffn.shared": "moe.shared", "ffn.layer.shared": "moe.shared"}


def timeline_worker(pconfig: ParallelConfig, settings: RunSettings) -> list[dict]:
    """Per-rank body of `record_timelines`: one sharded forward with comm events and compute hooks."""
    from latentmoe_lab.parallel.comm import Comm
    from latentmoe_lab.parallel.mesh import ProcessMesh, init_distributed
    from latentmoe_lab.parallel.sharded import parallelize

    _, device = init_distributed(settings.timeout_s)
    model, prompt = build_reference(settings)
    mesh = ProcessMesh(pconfig, device)
    comm = Comm(mesh)
    sharded = parallelize(model.to(device), comm)
    local = sharded.local_inputs(prompt.to(device))
    with torch.no_grad():
        sharded(local)  # warm-up: first-call allocations stay out of the timeline
        spans, handles = [], []
        for block in sharded.blocks:
            for path, part in COMPUTE_PARTS.items():
                module = block.get_submodule(path) if _has(block, path) else None
                if module is not None:
                    handles += _timed(module, part, spans)
        comm.timeline = []
        try:
            sharded(local)
        finally:
            for handle in handles:
                handle.remove()
    rank = mesh.rank
    events = [asdict(Interval(rank, "comm", f"{e.op} {e.tag}", e.start, e.end, e.nbytes))
              for e in comm.timeline if e.end is not None]
    return events + [asdict(Interval(rank, "compute", name, start, end)) for name, start, end in spans]


def _has(module: torch.nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _timed(module: torch.nn.Module, name: str, spans: list) -> list:
    import time

    started = []
    before = module.register_forward_pre_hook(lambda m, a: started.append(time.perf_counter()))
    after = module.register_forward_hook(lambda m, a, o: spans.append((name, started.pop(), time.perf_counter())))
    return [before, after]


def record_timelines(pconfig: ParallelConfig, settings: RunSettings | None = None) -> list[Interval]:
    """Launch pconfig.world_size local processes, run one forward, return every rank's intervals."""
    settings = default_settings(pconfig) if settings is None else settings
    results = launch(timeline_worker, nproc=pconfig.world_size, args=(pconfig, settings),
                     timeout_s=settings.timeout_s * 6)
    return [Interval(**row) for rank_rows in results for row in rank_rows]


def all_to_all_overlap(intervals: Sequence[Interval]) -> float:
    """overlap_fraction of the token All-to-All ("ep.tokens") under shared-expert compute, over all ranks.

    Under tensor parallelism the shared experts end in their own all-reduce (tp.moe_shared): that time
    is waiting, not compute, so collectives started inside a shared-expert span are cut out of it first.
    """
    tokens = [i for i in intervals if i.kind == "comm" and i.name.endswith(" ep.tokens")]
    comm = [i for i in intervals if i.kind == "comm"]
    compute = []
    for shared in (i for i in intervals if i.kind == "compute" and i.name == "moe.shared"):
        # collectives called from inside the shared experts (they start within its span) block the rank
        waits = _union([(c.start, c.end) for c in comm
                        if c.rank == shared.rank and shared.start <= c.start < shared.end])
        compute += [Interval(shared.rank, "compute", "moe.shared", a, b)
                    for a, b in _minus((shared.start, shared.end), waits)]
    return overlap_fraction(tokens, compute)


def _minus(span: tuple[float, float], holes: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of span outside the (sorted, disjoint) holes."""
    pieces, start = [], span[0]
    for a, b in holes:
        if b <= start or a >= span[1]:
            continue
        if a > start:
            pieces.append((start, a))
        start = max(start, b)
    if start < span[1]:
        pieces.append((start, span[1]))
    return pieces
