"""The router of a disaggregated service: instance processes, one request's way through them, faults
(docs/design.md §13.2).

    submit -> a prefill instance (the one with the fewest requests) -> its first token goes to the client at
    once -> its payload (the encoded RequestCache) -> a decode instance -> "imported" (the ack) -> the prefill
    instance releases its blocks -> the decode instance's tokens -> the client.

The router lives in the server process: one reader thread and one sender thread per instance, so that no
thread ever holds the router's lock while it waits on a socket (a prefill sending a payload and the router
sending it a command at once would otherwise wait on each other). Every payload passes through the router
(the transport "pipe": a Unix socket pair per instance).

Faults:
    an instance process dies        its channel closes (EOFError, also part way through a payload), the
    (also mid-transfer)             reader notices at once: every request it held and no decode instance has
                                    imported yet is recomputed from its prompt + tokens so far on a prefill
                                    instance; the instance is restarted (weights reloaded) on its own thread,
                                    up to max_restarts times. A decode instance's requests that a prefill
                                    instance still holds are released there first.
    a payload fails its checksum    the decode instance refuses it; the prefill instance, which still holds
                                    the rows, exports and sends them again (MAX_RESENDS times, then recompute)
    one dies while starting, or     liveness.py: restarted again with a growing delay (within max_restarts),
    is stopped (SIGSTOP)            or reported by /health at once and killed after STUCK_KILL_S to be replaced
Greedy outputs equal an unfaulted run's; a recomputed request continues with a generator seeded from (seed,
tokens so far), as the server's EngineWorker does.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from typing import Callable

from latentmoe_lab.serving.client_request import RequestEvent
from latentmoe_lab.serving.config import ServiceConfig
from latentmoe_lab.serving.disagg.instance import InstanceFaults, InstanceSpec
from latentmoe_lab.serving.disagg.instance_handle import Instance
from latentmoe_lab.serving.disagg.liveness import restart_delay, stopped_problem, watch_stopped
from latentmoe_lab.serving.disagg.router_request import RoutedRequest, TransferRecord
from latentmoe_lab.serving.disagg.section import role_config
from latentmoe_lab.serving.sampling import SamplingParams

log = logging.getLogger(__name__)
MAX_RESENDS = 3
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


class Router:
    """Starts the instances of a service file's disaggregation: section and routes requests through them."""

    def __init__(self, config: ServiceConfig, model_loader: Callable, max_restarts: int = 10,
                 faults: dict[str, InstanceFaults] | None = None, on_transfer: Callable | None = None):
        if not config.disaggregation.enabled:
            raise ValueError("disaggregation: the service file has no disaggregation: section")
        self.config, self.model_loader, self.max_restarts = config, model_loader, max_restarts
        self.faults = faults or {}  # instance name ("prefill0") -> its first process's faults (tests)
        self.on_transfer = on_transfer  # called with the TransferRecord of every acked transfer
        self.counts = {"transfers": 0, "transfer_bytes": 0, "transfer_seconds": 0.0, "refused": 0,
                       "recomputed": 0}
        self.restarts = {"prefill": 0, "decode": 0}
        self.gave_up = False
        self._lock = threading.RLock()
        self._requests: dict[int, RoutedRequest] = {}
        self._backlog: deque[RoutedRequest] = deque()  # waiting for a prefill instance
        self._next_key = 0
        self._stopping = False
        self._started = False  # start() returned: a lost instance is restarted, even one still starting
        self._failed_starts: dict[str, int] = {}  # instance name -> replacements lost before they were ready
        self._threads: list[threading.Thread] = []
        d = config.disaggregation
        self.instances = {"prefill": [self._launch(role_config(config, "prefill"), "prefill", i, 0)
                                      for i in range(d.prefill_instances)],
                          "decode": [self._launch(role_config(config, "decode"), "decode", i, 0)
                                     for i in range(d.decode_instances)]}

    # ------------------------------------------------------------- lifecycle
    def start(self) -> "Router":
        """Wait for every instance to be ready; a start-up refusal (an engine that would not build, weights or
        cache formats that differ between the roles) stops them all and raises ValueError."""
        from latentmoe_lab.serving.transport import check_compatible

        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            for instance in self.all_instances():
                while not instance.ready.wait(0.1):
                    if instance.start_error or not instance.alive or time.monotonic() > deadline:
                        raise ValueError(f"disaggregation.{instance.spec.role}: instance {instance.name} did not "
                                         f"start: {instance.start_error or 'it exited or timed out'}")
            reference = self.instances["prefill"][0].identity
            for instance in self.all_instances():
                try:
                    check_compatible(reference, instance.identity)
                except ValueError as error:
                    raise ValueError(f"disaggregation.{instance.spec.role}: instance {instance.name} cannot take "
                                     f"prefill0's transfers: {error}") from None
        except BaseException:
            self.stop()
            raise
        with self._lock:
            self._started = True
        self._spawn(watch_stopped, (self.all_instances, lambda: self._stopping), "router-watch")
        return self

    @property
    def vocab_size(self) -> int:
        return self.instances["prefill"][0].vocab_size

    def all_instances(self) -> list[Instance]:
        return [*self.instances["prefill"], *self.instances["decode"]]

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            instances = self.all_instances()
        for instance in instances:
            instance.send(("stop",))
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for instance in instances:
            instance.process.join(timeout=max(0.1, deadline - time.monotonic()))
            if instance.process.is_alive():
                instance.process.kill()
                instance.process.join(timeout=5)
            instance.outbox.put(None)
            instance.channel.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def step_logs(self, timeout: float = 30.0) -> dict[str, list]:
        """Instance name -> its engine's step records (serving.metrics.StepRecord, the latest
        scheduler.max_log_records), asked of every running instance; a restarted instance's log starts anew.
        TimeoutError naming the instances that did not answer."""
        with self._lock:
            asked = [i for i in self.all_instances() if i.alive and i.ready.is_set()]
            for instance in asked:
                instance.step_log = None
                instance.step_log_ready.clear()
                instance.send(("steplog",))
        deadline = time.monotonic() + timeout
        silent = [i.name for i in asked if not i.step_log_ready.wait(max(0.0, deadline - time.monotonic()))]
        if silent:
            raise TimeoutError(f"step logs: no answer from {', '.join(silent)} within {timeout:g} s")
        return {instance.name: instance.step_log for instance in asked}

    def problem(self) -> str | None:
        """Why the service cannot serve right now (for /health), or None."""
        if self.gave_up:
            return f"restarts exhausted (server.max_restarts {self.max_restarts})"
        for instance in self.all_instances():
            if not (instance.alive and instance.ready.is_set()):
                return f"{instance.spec.role} instance {instance.name} is restarting"
            stopped = stopped_problem(instance)
            if stopped is not None:
                return stopped
        return None

    # ---------------------------------------------------------------- requests
    def submit(self, prompt_ids: list[int], params: SamplingParams, deliver: Callable[[RequestEvent], None]) -> int:
        """Queue a request; its events arrive through deliver (on a reader thread). QueueFullError past
        scheduler.max_batch_size requests in the service."""
        from latentmoe_lab.serving.engine import QueueFullError

        limit = self.config.scheduler.max_batch_size
        with self._lock:
            if self.gave_up:
                raise RuntimeError("engine unavailable: restarts exhausted")
            if len(self._requests) >= limit:
                raise QueueFullError(f"queue full: scheduler.max_batch_size ({limit}) requests are already "
                                     f"waiting or running")
            request = RoutedRequest(self._next_key, list(prompt_ids), params, deliver)
            self._next_key += 1
            self._requests[request.key] = request
            self._to_prefill(request)
            return request.key

    def abort(self, key: int, reason: str = "abort") -> None:
        with self._lock:
            request = self._requests.get(key)
            if request is None:
                return
            for instance in (request.prefill, request.decode):
                if instance is not None:
                    instance.send(("abort", key))
            if request in self._backlog:
                self._backlog.remove(request)
            self._finish(request, reason, None)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._requests)

    # -------------------------------------------------------------- routing
    def _to_prefill(self, request: RoutedRequest) -> None:
        """Under the lock: send a request (or its recompute) to the least busy ready prefill instance."""
        ready = [i for i in self.instances["prefill"] if i.alive and i.ready.is_set()]
        if not ready:
            self._backlog.append(request)
            return
        instance = min(ready, key=lambda i: sum(r.prefill is i for r in self._requests.values()))
        prompt, params = request.resumed()
        if request.generated and params.max_tokens <= 0:  # a recompute with everything generated: only the
            # end was lost (a fresh max_tokens 0 request scores its prompt on the prefill instance)
            self._finish(request, "length", None)
            return
        request.prefill, request.decode, request.payload = instance, None, None
        request.prompt_sent = len(prompt)
        instance.send(("add", request.key, prompt, params))

    def _to_decode(self, request: RoutedRequest) -> None:
        ready = [i for i in self.instances["decode"] if i.alive and i.ready.is_set()]
        if not ready:
            return  # kept in request.payload until a decode instance is ready
        instance = min(ready, key=lambda i: sum(r.decode is i for r in self._requests.values()))
        start, payload = request.payload
        request.decode, request.payload = instance, None
        instance.send(("import", request.key, start), payload)

    def _recompute(self, request: RoutedRequest) -> None:
        """Under the lock: the request's cache is lost (or refused too often): recompute it on a prefill."""
        if request.prefill is not None and request.prefill.alive:
            request.prefill.send(("release", request.key))
        request.prefill = request.decode = request.payload = None
        request.recomputes += 1
        self.counts["recomputed"] += 1
        self._to_prefill(request)

    def _event(self, instance: Instance, header: tuple, payload: bytes) -> None:
        """Under the lock: one event of an instance."""
        kind = header[0]
        if kind == "failed":
            instance.start_error = header[1]
            return
        if kind == "ready":
            instance.identity, instance.vocab_size, instance.pid = header[1:4]
            self._failed_starts.pop(instance.name, None)
            instance.ready.set()
            self._flush()
            return
        if kind == "stats":
            instance.stats = header[1]
            return
        if kind == "steplog":
            instance.step_log = header[1]
            instance.step_log_ready.set()
            return
        request = self._requests.get(header[1])
        if request is None:  # finished or aborted meanwhile: give back what the instance still holds
            if kind == "payload":
                instance.send(("release", header[1]))
            return
        if kind == "tokens":
            _, _, token_ids, logprobs, prompt_logprobs = header
            now = time.monotonic()
            request.generated += token_ids
            request.token_times += [now] * len(token_ids)
            request.deliver(RequestEvent(list(token_ids), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                         source=(instance.spec.role, instance.name)))
        elif kind == "finished":
            self._finish(request, header[2], header[3], (instance.spec.role, instance.name))
        elif kind == "payload":
            request.payload, request.exporter = (header[2], payload), instance.name
            self._to_decode(request)
        elif kind == "imported":
            _, _, size, seconds, start = header
            self.counts["transfers"] += 1
            self.counts["transfer_bytes"] += size
            self.counts["transfer_seconds"] += seconds
            if self.on_transfer is not None:
                self.on_transfer(TransferRecord(request.key, size, start, seconds, request.prompt_sent,
                                                request.exporter, instance.name))
            if request.prefill is not None:
                request.prefill.send(("release", request.key))  # the ack: the prefill side frees its blocks
                request.prefill = None
        elif kind == "refused":
            self.counts["refused"] += 1
            log.warning("request %d: transfer refused by %s: %s", request.key, instance.name, header[2])
            request.decode = None
            if header[2].startswith("transfer_incompatible"):
                self._finish(request, "error", header[2])
            elif request.resends < MAX_RESENDS and request.prefill is not None and request.prefill.alive:
                request.resends += 1
                request.prefill.send(("resend", request.key))
            else:
                self._recompute(request)

    def _finish(self, request: RoutedRequest, reason: str, error: str | None,
                source: tuple[str, str] | None = None) -> None:
        if self._requests.pop(request.key, None) is None:
            return
        request.deliver(RequestEvent([], True, reason, error, source=source))

    def _flush(self) -> None:
        """Under the lock: requests parked while no instance of a role was ready."""
        backlog, self._backlog = self._backlog, deque()
        for request in backlog:
            self._to_prefill(request)
        for request in list(self._requests.values()):
            if request.payload is not None and request.decode is None:
                self._to_decode(request)

    # ------------------------------------------------------------- processes
    def _launch(self, config: ServiceConfig, role: str, index: int, generation: int) -> Instance:
        config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, forward_process=False))
        name = f"{role}{index}"
        faults = self.faults.get(name, InstanceFaults()) if generation == 0 else InstanceFaults()
        instance = Instance(InstanceSpec(role, index, config, self.model_loader, faults), generation)
        for target, label in ((self._read, "reader"), (Router._send, "sender")):
            self._spawn(target, (instance,), f"router-{name}-{label}")
        return instance

    def _spawn(self, target: Callable, args: tuple, name: str) -> None:
        """A daemon thread of the router, joined by stop()."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    @staticmethod
    def _send(instance: Instance) -> None:
        while True:
            item = instance.outbox.get()
            if item is None:
                return
            try:
                instance.channel.send(*item)
            except OSError:
                return  # the reader sees the channel close and handles the loss

    def _read(self, instance: Instance) -> None:
        while True:
            try:
                header, payload = instance.channel.recv()
            except (EOFError, OSError) as error:
                self._lost(instance, error)
                return
            with self._lock:
                if self._stopping:
                    return
                self._event(instance, header, payload)

    def _lost(self, instance: Instance, error: Exception) -> None:
        with self._lock:
            instance.alive = False
            instance.outbox.put(None)
            if self._stopping:
                return
            role = instance.spec.role
            if not instance.ready.is_set():
                instance.start_error = instance.start_error or f"the process ended during start-up ({error})"
                if not self._started:
                    return  # start() raises it
                self._failed_starts[instance.name] = self._failed_starts.get(instance.name, 0) + 1
                log.warning("%s instance %s ended before it was ready (%s); restarting it", role, instance.name,
                            instance.start_error)
            else:
                log.warning("%s instance %s lost (%s); recomputing its requests", role, instance.name, error)
            for request in list(self._requests.values()):
                if role == "prefill" and request.prefill is instance:
                    if request.decode is None:
                        self._recompute(request)
                    else:
                        request.prefill = None  # its payload arrived whole; the rows died with the process
                elif role == "decode" and request.decode is instance:
                    self._recompute(request)
            if self.restarts[role] >= self.max_restarts:
                self._give_up(f"{role} instance {instance.name} lost, restarts exhausted")
                return
            self.restarts[role] += 1
        self._spawn(self._restart, (instance,), f"router-restart-{instance.name}")

    def _restart(self, old: Instance) -> None:
        old.process.join(timeout=5)
        old.channel.close()
        time.sleep(restart_delay(self._failed_starts.get(old.name, 0)))  # longer after each failed start
        with self._lock:
            if self._stopping:
                return
            fresh = self._launch(old.spec.config, old.spec.role, old.spec.index, old.generation + 1)
            group = self.instances[old.spec.role]
            group[group.index(old)] = fresh

    def _give_up(self, why: str) -> None:
        log.error("disaggregated service gives up: %s; requests fail at once, /health answers 503", why)
        self.gave_up = True
        for request in list(self._requests.values()):
            self._finish(request, "error", f"engine_unavailable: {why}")
