"""Liveness of a disaggregated service's instance processes (docs/design.md §13.2), for the router.

    a replacement lost before it was ready   restarted again after restart_delay (0.5 s, 1 s, 2 s ... at most
    (killed while loading its weights)       30 s), within the router's max_restarts, after which the service
                                              gives up and says so (/health 503, requests fail at once)
    an instance stopped (SIGSTOP, a frozen   /health reports it at once (stopped_problem); after STUCK_KILL_S
    host)                                    watch_stopped kills it, so that it is replaced and its requests
                                              recomputed like those of any lost instance

The state is read from Linux /proc (parallel_runner._process_state), not from the process handle, whose
sentinel the router's reader threads may be reading.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from latentmoe_lab.serving.workers.parallel_runner import _process_state

log = logging.getLogger(__name__)
RESTART_BACKOFF_S = (0.5, 30.0)  # first delay, longest delay
STUCK_KILL_S = 30.0
WATCH_POLL_S = 1.0


def restart_delay(failed_starts: int) -> float:
    """Seconds to wait before starting an instance whose last `failed_starts` replacements died starting."""
    if failed_starts <= 0:
        return 0.0
    first, most = RESTART_BACKOFF_S
    return min(first * 2 ** (failed_starts - 1), most)


def stopped_problem(instance) -> str | None:
    """/health's reason when the instance's process is stopped, else None."""
    if _process_state(instance.process) != "stopped":
        return None
    return (f"{instance.spec.role} instance {instance.name} (pid {instance.process.pid}) is stopped (SIGSTOP): its "
            f"requests wait; it is replaced after {STUCK_KILL_S:g} s")


def watch_stopped(instances: Callable[[], list], stopping: Callable[[], bool]) -> None:
    """Until stopping(): kill an instance stopped for STUCK_KILL_S (its reader then sees the channel close)."""
    stopped_since: dict[str, float] = {}
    while not stopping():
        time.sleep(WATCH_POLL_S)
        now = time.monotonic()
        for instance in instances():
            if not instance.alive or _process_state(instance.process) != "stopped":
                stopped_since.pop(instance.name, None)
                continue
            since = stopped_since.setdefault(instance.name, now)
            if now - since >= STUCK_KILL_S and not stopping():
                log.warning("%s instance %s stopped for %.0f s; killing it to replace it", instance.spec.role,
                            instance.name, now - since)
                stopped_since.pop(instance.name, None)
                instance.process.kill()
