"""The router's handle of one instance process: the process, its channel, its outbox (docs/design.md §13.2)."""
from __future__ import annotations

import multiprocessing
import queue
import socket
import threading

from latentmoe_lab.serving.disagg.channel import Channel
from latentmoe_lab.serving.disagg.instance import InstanceSpec, run_instance
from latentmoe_lab.serving.workers.parallel_runner import _children_without_main


class Instance:
    """The router's handle of one instance process and its channel."""

    def __init__(self, spec: InstanceSpec, generation: int):
        self.spec, self.generation = spec, generation
        self.ready = threading.Event()
        self.alive = True
        self.identity = self.vocab_size = self.pid = None
        self.stats: dict = {}
        self.step_log: list | None = None  # the engine's step records, when Router.step_logs asked for them
        self.step_log_ready = threading.Event()
        self.outbox: queue.Queue = queue.Queue()
        self.start_error: str | None = None
        ours, theirs = socket.socketpair()
        self.channel = Channel(ours)
        context = multiprocessing.get_context("forkserver")
        # not a daemon: an instance with tensor_parallel_size > 1 starts worker processes of its own (a daemon
        # may not); if the server dies without stopping it, its channel closes and it exits by itself
        self.process = context.Process(target=run_instance, args=(spec, theirs), name=f"latentmoe-{spec.name}")
        with _children_without_main():  # the target and its arguments all come from this package
            self.process.start()
        theirs.close()

    @property
    def name(self) -> str:
        return self.spec.name

    def send(self, header: tuple, payload: bytes = b"") -> None:
        self.outbox.put((header, payload))

    def queue_depth(self) -> int:
        return self.stats.get("running", 0) + self.stats.get("waiting", 0) + self.stats.get("held", 0)
