"""Run a function as N local processes through accelerate's `notebook_launcher`, and fail loudly.

Inside a Jupyter kernel the workers are spawned, not forked (see `launch`'s start_method).

    results = launch(fn, nproc=4, args=(...))      # fn(*args) on ranks 0..3; returns [result_0, ...]

Works the same from a notebook, a script, the CLI and the tests. Each worker:
  - joins the process group itself (`init_distributed`: PartialState(cpu=True) on CPU, NCCL on GPUs,
    a timeout on the default group; `ProcessMesh` gives every subgroup the same timeout);
  - writes a "started" marker, then its result (torch.save) or its error, into a private run folder;
    results are read back with `torch.load(weights_only=True)`: tensors, numbers, strings, None and
    lists / tuples / dicts of them, never arbitrary pickled objects;
  - arms a watchdog (`faulthandler.dump_traceback_later`): a rank stuck outside any collective
    still exits after `timeout_s`, and RankFailure quotes the innermost frames of where it was;
  - names the collective it was in when one fails (collective_failure.py): a group timeout makes it a
    root cause, a peer that went away collateral.
The rendezvous store the ranks meet at listens on 127.0.0.1 only (a local run needs no other
interface, and the store accepts any client that reaches it). When any rank fails, the elastic
agent behind notebook_launcher stops the others, and `launch` raises `RankFailure` naming the
rank(s) that raised, were killed (with the signal) or hung first; a rank that only saw a peer vanish
is reported as collateral, and one the launcher stopped says so. No process is left behind and
nothing hangs.

On GPUs use the same worker under `torchrun --nproc-per-node N` or `accelerate launch`
(see README "Parallel layouts"); `launch` is the local-process convenience.
"""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import io
import logging
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from latentmoe_lab.parallel.collective_failure import CollectiveTimeout, named_collective_failure
from latentmoe_lab.parallel.comm import CollectiveError
from latentmoe_lab.threads import default_threads


class RankFailure(RuntimeError):
    """A launched rank died or raised; the message names it."""


class UnsafeResult(TypeError):
    """A rank returned something `torch.load(weights_only=True)` refuses (an arbitrary pickled object)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def loopback_store(timeout_s: float):
    """A TCPStore server listening on 127.0.0.1 only; yields its port.

    The elastic agent's static rendezvous would start its own server on all interfaces. Started
    first with multi_tenant=True, this one is the server it finds and reuses for that port.
    """
    from datetime import timedelta

    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=timeout_s), multi_tenant=True,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the listening socket now, and closes it when it stops
    try:
        yield port
    finally:
        del store


class _RankEntry:
    """What each worker runs: fn(*args) with markers, a watchdog and a clean exit.

    A module-level class rather than a closure, so that spawned workers can unpickle it (fn must then
    be importable too: a function of a module, not one defined in a notebook cell).
    """

    def __init__(self, fn, run_dir: Path, timeout_s: float, threads: int):
        self.fn, self.run_dir, self.timeout_s, self.threads = fn, run_dir, timeout_s, threads
        # The elastic agent names the run after the entry point.
        self.__name__ = getattr(fn, "__name__", "worker")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(self, *args):
        run_dir, timeout_s = self.run_dir, self.timeout_s
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        (run_dir / f"{rank}.started").write_text(str(os.getpid()))
        # The watchdog's stack dump goes to a file of the run, so that RankFailure can say where a stuck
        # rank was, from a notebook or a CI log alike (a worker's stderr may be captured or lost).
        stack_file = open(run_dir / f"{rank}.watchdog", "w")  # noqa: SIM115 - open until the process ends
        faulthandler.dump_traceback_later(timeout_s, exit=True, file=stack_file)
        # When a peer fails the launcher sends SIGTERM; a Python-level handler would only run once the
        # rank leaves a blocking C++ wait, so let the signal terminate the process at once.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            _wait_for_siblings(run_dir, world, timeout_s)
            torch.set_num_threads(self.threads)
            result = self.fn(*args)
            torch.save(result, run_dir / f"{rank}.result")
            if dist.is_initialized():
                # nobody leaves while a peer may still need it. Waiting in a collective would be bounded by the
                # group timeout, and rank 0 may export, sample or write a report for longer than that.
                _wait_for_siblings(run_dir, world, timeout_s, marker="result")
                dist.barrier()
                dist.destroy_process_group()
        except BaseException as error:
            named = named_collective_failure(error, rank)
            reported = error if named is None else named
            # a rank whose peer went away is collateral; one that timed out waited on a peer that never came
            kind = ("collateral" if isinstance(reported, CollectiveError)
                    and not isinstance(reported, CollectiveTimeout) else "error")
            (run_dir / f"{rank}.{kind}").write_text(f"{type(reported).__name__}: {reported}\n"
                                                    f"{traceback.format_exc()}")
            if named is None:
                raise
            raise named from error
        finally:
            faulthandler.cancel_dump_traceback_later()


def inside_kernel() -> bool:
    """True inside a Jupyter (ipykernel) kernel, whose ZMQ and heartbeat threads make fork unsafe."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and hasattr(shell, "kernel")


def _start(entry: _RankEntry, args: tuple, nproc: int, port: int, start_method: str) -> None:
    """Start nproc workers and wait for them. fork: accelerate's notebook_launcher. spawn: torch's elastic
    launcher, which notebook_launcher wraps, with the start method it hard-codes to fork on CPUs."""
    if start_method == "fork":
        from accelerate import notebook_launcher

        notebook_launcher(entry, args, num_processes=nproc, use_port=str(port), master_addr="127.0.0.1")
        return
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id="none", rdzv_backend="static",
                          rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"rank": 0}, max_restarts=0,
                          monitor_interval=0.1, start_method="spawn")
    elastic_launch(config=config, entrypoint=entry)(*args)


def _wait_for_siblings(run_dir: Path, world: int, timeout_s: float, marker: str = "started") -> None:
    """Wait, polling the run folder, until every rank has written its `marker` file.

    "started": touch no socket until every rank has been forked. A fork copies the parent's locks in
    whatever state they are in. While rank 0 connects to the launcher's rendezvous store, the store's
    server thread in the parent holds glibc's resolver lock (getnameinfo); a rank forked at that instant
    inherits it locked and hangs in its own first getnameinfo. Once every rank exists, nothing is forked
    any more and the lock is safe.
    "result": every rank has returned, whatever time that took (bounded by `timeout_s`, the run's).
    """
    deadline = time.monotonic() + timeout_s
    while sum((run_dir / f"{r}.{marker}").exists() for r in range(world)) < world:
        if time.monotonic() > deadline:
            raise RuntimeError(f"launch: not every one of {world} ranks wrote its {marker!r} marker "
                               f"within {timeout_s}s")
        time.sleep(0.005 if marker == "started" else 0.05)


def launch(fn, nproc: int, args: tuple = (), timeout_s: float = 120.0, start_method: str | None = None) -> list:
    """fn(*args) on `nproc` local processes (ranks 0..nproc-1) -> the list of their return values.

    fn must join the process group itself (see `init_distributed`). Raises RankFailure naming the
    failed rank(s) when any rank dies, raises or exceeds `timeout_s`.
    start_method: "fork" or "spawn"; None picks spawn inside a Jupyter kernel (a forked copy of a
    kernel's threads once hung a notebook) and fork elsewhere (faster: nothing is re-imported).
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 2:
        raise ValueError(f"nproc: launch needs an integer >= 2 processes, got {nproc!r}")
    if start_method is None:
        start_method = "spawn" if inside_kernel() else "fork"
    if start_method not in ("fork", "spawn"):
        raise ValueError(f"start_method: must be 'fork', 'spawn' or None, got {start_method!r}")
    run_dir = Path(tempfile.mkdtemp(prefix="latentmoe-launch-"))
    threads = default_threads(nproc)  # each rank's share of the cores this process may use
    elastic_log = logging.getLogger("torch.distributed.elastic")
    level = elastic_log.level
    try:
        elastic_log.setLevel(logging.CRITICAL)  # the agent's own failure dump; RankFailure says it better
        with (_patched_env(OMP_NUM_THREADS=str(threads)), contextlib.redirect_stdout(io.StringIO()),
              _kept_signal_handlers(), _parent_heap_frozen(), loopback_store(timeout_s) as port):
            _start(_RankEntry(fn, run_dir, timeout_s, threads), args, nproc, port, start_method)
        missing = [r for r in range(nproc) if not (run_dir / f"{r}.result").exists()]
        if missing:
            raise RankFailure(_failure_report(run_dir, nproc, {}, timeout_s))
        return [_load_result(run_dir, r) for r in range(nproc)]
    except (RankFailure, UnsafeResult):
        raise
    except Exception as error:  # noqa: BLE001 - the elastic agent's ChildFailedError and friends
        raise RankFailure(_failure_report(run_dir, nproc, _observed_exit_codes(error), timeout_s)) from error
    finally:
        elastic_log.setLevel(level)
        shutil.rmtree(run_dir, ignore_errors=True)


def _load_result(run_dir: Path, rank: int):
    try:
        return torch.load(run_dir / f"{rank}.result", weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeResult(f"launch: rank {rank} returned a value that is not safe to load (weights_only=True "
                        f"allows tensors, numbers, strings, None and lists / tuples / dicts of them): "
                        f"{str(error).splitlines()[0]}") from None


def _observed_exit_codes(error: BaseException) -> dict[int, int]:
    """{rank: exit code} of the ranks the elastic agent saw fail first (its ChildFailedError.failures).

    The agent stops the other ranks after that, so they are absent here. A negative code is a signal.
    """
    failures = getattr(error, "failures", None)
    return {int(rank): int(failure.exitcode) for rank, failure in failures.items()} if failures else {}


def _failure_report(run_dir: Path, nproc: int, exit_codes: dict[int, int], timeout_s: float) -> str:
    """One line per rank that did not return: what it raised, what killed it, or where it was stuck.

    Root causes come first: ranks that raised, then ranks that died on their own. A rank that only saw a
    peer vanish in a collective is collateral, and one the launcher stopped after a failure says so.
    """
    raised, died, stopped, collateral = [], [], [], []
    for r in range(nproc):
        if (run_dir / f"{r}.error").exists():
            raised.append(f"rank {r} raised {_first_line(run_dir / f'{r}.error')}")
        elif (run_dir / f"{r}.collateral").exists():
            collateral.append(f"rank {r} stopped because a peer failed: {_first_line(run_dir / f'{r}.collateral')}")
        elif (run_dir / f"{r}.started").exists() and not (run_dir / f"{r}.result").exists():
            stuck_at = _watchdog_frames(run_dir / f"{r}.watchdog")
            if stuck_at:
                died.append(f"rank {r} was still running after the {timeout_s:g}s timeout, in {stuck_at}")
            elif r in exit_codes:
                died.append(f"rank {r} {_exit_description(exit_codes[r])} without reporting an error")
            else:
                stopped.append(r)
    root_cause_seen = raised or died
    why = "was stopped by the launcher after that failure" if root_cause_seen else \
        "died without reporting an error (killed or crashed)"
    lines = raised + died + [f"rank {r} {why}" for r in stopped] + collateral
    if not lines:
        lines = ["the launcher failed before any rank started"]
    return "parallel run failed: " + "; ".join(lines)


def _first_line(path: Path) -> str:
    return path.read_text().splitlines()[0]


def _exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _watchdog_frames(path: Path, keep: int = 3) -> str:
    """The innermost frames of the rank's main thread in a faulthandler dump ('' when it did not fire).

    faulthandler writes one block per thread, most recent call first:
        Thread 0x00007f... (most recent call first):
          File "/path/module.py", line 12 in function
    The main thread is the one running this module's `_RankEntry.__call__`.
    """
    if not path.exists():
        return ""
    threads: list[list[str]] = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if "(most recent call first)" in line:
            threads.append([])
        elif line.startswith("File ") and threads:
            where, _, function = line.partition(" in ")
            file_name, _, line_no = where.removeprefix("File ").partition(", line ")
            threads[-1].append(f"{function} ({Path(file_name.strip(chr(34))).name}:{line_no})")
    if not threads:
        return ""
    main = next((frames for frames in threads if any(f.startswith("__call__ (launch.py") for f in frames)), threads[0])
    return " <- ".join(main[:keep])


@contextlib.contextmanager
def _parent_heap_frozen():
    """Keep forked ranks from finalizing the parent's objects.

    A forked rank inherits the parent's heap, garbage included. An earlier failed launch leaves its
    elastic agent, worker processes, pipes and stores in reference cycles until the parent's next
    collection; when a rank's own garbage collector frees them instead, their C++ destructors act on
    threads and sockets that exist only in the parent, and the rank segfaults or hangs (seen in CI:
    both ranks stuck under a deepcopy until the watchdog). So collect in the parent first, then freeze
    what is left into the permanent generation, which the ranks' collectors never visit.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _kept_signal_handlers():
    """Restore the caller's SIGTERM / SIGINT / SIGHUP / SIGQUIT handlers after the launch.

    The elastic agent installs its own for the run and leaves them: a notebook kernel's "interrupt"
    would then raise the agent's SignalException instead of KeyboardInterrupt, and a kernel shutdown
    would print its traceback.
    """
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved = {}
    if threading.current_thread() is threading.main_thread():
        saved = {sig: signal.getsignal(sig) for sig in (getattr(signal, n) for n in names if hasattr(signal, n))}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _patched_env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
