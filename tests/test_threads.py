"""The default torch thread count: the cores this process may use (affinity, cgroup quota), 1 when few."""
import os
import subprocess
import sys

import pytest

from latentmoe_lab import cli, threads
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.serving.config import ParallelSection
from latentmoe_lab.serving.workers.parallel_runner import worker_threads


@pytest.fixture
def no_quota(monkeypatch):
    monkeypatch.setattr(threads, "_cgroup_quota_cores", lambda root=threads.CGROUP_ROOT: None)


@pytest.mark.parametrize("cores, processes, expected", [
    (1, 1, 1), (2, 1, 1),   # a 2-core box: one thread (2 lost to 1 on a busy machine, benchmarks/RESULTS.md)
    (3, 1, 3), (8, 1, 8),
    (8, 4, 1), (16, 2, 8),  # processes share the cores
    (2, 4, 1),              # more processes than cores: still one thread each
])
def test_default_threads(cores, processes, expected):
    assert threads.default_threads(processes, cores=cores) == expected


def test_the_affinity_mask_counts_not_the_machine(no_quota):
    """A process pinned to one core (taskset) gets one thread, whatever os.cpu_count() says."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from latentmoe_lab import threads; print(threads.available_cores())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "1"
    assert threads.available_cores() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("files, expected", [
    ({"cpu.max": "150000 100000\n"}, 1.5),                                # cgroup v2, 1.5 cores
    ({"cpu.max": "max 100000\n"}, None),                                  # v2, unlimited
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),   # v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),     # v1, unlimited
    ({}, None),                                                           # no cgroup files
])
def test_cgroup_quota(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert threads._cgroup_quota_cores(tmp_path) == expected


def test_a_quota_below_the_affinity_caps_the_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a core: still one thread, never 0
    assert threads.available_cores(tmp_path) == 1


def test_the_choice_is_said_and_a_request_is_checked(no_quota, monkeypatch):
    cores = len(os.sched_getaffinity(0))
    chosen, line = threads.choose_threads(None)
    assert chosen == threads.default_threads(1, cores=cores)
    assert line == f"torch threads: {chosen} ({cores} cores available; --threads N to change)"
    monkeypatch.setattr(threads, "affinity_cores", lambda: 4)
    assert threads.choose_threads(3) == (3, "torch threads: 3 (from --threads)")
    with pytest.raises(ValueError, match="--threads: 5 exceeds the 4 cores this process may run on"):
        threads.choose_threads(5)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="--threads: must be an integer >= 1"):
            threads.choose_threads(bad)


def test_profile_refuses_a_bad_thread_count_in_one_line(tmp_path, capsys):
    assert cli.main(["profile", "--threads", "0", "--out", str(tmp_path)]) == 2
    assert "--threads: must be an integer >= 1, got 0" in capsys.readouterr().err


def test_a_lone_forward_process_takes_the_default_or_the_config(no_quota):
    layout = ParallelConfig()
    assert worker_threads(ParallelSection(forward_process=True), layout) == threads.default_threads()
    assert worker_threads(ParallelSection(forward_process=True, forward_threads=3), layout) == 3
    assert worker_threads(ParallelSection(forward_process=True), ParallelConfig(tp=2)) == 1  # ranks: one each
