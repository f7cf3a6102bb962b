"""How many torch threads a process takes when the user does not say: one rule for every entry point.

    cores = available_cores()        # this process's CPU affinity, capped by its cgroup's CPU quota
    n = default_threads(processes)   # cores // processes, and 1 when that leaves 2 or fewer
    apply_threads(requested, processes, label)   # torch.set_num_threads + one line saying why
    check_within_cores(threads, name)            # a request above the cores is refused (every entry point)

torch's own default is one OpenMP thread per core of the machine (os.cpu_count()), which counts cores
this process may not use (a container's quota, taskset) and cores other jobs are using. Each parallel
region then waits for its slowest thread; a thread that is descheduled makes the whole region wait. On
a busy shared 2-core machine 2 threads made training 9-14x and generation 10-40x slower than 1
(benchmarks/RESULTS.md, "Threads"), so with 2 or fewer cores per process the default is 1.
`--threads N` (or parallel.forward_threads in a service config) overrides it.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

# per process, at or below this many cores one thread wins (measured, benchmarks/RESULTS.md)
SINGLE_THREAD_UP_TO = 2
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup_quota_cores(root: Path = CGROUP_ROOT) -> float | None:
    """Cores' worth of CPU time the cgroup allows (quota / period), None when unlimited or unknown.

    cgroup v2: <root>/<group>/cpu.max holds "max 100000" or "200000 100000" (quota period, microseconds),
    with <group> from /proc/self/cgroup's "0::/path" line; v1: cpu/cpu.cfs_quota_us (-1: none) and
    cpu/cpu.cfs_period_us.
    """
    candidates = [root / "cpu.max"]
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                candidates.insert(0, root / line[3:].lstrip("/") / "cpu.max")
    except OSError:
        pass
    for path in candidates:
        try:
            quota, period = path.read_text().split()[:2]
        except (OSError, ValueError):
            continue
        return None if quota == "max" else int(quota) / int(period)
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def affinity_cores() -> int:
    """Cores this process may run on: its affinity mask (the machine's count where there is none), >= 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def available_cores(root: Path = CGROUP_ROOT) -> int:
    """Cores this process may use: affinity_cores, capped by the cgroup quota (rounded down), >= 1."""
    cores = affinity_cores()
    quota = _cgroup_quota_cores(root)
    if quota is not None:
        cores = min(cores, math.floor(quota))
    return max(1, cores)


def default_threads(processes: int = 1, cores: int | None = None) -> int:
    """Torch threads for each of `processes` processes sharing the available cores."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes: must be an integer >= 1, got {processes!r}")
    per_process = (available_cores() if cores is None else cores) // processes
    return 1 if per_process <= SINGLE_THREAD_UP_TO else per_process


def check_within_cores(threads: int, name: str) -> None:
    """ValueError naming `name` when one process asks for more threads than the cores it may run on: the
    extra threads only wait for each other (3.5 s a training step instead of 0.13 s with 1000 on 2 cores)."""
    cores = affinity_cores()
    if threads > cores:
        raise ValueError(f"{name}: {threads} exceeds the {cores} cores this process may run on")


def choose_threads(requested: int | None, processes: int = 1, flag: str = "--threads") -> tuple[int, str]:
    """(threads, the line that says why): `requested` when given (checked), else the default."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"{flag}: must be an integer >= 1, got {requested!r}")
        check_within_cores(requested, flag)
        return requested, f"torch threads: {requested} (from {flag})"
    cores = available_cores()
    threads = default_threads(processes, cores)
    per = f" for each of {processes} processes" if processes > 1 else ""
    return threads, f"torch threads: {threads}{per} ({cores} cores available; {flag} N to change)"


def apply_threads(requested: int | None = None, processes: int = 1, flag: str = "--threads",
                  echo=print) -> int:
    """Set this process's torch threads by `choose_threads` and print the choice (echo=None: silent)."""
    import torch

    threads, line = choose_threads(requested, processes, flag)
    torch.set_num_threads(threads)
    if echo is not None:
        echo(line)
    return threads
