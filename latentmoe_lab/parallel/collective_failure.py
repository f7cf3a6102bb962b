"""Name the collective a rank was in when torch.distributed gave up on it.

gloo ends a collective that a peer never joins with "Timed out waiting 60000ms for recv operation to
complete", and one whose peer died with "Connection closed by peer": neither names the rank, the
collective or the code that called it. Collectives issued through parallel/comm.py already raise
CollectiveError with those names; those issued by torch itself (FSDP2's reduce-scatter, DTensor
redistributions, pipelining's sends) or straight through torch.distributed (the native expert
All-to-All) do not. So the
launcher hands every rank's error to `named_collective_failure`, which reads the traceback for the
innermost torch.distributed function and the innermost caller outside torch:

    rank 0: all_to_all_single in _all_to_all (expert.py:47) did not return within the group timeout
    (a peer never joined it, or waits in a different collective): ... Timed out waiting 60000ms ...

A timeout makes this rank a root cause (CollectiveTimeout); a peer that went away makes it collateral
(CollectiveError), which the launcher's report lists after the ranks that failed first.
"""
from __future__ import annotations

import re
import traceback
from pathlib import Path

import torch

from latentmoe_lab.parallel.comm import CollectiveError

_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_PEER_GONE = re.compile(r"connection (closed|reset) by peer|broken pipe|connection refused", re.IGNORECASE)
_C10D_FILE = "distributed_c10d.py"


class CollectiveTimeout(CollectiveError):
    """A collective did not return within the group timeout: this rank waited for a peer that never joined."""


def named_collective_failure(error: BaseException, rank: int) -> CollectiveError | None:
    """A CollectiveTimeout / CollectiveError naming the rank, the collective and its caller; None when `error`
    is not a failed torch.distributed collective (or already names itself)."""
    if isinstance(error, CollectiveError) or not isinstance(error, RuntimeError):
        return None
    detail = " ".join(str(error).split())
    timed_out = bool(_TIMED_OUT.search(detail))
    if not timed_out and not _PEER_GONE.search(detail):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    collective = next((f.name for f in reversed(frames) if f.filename.endswith(_C10D_FILE)), "a collective")
    torch_dir = Path(torch.__file__).parent
    caller = next((f"{f.name} ({Path(f.filename).name}:{f.lineno})" for f in reversed(frames)
                   if not Path(f.filename).is_relative_to(torch_dir)), None)
    where = f"{collective} in {caller}" if caller else collective
    if timed_out:
        return CollectiveTimeout(f"rank {rank}: {where} did not return within the group timeout (a peer never "
                                 f"joined it, or waits in a different collective): {detail}")
    return CollectiveError(f"rank {rank}: {where} failed because a peer went away: {detail}")
