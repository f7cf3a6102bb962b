"""Profiler noise kept off the terminal and out of notebooks, and nothing else.

torch's C++ profiler writes `USDT: ... profiler_start` / `profiler_stop` lines, and the CPU allocator warns
that a block allocated before the profile began will miss its deallocation event. Both go straight to file
descriptor 2, where Python's warning filters cannot reach. `native_stderr_without(PROFILER_NOISE)` points
fd 2 at a temporary file for the duration of a block and writes every other line back when it ends, so a
real warning is delayed to the block's end but never hidden.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

PROFILER_NOISE = (
    re.compile(r"^USDT:.*\] profiler_(start|stop)\s*$"),
    re.compile(r"^\[W\d+ [\d:.]+ CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before "
               r"the profiling started, profiler results will not include the deallocation event\s*$"),
)


def is_noise(line: str, noise: Sequence[re.Pattern] = PROFILER_NOISE) -> bool:
    return any(pattern.match(line) for pattern in noise)


@contextmanager
def native_stderr_without(noise: Sequence[re.Pattern] = PROFILER_NOISE) -> Iterator[None]:
    """Hold back what is written to fd 2 inside the block; afterwards write back the lines that are not noise."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable fd 2 (closed, or a stream without one): nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()  # Python-level writes of the block that went to fd 2
            except (OSError, ValueError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not is_noise(line, noise))
            if kept:
                os.write(2, kept.encode())
