"""Small product fixes from issue 12: warnings-free progress, `make lab` arguments."""
import subprocess
import warnings
from pathlib import Path

from latentmoe_lab.training.balance import balance_config, train_balancing

ROOT = Path(__file__).resolve().parents[1]


def test_balancing_progress_gets_a_float_loss_without_warnings():
    seen = []
    config = balance_config("tiny").replace(num_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float() on a tensor that requires grad warns in recent torch
        train_balancing("none", config=config, steps=2, batch=2, seq_len=8, tail=1,
                        progress=lambda step, loss, ratio: seen.append(loss))
    assert len(seen) == 2 and all(isinstance(v, float) for v in seen)


def test_make_lab_passes_lab_args_to_jupyter():
    done = subprocess.run(["make", "-n", "-o", ".venv/.installed", "lab", "LAB_ARGS=--allow-root --port 8899"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    assert "jupyter lab" in done.stdout and "--allow-root --port 8899" in done.stdout


def test_make_lab_defaults_to_allow_root_as_root_only():
    import os

    done = subprocess.run(["make", "-n", "-o", ".venv/.installed", "lab"], cwd=ROOT, capture_output=True, text=True,
                          check=True)
    assert ("--allow-root" in done.stdout) == (os.geteuid() == 0)


# ---------------------------------------------------------------- smoke report (item 16)
def test_smoke_times_a_median_after_warm_up_with_fixed_threads_and_records_the_environment(monkeypatch):
    import statistics

    import torch

    from latentmoe_lab import smoke

    seen_threads = []
    real = smoke._prefill_and_decode
    monkeypatch.setattr(smoke, "_prefill_and_decode",
                        lambda *a: seen_threads.append(torch.get_num_threads()) or real(*a))
    before = torch.get_num_threads()
    report = smoke.run_smoke(new_tokens=2, seed=3, threads=1, repeats=3)
    assert torch.get_num_threads() == before  # restored
    assert seen_threads == [1] * 4  # one warm-up + three timed passes, all on the fixed thread count
    assert len(report.prefill_seconds) == len(report.decode_seconds) == 3
    assert report.prefill_tokens_per_s == report.prompt_tokens / statistics.median(report.prefill_seconds)
    env = report.environment
    assert env["torch"] == torch.__version__ and env["threads"] == 1 and env["seed"] == 3 and env["cpu"]
    summary = report.summary()
    assert "median of 3" in summary and f"torch {torch.__version__}" in summary and "threads 1" in summary


def test_smoke_refuses_bad_timing_arguments():
    import pytest

    from latentmoe_lab.smoke import run_smoke

    for bad in (dict(threads=0), dict(repeats=0), dict(new_tokens=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            run_smoke(**bad)


def test_every_smoke_figure_has_one_caption_and_layers_share_one_order():
    import plotly.graph_objects as go

    from latentmoe_lab.report import Captioned, html_report
    from latentmoe_lab.smoke import report_sections, run_smoke

    sections = report_sections(run_smoke(new_tokens=1, repeats=1))
    figures = [s for s in sections if not isinstance(s, str)]
    assert len(figures) == 7 and all(isinstance(s, Captioned) and len(s.caption) > 40 for s in figures)
    assert len({s.caption for s in figures}) == len(figures)
    page = html_report("t", sections)
    assert page.count("<figcaption>") == page.count("Plotly.newPlot") == 7
    by_title = {s.figure.layout.title.text: s.figure for s in figures}
    heatmaps = [f for f in by_title.values() if any(isinstance(t, go.Heatmap) and t.y is not None and
                                                    str(t.y[0]).startswith("layer") for t in f.data)]
    assert len(heatmaps) == 2  # expert load and routing by modality
    assert [f.layout.yaxis.autorange for f in heatmaps] == ["reversed", "reversed"]
    assert len({tuple(next(t.y for t in f.data if isinstance(t, go.Heatmap))) for f in heatmaps}) == 1


def test_sequence_layout_legend_fits_a_one_row_strip():
    from latentmoe_lab.viz.multimodal import sequence_layout_figure

    fig = sequence_layout_figure([["image_start", "image", "image_end", "text", "pad"]], row_labels=["prompt"])
    legend = fig.layout.legend
    assert legend.orientation == "h" and legend.y > 1  # above the strip, in the top margin
    assert fig.layout.margin.t >= 100 and fig.layout.height >= 240
