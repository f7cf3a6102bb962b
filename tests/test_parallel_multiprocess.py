"""Real multi-process runs on CPU (gloo): parity with one process, exact bytes, schedules, dead ranks.

Every layout of one world size runs inside a single launch (one group of processes), so the
whole file costs a few launches of 2-4 processes on the tiny preset.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F

from latentmoe_lab import cli
from latentmoe_lab.parallel.comm import Comm
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.launch import RankFailure, free_port, launch
from latentmoe_lab.parallel.mesh import ProcessMesh, init_distributed
from latentmoe_lab.parallel.pipeline import train_step
from latentmoe_lab.parallel.runs import RunSettings, build_reference, run_layouts
from latentmoe_lab.parallel.sharded import parallelize

FOUR_PROCESS_LAYOUTS = {
    "EP=4": ParallelConfig(ep=4),
    "EP=2": ParallelConfig(ep=2, dp=2),
    "TP=2": ParallelConfig(tp=2, dp=2),
    "PP=2 (2 micro-batches)": ParallelConfig(pp=2, dp=2, micro_batches=2),
    "CP=2": ParallelConfig(cp=2, dp=2),
    "EP2xTP2": ParallelConfig(ep=2, tp=2),
    "PP2xEP2": ParallelConfig(pp=2, ep=2),
    "TP2xCP2 + sequence parallel": ParallelConfig(tp=2, cp=2, sequence_parallel=True),
    "PP2xTP2 + sequence parallel": ParallelConfig(pp=2, tp=2, sequence_parallel=True),
    "EP2xTP2, dispatcher protocol (no overlap)": ParallelConfig(ep=2, tp=2, overlap=False),
}


@pytest.fixture(scope="module")
def four_process_reports():
    reports = run_layouts(list(FOUR_PROCESS_LAYOUTS.values()), RunSettings(batch=4, seq_len=40, new_tokens=3))
    return dict(zip(FOUR_PROCESS_LAYOUTS, reports))


@pytest.mark.parametrize("name", list(FOUR_PROCESS_LAYOUTS))
def test_layout_matches_one_process(four_process_reports, name):
    report = four_process_reports[name]
    assert report.max_abs_logit_error <= 1e-5
    assert report.tokens_equal


@pytest.mark.parametrize("name", list(FOUR_PROCESS_LAYOUTS))
def test_collective_bytes_equal_the_planner_exactly(four_process_reports, name):
    report = four_process_reports[name]
    assert report.measured == report.planned
    assert any(report.measured)  # something did move


def test_expert_all_to_all_is_grouped_and_in_the_latent_size(four_process_reports):
    report = four_process_reports["EP=4"]
    for rank in report.ranks:
        for stats in rank["load"].values():
            # one row per (token, destination rank), never more rows than (token, expert) pairs
            assert sum(stats["rows_to"]) <= sum(stats["pairs_to"])
    moe_layers, latent = 3, 32
    measured = report.measured[0]
    assert measured["ep.tokens"] % (latent * 4) == 0 and measured["ep.counts"] == moe_layers * 3 * 8


def _pipeline_training_worker(layouts):
    """Per rank: gradients of each layout's train_step vs a single-device backward of the same loss."""
    _, device = init_distributed(20)
    model, prompt = build_reference(RunSettings())
    labels = prompt.roll(-1, dims=1)
    loss = F.cross_entropy(model(prompt).logits.flatten(0, 1), labels.flatten())
    loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    results = []
    for pconfig in layouts:
        sharded = parallelize(model, Comm(ProcessMesh(pconfig, device)))
        sharded_loss = train_step(sharded, prompt, labels)
        errors = []
        for name, param in sharded.named_parameters():
            if name.startswith("blocks."):
                _, k, rest = name.split(".", 2)
                name = f"layers.{sharded.layer_ids[int(k)]}.{rest}"
            assert (param.grad is None) == (name not in expected), name  # e.g. the indexer gets no gradient
            if param.grad is not None:
                errors.append(float((param.grad - expected[name]).abs().max()))
        refused = False
        try:
            train_step(parallelize(model, Comm(ProcessMesh(ParallelConfig(ep=2), device))), prompt, labels)
        except ValueError:
            refused = True
        results.append({"loss_error": float((sharded_loss - loss).abs()), "max_grad_error": max(errors),
                        "params": len(errors), "ep_refused": refused})
    return results


def test_gpipe_and_1f1b_training_steps_give_single_device_gradients():
    layouts = [ParallelConfig(pp=2, micro_batches=2, schedule="gpipe"),
               ParallelConfig(pp=2, micro_batches=4, schedule="1f1b")]
    per_rank = launch(_pipeline_training_worker, 2, (layouts,))
    for rank in per_rank:
        for result in rank:
            assert result["loss_error"] < 1e-5 and result["max_grad_error"] < 1e-6 and result["params"] > 0
            assert result["ep_refused"]


def _dies_in_a_collective(pid_folder):
    _, device = init_distributed(5)
    mesh = ProcessMesh(ParallelConfig(ep=2, timeout_s=5), device)
    (pid_folder / f"{mesh.rank}.pid").write_text(str(os.getpid()))
    if mesh.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    Comm(mesh).all_to_all(torch.ones(4), [2, 2], [2, 2], "ep", "ep.tokens").wait()


def test_a_killed_rank_is_named_within_seconds_and_nothing_is_left(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        launch(_dies_in_a_collective, 2, (tmp_path,), timeout_s=30)
    assert time.monotonic() - start < 15
    message = str(failure.value)
    # One race, several honest outcomes: gloo may report the closed socket to rank 0 (it raises in its
    # collective) before or after the agent reads rank 1's SIGKILL, and the agent may stop rank 0 first.
    # Whichever: rank 1 is the root cause, named first, and rank 0 is described as its collateral.
    rank_1 = ("parallel run failed: rank 1 died without reporting an error",
              "parallel run failed: rank 1 was killed by SIGKILL without reporting an error")
    rank_0 = ("rank 0 stopped because a peer failed: CollectiveError", "rank 0 was stopped by the launcher")
    assert message.startswith(rank_1) and any(text in message for text in rank_0), message
    for pid_file in tmp_path.glob("*.pid"):
        pid = int(pid_file.read_text())
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _hangs_outside_collectives():
    if int(os.environ["RANK"]) == 1:
        time.sleep(600)
    return "done"


def test_a_hung_rank_is_stopped_by_its_watchdog_and_the_report_says_where():
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        launch(_hangs_outside_collectives, 2, timeout_s=3)
    assert time.monotonic() - start < 30
    message = str(failure.value)
    assert "rank 1 was still running after the 3s timeout, in _hangs_outside_collectives " \
           "(test_parallel_multiprocess.py:" in message, message
    assert "rank 0" not in message  # it returned


def _joins_a_collective_late():
    init_distributed(2)  # the group timeout: 2 s
    if int(os.environ["RANK"]) == 1:
        time.sleep(8)
    torch.distributed.all_reduce(torch.ones(1))


def test_a_collective_past_the_group_timeout_names_the_rank_the_collective_and_the_caller():
    """gloo's own message ("Timed out waiting 2000ms for recv") names none of them; rank 0 is the root cause."""
    with pytest.raises(RankFailure) as failure:
        launch(_joins_a_collective_late, 2, timeout_s=30)
    message = str(failure.value)
    assert message.startswith("parallel run failed: rank 0 raised CollectiveTimeout: rank 0: all_reduce in "
                              "_joins_a_collective_late (test_parallel_multiprocess.py:"), message
    assert "did not return within the group timeout" in message and "Timed out waiting 2000ms" in message


def _finishes_late_on_rank_0():
    init_distributed(2)  # the group timeout: 2 s
    if int(os.environ["RANK"]) == 0:
        time.sleep(3.5)  # an export or a sample after the last collective
    return int(os.environ["RANK"])


def test_the_end_of_run_wait_is_bounded_by_the_run_timeout_not_the_group_timeout():
    assert launch(_finishes_late_on_rank_0, 2, timeout_s=60) == [0, 1]


AFTER_FAILED_LAUNCHES = """
import gc, os, time
from latentmoe_lab.parallel.launch import RankFailure, launch

def hangs():
    if int(os.environ["RANK"]) == 1:
        time.sleep(600)

def fail_and_keep_the_error():
    try:
        launch(hangs, 2, timeout_s=1)
    except RankFailure as error:
        kept = error  # its traceback refers to this frame: a cycle that only the garbage collector frees
    return kept

failed = 0
for attempt in range(4):
    fail_and_keep_the_error()
    try:
        launch(gc.collect, 2, timeout_s=30)
    except RankFailure as error:
        failed += 1
        print(error)
print("failed launches:", failed)
"""


def test_ranks_forked_after_a_failed_launch_do_not_finalize_its_leftovers():
    """A failed launch leaves its agent, processes and pipes in reference cycles in the parent. Ranks forked
    later must not run their destructors: before the fix, 1 or 2 of these 4 launches had a rank segfault
    in its garbage collector (and in CI one hung there). A fresh interpreter, because pytest's own state
    changes when the collector runs."""
    done = subprocess.run([sys.executable, "-c", AFTER_FAILED_LAUNCHES], capture_output=True, text=True,
                          timeout=180, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "failed launches: 0" in done.stdout, done.stdout[-2000:]


def test_cli_runs_a_layout_and_refuses_a_wrong_process_count(capsys):
    assert cli.main(["parallel", "--ep", "2", "--new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "layout EP2 on 2 processes" in out and "bytes per rank equal to the planner: True" in out
    assert cli.main(["parallel", "--ep", "2", "--tp", "2", "--nproc", "2"]) == 2  # one line, no traceback
    assert "needs ep*tp*pp*dp*cp = 4" in capsys.readouterr().err


def test_layouts_of_different_sizes_are_not_mixed_in_one_launch():
    with pytest.raises(ValueError, match="same number of processes"):
        run_layouts([ParallelConfig(ep=2), ParallelConfig(ep=4)])


def test_the_same_worker_runs_under_torchrun():
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()),
                           "-m", "latentmoe_lab.parallel", "--pp", "2", "--new-tokens", "2"],
                          capture_output=True, text=True, timeout=180, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "layout PP2 on 2 processes" in done.stdout and "tokens equal: True" in done.stdout


def _context_parallel_fp64_worker():
    """CP=2 of an fp64 model: its logits' largest error against one process, greedy parity, the bytes per tag."""
    _, device = init_distributed(30)
    torch.manual_seed(0)
    model = build_reference(RunSettings())[0].double()
    prompt = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(prompt).logits
        comm = Comm(ProcessMesh(ParallelConfig(cp=2), device))
        sharded = parallelize(model, comm)
        local = sharded.local_inputs(prompt)
        comm.reset()
        local_logits = sharded(local)
        measured = {tag: n for tag, n in comm.bytes.items() if n}  # the forward's own traffic, no logits gather
        logits = sharded.gather_logits(local_logits, local.shape[0], local.shape[1])
        tokens_equal = torch.equal(sharded.generate(prompt, 3), model.generate(prompt, max_new_tokens=3))
    error = None if logits is None else float((logits - reference).abs().max())
    return error, tokens_equal, measured


def test_context_parallel_hands_an_fp64_kda_state_over_in_fp64():
    """The KDA hand-off between cp ranks carries the state in the dtype the KDA ops keep it in (fp64 for an fp64
    model, fp32 otherwise): a fixed fp32 receive buffer made an fp64 run die in gloo with a size mismatch."""
    from latentmoe_lab.parallel.traffic import forward_traffic

    per_rank = launch(_context_parallel_fp64_worker, 2, timeout_s=120)
    errors = [error for error, _, _ in per_rank if error is not None]
    assert errors and max(errors) <= 1e-10
    assert all(tokens_equal for _, tokens_equal, _ in per_rank)
    model = build_reference(RunSettings())[0]
    planned = forward_traffic(model.config, ParallelConfig(cp=2), 2, 40, act_bytes=8)
    assert [measured for _, _, measured in per_rank] == [{k: v for k, v in p.items() if v} for p in planned]
    assert per_rank[0][2]["cp.kda_state"] > 0
