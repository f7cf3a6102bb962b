"""EngineWorker: the engine on its own thread, with request-level retry and restarts (docs/design.md §10).

The HTTP side never touches the Engine. It calls submit() / abort(), which put a command on a queue;
the engine thread takes the commands between steps, steps while there is work, and hands each
request's events to that request's `deliver` callback (the app makes it thread-safe with
loop.call_soon_threadsafe).

Faults, and what the worker does about them:

    a step raises StepError       the engine settled it (serving/failures.py): the step's requests went
    (its forward or sampling)     back for recompute and, if several, were split into two isolation
                                  groups (bisection, none charged); one alone is charged one retry, and
                                  past server.max_retries fails alone with error "engine_step_failed".
                                  The worker counts the retries and delivers what finished; the engine
                                  steps on, pools and prefix cache kept.
    a step raises anything else   the engine's state is not trusted: every in-flight request is charged
                                  one retry (nobody is named), those past server.max_retries fail, the
                                  engine is reset (Engine.reset: everything aborted, same pools and
                                  weights) and the rest re-queued with prompt + tokens so far.
    the engine thread dies        the watchdog sees it within a poll (0.2 s): the weights are reloaded, a
                                  fresh engine and thread started, every in-flight request re-queued.
    a step hangs                  past server.step_timeout_s the same restart; the old thread, when it
                                  returns, finds its generation stale and exits without a word.
    a parallel worker process     the engine replaces its worker group itself and recomputes (serving/
    dies or hangs                 workers/parallel_runner.py); counted as restarts{cause="parallel_worker_lost"}.

So a request that breaks every step it is in fails alone after exactly server.max_retries retries, and
its step-mates are charged nothing; data-dependent failures the engine can pin on one request at once
(non-finite logits, bad images) it ends alone without a retry. A request re-queued by the worker continues
with a generator seeded from (seed, tokens so far), so greedy outputs equal an unfaulted run exactly and
sampled seeded ones stay reproducible (one recomputed inside the engine keeps its own generator). After
server.max_restarts restarts the worker gives up: requests fail, /health 503.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from latentmoe_lab.server.lifecycle import closed_line
from latentmoe_lab.server.prom import ServerMetrics
from latentmoe_lab.server.settings import ServerSettings
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig, StepError
from latentmoe_lab.serving.client_request import ClientRequest, RequestEvent

log = logging.getLogger(__name__)
WATCHDOG_POLL_S = 0.2
IDLE_WAIT_S = 0.5
STOP_TIMEOUT_S = 30


@dataclass(eq=False)
class _Request(ClientRequest):
    retries: int = 0
    engine_id: int | None = None
    aborted: bool = False
    prompt_logprobs_sent: bool = False


class EngineWorker:
    def __init__(self, config: ServiceConfig, settings: ServerSettings, model_factory: Callable,
                 metrics: ServerMetrics | None = None):
        # one knob for the retries of a request: server.max_retries, applied in the engine
        self.config = dataclasses.replace(config, scheduler=dataclasses.replace(
            config.scheduler, max_step_retries=settings.max_retries))
        self.settings = settings
        self.metrics = metrics or ServerMetrics()
        self._model_factory = model_factory
        self._lock = threading.Condition()
        self._commands: deque = deque()
        self._requests: dict[int, _Request] = {}  # key -> request, until its end is delivered
        self._by_engine_id: dict[int, _Request] = {}
        self._next_key = 0
        self._generation = 0
        self._step_started: float | None = None
        self._stopping = False
        self.restarts = 0
        self.gave_up = False
        self.last_stats: dict = {}
        self.model = None  # loaded by start(), reloaded by a restart
        self.engine: Engine | None = None
        self._thread: threading.Thread | None = None
        self._spawned: list[threading.Thread] = []
        self._watchdog: threading.Thread | None = None

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self.model = self._model_factory()
        self.engine = Engine(self.model, self.config)
        self._publish_stats()
        self._thread = self._spawn(self._generation)
        self._watchdog = threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)
        self._watchdog.start()

    def stop(self) -> str:
        """Stop the engine threads and close the engine; returns what it did (serve's shutdown line)."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        # every engine thread, also one a restart left behind in a hung step: none may still run torch
        # code when the interpreter exits (that aborts the process)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for thread in [*self._spawned, self._watchdog]:
            if thread is not None:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.engine is None:
            return "no engine was running"
        written = self.engine.stats().get("spill_bytes_host_to_disk", 0)
        self.engine.close()  # a parallel engine's worker processes; the prefix cache to its disk_dir
        return closed_line(self.config, written, self.engine.stats())

    def alive(self) -> bool:
        return not self.gave_up and self._thread is not None and self._thread.is_alive()

    def health_problem(self) -> str | None:
        """Why the service cannot serve right now (for /health), or None: restarts exhausted, no engine thread,
        a step running past server.health_stall_s, or a forward worker process stopped or gone."""
        if self.gave_up:
            return f"restarts exhausted (server.max_restarts {self.settings.max_restarts})"
        if not self.alive():
            return "the engine thread is not running (the watchdog restarts it)"
        started = self._step_started
        if started is not None and time.monotonic() - started > self.settings.health_stall_s:
            return (f"stalled: a step has run for {time.monotonic() - started:.1f} s "
                    f"(server.health_stall_s {self.settings.health_stall_s:g})")
        down = self.engine.runner.unavailable_workers()
        return None if not down else f"forward worker {down[0]}"

    # -------------------------------------------------------------- HTTP side
    def submit(self, prompt_ids: list[int], params: SamplingParams,
               deliver: Callable[[RequestEvent], None]) -> Future:
        """Queue a request; the future gives its key once the engine accepted it, or the engine's refusal
        (QueueFullError, ValueError). Events then arrive through deliver, on the engine thread."""
        future: Future = Future()
        with self._lock:
            if self.gave_up:
                future.set_exception(RuntimeError("engine unavailable: restarts exhausted"))
                return future
            request = _Request(self._next_key, list(prompt_ids), params, deliver)
            self._next_key += 1
            self._commands.append(("add", request, future))
            self._lock.notify_all()
        return future

    def abort(self, key: int, reason: str = "abort") -> None:
        """End a request early: the client left ("abort") or its text reached a stop string ("stop")."""
        with self._lock:
            self._commands.append(("abort", (key, reason), None))
            self._lock.notify_all()

    # ----------------------------------------------------------- engine thread
    def _spawn(self, generation: int) -> threading.Thread:
        thread = threading.Thread(target=self._run, args=(generation,), name=f"engine-{generation}", daemon=True)
        thread.start()
        self._spawned.append(thread)
        return thread

    def _run(self, generation: int) -> None:
        try:
            self._loop(generation)
        except BaseException:  # noqa: BLE001 - the thread ends here; the watchdog restarts the engine
            log.exception("engine thread %d died; the watchdog restarts it", generation)

    def _loop(self, generation: int) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._commands or self._engine_busy(generation)):
                    self._lock.wait(IDLE_WAIT_S)
                if self._stopping or generation != self._generation:
                    return
                commands, self._commands = list(self._commands), deque()
                engine = self.engine
                accepted: list[tuple[Future, int]] = []
                for command in commands:
                    self._run_command(engine, *command, accepted)
                if commands:
                    self._publish_stats()  # an abort frees blocks without a step
                for future, key in accepted:  # after the stats: a client told "accepted" sees itself in /health
                    future.set_result(key)
                if not engine.has_unfinished():
                    continue
                started = self._step_started = time.monotonic()
            try:
                outputs = engine.step()  # the only long call, outside the lock
            except StepError as error:
                with self._lock:
                    if generation == self._generation:
                        self._settled_step_failure(error)
                continue
            except Exception as error:  # noqa: BLE001 - any step failure is retried, reported by kind
                with self._lock:
                    if generation == self._generation:
                        self._recover_from_step(engine, error)
                continue
            finally:
                if generation == self._generation:
                    self._step_started = None
            with self._lock:
                if generation != self._generation:
                    return  # a restart replaced this thread while it stepped
                self.metrics.step_time.observe(time.monotonic() - started)
                self._publish_stats()  # first: a client that got its token sees the step's stats
                for out in outputs:
                    self._deliver_output(out)

    def _engine_busy(self, generation: int) -> bool:
        return generation == self._generation and self.engine is not None and self.engine.has_unfinished()

    def _run_command(self, engine: Engine, kind: str, payload, future: Future | None,
                     accepted: list[tuple[Future, int]]) -> None:
        """Run one queued add or abort; an add's future goes into `accepted`, set once the stats are out."""
        if kind == "abort":
            key, reason = payload
            request = self._requests.get(key)
            if request is None:
                return  # already finished
            request.aborted = True
            if self._by_engine_id.pop(request.engine_id, None) is not None:
                engine.abort(request.engine_id)
            self._finish(request, reason, None)
            return
        request = payload
        if request.aborted:
            return
        prompt, params = request.resumed()
        try:
            request.engine_id = engine.add_request(prompt, params)
        except Exception as error:  # noqa: BLE001 - ValueError / QueueFullError are the client's; any other
            if future is not None:  # is still this request's alone, and its future must not hang
                future.set_exception(error)
                return
            self._finish(request, "error", f"engine_requeue_failed: {error}")
            return
        self._by_engine_id[request.engine_id] = request
        if future is not None:
            self._requests[request.key] = request
            self.metrics.prompt_tokens.inc(len(request.prompt_ids))
            accepted.append((future, request.key))

    def _deliver_output(self, out) -> None:
        request = self._by_engine_id.get(out.request_id)
        if request is None:
            return
        prompt_logprobs = None
        if out.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            prompt_logprobs, request.prompt_logprobs_sent = out.prompt_logprobs, True
        if out.new_token_ids or prompt_logprobs is not None:
            now = time.monotonic()
            request.generated += out.new_token_ids
            request.token_times += [now] * len(out.new_token_ids)
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
            logprobs = out.logprobs[len(out.logprobs) - len(out.new_token_ids):] if out.logprobs else []
            request.deliver(RequestEvent(list(out.new_token_ids), logprobs=logprobs, prompt_logprobs=prompt_logprobs))
        if out.finished:
            del self._by_engine_id[out.request_id]
            self._finish(request, out.finish_reason, out.error)

    def _finish(self, request: _Request, reason: str, error: str | None) -> None:
        if self._requests.pop(request.key, None) is None:
            return
        self.metrics.observe_finished(reason, request.token_times, request.accepted, time.monotonic())
        if reason == "error":
            self.metrics.errors.labels(kind=(error or "error").split(":")[0]).inc()
        request.deliver(RequestEvent([], True, reason, error))

    def _publish_stats(self) -> None:
        self.last_stats = self.engine.stats()
        self.metrics.observe_engine(self.last_stats)

    # -------------------------------------------------------------- recovery
    def _settled_step_failure(self, error: StepError) -> None:
        """Under the lock: the engine blamed and re-queued the step's requests itself; count, deliver."""
        log.warning("engine step failed (requests %s, retried %s): %r", error.request_ids, error.retried,
                    error.cause)
        for engine_id in error.retried:
            request = self._by_engine_id.get(engine_id)
            if request is not None:
                request.retries += 1
                self.metrics.retries.inc()
        self._publish_stats()
        for out in error.outputs:
            self._deliver_output(out)

    def _recover_from_step(self, engine: Engine, error: Exception) -> None:
        """Under the lock: a failure the engine did not settle. Charge everyone in flight (nobody is
        named), reset the engine (same pools and weights), re-queue what is left."""
        log.warning("engine step failed outside the forward: %r; resetting the engine", error)
        message = f"engine_step_failed: {type(error).__name__}: {error}"
        for request in list(self._by_engine_id.values()):
            if request.retries >= self.settings.max_retries:
                self._finish(request, "error", f"{message} (after {self.settings.max_retries} retries)")
            else:
                request.retries += 1
                self.metrics.retries.inc()
        self.metrics.restarts.labels(cause="step_failed").inc()
        try:
            engine.reset()
        except RuntimeError:  # its bookkeeping leaked: a fresh engine instead, the weights kept
            log.exception("engine reset found a leak; building a fresh engine")
            self._replace_engine(Engine(self.model, self.config))
            return
        self._requeue_in_flight()

    def _replace_engine(self, engine: Engine) -> None:
        """Under the lock: swap in a fresh engine and put every unfinished request at the queue's front."""
        previous, self.engine = self.engine, engine
        if previous is not None:
            previous.close()  # a parallel engine's workers; a hung step of it then fails and its thread exits
        self.metrics.engine_replaced()
        self._requeue_in_flight()

    def _requeue_in_flight(self) -> None:
        """Under the lock: the engine holds none of our requests now; every unfinished one goes back to the
        front of the command queue, with prompt + tokens so far."""
        self._by_engine_id = {}
        queued = {id(command[1]) for command in self._commands if command[0] == "add"}
        requeue = [("add", r, None) for r in self._requests.values() if id(r) not in queued]
        for request in self._requests.values():
            request.engine_id = None
        self._commands.extendleft(reversed(requeue))
        self._publish_stats()
        self._lock.notify_all()

    def _watch(self) -> None:
        while True:
            time.sleep(WATCHDOG_POLL_S)
            with self._lock:
                if self._stopping or self.gave_up:
                    return
                started = self._step_started
                hung = started is not None and time.monotonic() - started > self.settings.step_timeout_s
                dead = not self._thread.is_alive()
                if not (hung or dead):
                    continue
                self._generation += 1  # the old thread, if it ever returns, exits without delivering
                generation = self._generation
                self._step_started = None
            self._restart("worker_hung" if hung else "worker_died", generation)

    def _restart(self, cause: str, generation: int) -> None:
        """Reload the weights, start a fresh engine and thread; gives up past server.max_restarts."""
        self.metrics.restarts.labels(cause=cause).inc()
        if self.restarts >= self.settings.max_restarts:
            with self._lock:
                self.gave_up = True
                for request in list(self._requests.values()):
                    self._finish(request, "error", f"engine_unavailable: {cause}, restarts exhausted "
                                                   f"({self.settings.max_restarts})")
                for kind, payload, future in self._commands:
                    if future is not None:
                        future.set_exception(RuntimeError("engine unavailable: restarts exhausted"))
                self._commands.clear()
            return
        self.restarts += 1
        model = self._model_factory()  # outside the lock: submits keep queueing meanwhile
        engine = Engine(model, self.config)
        with self._lock:
            self.model = model
            self._replace_engine(engine)
            self._thread = self._spawn(generation)
