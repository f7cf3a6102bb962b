"""Run a function as N local processes through accelerate's `notebook_launcher`, and fail loudly.

    results = launch(fn, nproc=4, args=(...))      # fn(*args) on ranks 0..3; returns [result_0, ...]

Works the same from a notebook, a script, the CLI and the tests. Each worker:
  - joins the process group itself (`init_distributed`: PartialState(cpu=True) on CPU, NCCL on GPUs,
    a timeout on the default group; `ProcessMesh` gives every subgroup the same timeout);
  - writes a "started" marker, then its pickled result or its error, into a private run folder;
  - arms a watchdog (`faulthandler.dump_traceback_later`): a rank stuck outside any collective
    still exits after `timeout_s`, printing where it was.
When any rank fails, the elastic agent behind notebook_launcher stops the others, and `launch`
raises `RankFailure` naming the rank(s) that died or raised first (a rank that only saw a peer
vanish is reported as collateral), so no process is left behind and nothing hangs.

On GPUs use the same worker under `torchrun --nproc-per-node N` or `accelerate launch`
(see README "Parallel layouts"); `launch` is the local-process convenience.
"""
from __future__ import annotations

import contextlib
import faulthandler
import functools
import io
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from latentmoe_lab.parallel.comm import CollectiveError


class RankFailure(RuntimeError):
    """A launched rank died or raised; the message names it."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(fn, run_dir: Path, timeout_s: float, threads: int):
    """What each forked worker runs: fn(*args) with markers, a watchdog and a clean exit."""

    @functools.wraps(fn)  # the elastic agent names the run after the entry point
    def entry(*args):
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        (run_dir / f"{rank}.started").write_text(str(os.getpid()))
        faulthandler.dump_traceback_later(timeout_s, exit=True, file=2)  # fd 2: sys.stderr may be captured
        # When a peer fails the launcher sends SIGTERM; a Python-level handler would only run once the
        # rank leaves a blocking C++ wait, so let the signal terminate the process at once.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _wait_for_siblings(run_dir, world, timeout_s)
        torch.set_num_threads(threads)
        try:
            result = fn(*args)
            torch.save(result, run_dir / f"{rank}.result")
            if dist.is_initialized():
                dist.barrier()  # nobody leaves while a peer may still need it
                dist.destroy_process_group()
        except BaseException as error:
            kind = "collateral" if isinstance(error, CollectiveError) else "error"
            (run_dir / f"{rank}.{kind}").write_text(f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
            raise
        finally:
            faulthandler.cancel_dump_traceback_later()

    return entry


def _wait_for_siblings(run_dir: Path, world: int, timeout_s: float) -> None:
    """Touch no socket until every rank has been forked.

    A fork copies the parent's locks in whatever state they are in. While rank 0 connects to the
    launcher's rendezvous store, the store's server thread in the parent holds glibc's resolver
    lock (getnameinfo); a rank forked at that instant inherits it locked and hangs in its own
    first getnameinfo. Once every rank exists, nothing is forked any more and the lock is safe.
    """
    deadline = time.monotonic() + timeout_s
    while sum((run_dir / f"{r}.started").exists() for r in range(world)) < world:
        if time.monotonic() > deadline:
            raise RuntimeError(f"launch: not every one of {world} ranks started within {timeout_s}s")
        time.sleep(0.005)


def launch(fn, nproc: int, args: tuple = (), timeout_s: float = 120.0) -> list:
    """fn(*args) on `nproc` local processes (ranks 0..nproc-1) -> the list of their return values.

    fn must join the process group itself (see `init_distributed`). Raises RankFailure naming the
    failed rank(s) when any rank dies, raises or exceeds `timeout_s`.
    """
    from accelerate import notebook_launcher

    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 2:
        raise ValueError(f"nproc: launch needs an integer >= 2 processes, got {nproc!r}")
    run_dir = Path(tempfile.mkdtemp(prefix="latentmoe-launch-"))
    threads = max(1, (os.cpu_count() or 1) // nproc)
    elastic_log = logging.getLogger("torch.distributed.elastic")
    level = elastic_log.level
    try:
        elastic_log.setLevel(logging.CRITICAL)  # the agent's own failure dump; RankFailure says it better
        with _patched_env(OMP_NUM_THREADS=str(threads)), contextlib.redirect_stdout(io.StringIO()):
            notebook_launcher(_rank_entry(fn, run_dir, timeout_s, threads), args, num_processes=nproc,
                              use_port=str(free_port()))
        missing = [r for r in range(nproc) if not (run_dir / f"{r}.result").exists()]
        if missing:
            raise RankFailure(_failure_report(run_dir, nproc))
        return [torch.load(run_dir / f"{r}.result", weights_only=False) for r in range(nproc)]
    except RankFailure:
        raise
    except Exception as error:  # noqa: BLE001 - the elastic agent's ChildFailedError and friends
        raise RankFailure(_failure_report(run_dir, nproc)) from error
    finally:
        elastic_log.setLevel(level)
        shutil.rmtree(run_dir, ignore_errors=True)


def _failure_report(run_dir: Path, nproc: int) -> str:
    died, raised, collateral = [], [], []
    for r in range(nproc):
        if (run_dir / f"{r}.error").exists():
            raised.append((r, (run_dir / f"{r}.error").read_text().splitlines()[0]))
        elif (run_dir / f"{r}.collateral").exists():
            collateral.append((r, (run_dir / f"{r}.collateral").read_text().splitlines()[0]))
        elif (run_dir / f"{r}.started").exists() and not (run_dir / f"{r}.result").exists():
            died.append(r)
    why = "was stopped by the launcher after that failure" if raised else \
        "died without reporting an error (killed, crashed or watchdog timeout)"
    lines = [f"rank {r} {why}" for r in died]
    lines = [f"rank {r} raised {message}" for r, message in raised] + lines
    lines += [f"rank {r} stopped because a peer failed: {message}" for r, message in collateral]
    if not lines:
        lines = ["the launcher failed before any rank started"]
    return "parallel run failed: " + "; ".join(lines)


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
