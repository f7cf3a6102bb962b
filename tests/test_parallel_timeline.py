"""Per-rank timelines: overlap_fraction on synthetic intervals, and a recorded EP2 forward (2 processes, gloo)."""
import pytest

from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.timeline import Interval, all_to_all_overlap, overlap_fraction, record_timelines
from latentmoe_lab.viz.profiling import timeline_figure


def comm(rank, start, end, name="all_to_all ep.tokens"):
    return Interval(rank, "comm", name, start, end, 100)


def compute(rank, start, end, name="moe.shared"):
    return Interval(rank, "compute", name, start, end)


def test_overlap_fraction_on_synthetic_intervals():
    assert overlap_fraction([comm(0, 0, 10)], [compute(0, 2, 6)]) == pytest.approx(0.4)
    # compute spans that overlap each other count once; comm spans too
    assert overlap_fraction([comm(0, 0, 10), comm(0, 5, 10)], [compute(0, 2, 6), compute(0, 4, 8)]) == \
        pytest.approx(0.6)
    # another rank's compute hides nothing of rank 0; shares are weighted by comm time
    assert overlap_fraction([comm(0, 0, 10), comm(1, 0, 30)], [compute(1, 0, 30)]) == pytest.approx(0.75)
    assert overlap_fraction([comm(0, 0, 10)], []) == 0.0
    assert overlap_fraction([], [compute(0, 0, 1)]) == 0.0
    assert overlap_fraction([comm(0, 0, 10)], [compute(0, -5, 20)]) == pytest.approx(1.0)


def test_all_to_all_overlap_cuts_waits_inside_the_shared_experts():
    # shared experts 2..8 call a TP all-reduce 5..8: only 2..5 is compute under the tokens' 0..10
    intervals = [comm(0, 0, 10), compute(0, 2, 8), comm(0, 5, 8, "all_reduce tp.moe_shared"),
                 comm(0, 1, 9, "all_to_all ep.meta")]  # in flight since before: not a wait
    assert all_to_all_overlap(intervals) == pytest.approx(0.3)


def test_interval_rejects_end_before_start():
    with pytest.raises(ValueError, match="end"):
        Interval(0, "comm", "x", 2.0, 1.0)


def test_ep2_timeline_records_both_ranks_on_one_clock():
    intervals = record_timelines(ParallelConfig(ep=2))
    assert {i.rank for i in intervals} == {0, 1}
    tokens = [i for i in intervals if i.name == "all_to_all ep.tokens"]
    shared = [i for i in intervals if i.name == "moe.shared"]
    moe_layers = len(tokens) // 2
    assert moe_layers >= 1 and len(shared) == 2 * moe_layers and all(i.nbytes > 0 for i in tokens)
    # one clock: the two ranks' matching exchanges overlap in time (each waits for the other)
    first = sorted((i for i in tokens), key=lambda i: i.start)[:2]
    assert {i.rank for i in first} == {0, 1} and max(i.start for i in first) <= min(i.end for i in first)
    # the overlapped dispatcher starts the shared experts while the tokens are in flight
    for rank in (0, 1):
        starts = sorted(i.start for i in tokens if i.rank == rank)
        for s, t in zip(sorted(i.start for i in shared if i.rank == rank), starts):
            assert s >= t
    assert 0.0 < all_to_all_overlap(intervals) <= 1.0
    figure = timeline_figure(intervals)
    assert {"rank 0 comm", "rank 1 compute"} <= {y for trace in figure.data for y in trace.y}


def test_recorded_collective_labels_the_trace_and_logs_an_event(tmp_path):
    from collections import Counter

    from latentmoe_lab.parallel.comm import PendingTensor, _recorded
    from latentmoe_lab.profiling import label_seconds, load_chrome_trace, trace

    class FakeComm:  # the two attributes _recorded reads, and collectives that count like Comm's
        def __init__(self):
            self.bytes, self.timeline = Counter(), []

        @_recorded("all_reduce")
        def all_reduce(self, tensor, dim, tag):
            self.bytes[tag] += tensor.numel() * tensor.element_size()
            return tensor

        @_recorded("all_to_all")
        def all_to_all(self, rows, dim, tag):
            class Work:
                def wait(self):
                    pass
            return PendingTensor(rows, Work(), self, "all_to_all", tag, [0])

    comm = FakeComm()
    import torch

    data = load_chrome_trace(trace(lambda: comm.all_reduce(torch.ones(8), "tp", tag="tp.attn"), tmp_path / "c.json",
                                   warmup=0))
    assert "comm.all_reduce" in label_seconds(data["traceEvents"])
    (event,) = comm.timeline
    assert (event.op, event.tag, event.nbytes) == ("all_reduce", "tp.attn", 32) and event.end >= event.start
    pending = comm.all_to_all(torch.ones(2), "ep", "ep.tokens")
    assert comm.timeline[-1].end is None  # in flight until waited on
    pending.wait()
    assert comm.timeline[-1].end >= comm.timeline[-1].start
    comm.timeline = None  # recording off: the collective still runs
    assert comm.all_reduce(torch.ones(1), "tp", "tp.attn").item() == 1.0
