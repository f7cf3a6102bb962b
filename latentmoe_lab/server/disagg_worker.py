"""DisaggWorker: the HTTP app's worker for a disaggregated service (docs/design.md §13.2).

It offers what the app asks of EngineWorker (submit, abort, health_problem, config, settings, metrics, model,
restarts, last_stats) on top of serving/disagg/router.py, so that clients see the same API; /metrics adds a
`role` and `instance` label to what each instance reports (DisaggMetrics).
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Callable

from prometheus_client import Counter, Gauge, Histogram

from latentmoe_lab.checkpoint_checks import resolve_checkpoint_dir
from latentmoe_lab.server.prom import LATENCY_BUCKETS, PREFIX, ServerMetrics
from latentmoe_lab.server.settings import ServerSettings
from latentmoe_lab.serving import ServiceConfig
from latentmoe_lab.serving.client_request import RequestEvent
from latentmoe_lab.serving.disagg.router import Router
from latentmoe_lab.serving.disagg.router_request import TransferRecord

INSTANCE_GAUGES = ("running", "waiting", "held", "blocks_used", "slots_used")


class DisaggMetrics:
    """Per role and instance: TTFT (prefill), TPOT (decode), transfers, queue depth and cache use."""

    def __init__(self, metrics: ServerMetrics):
        r, p = metrics.registry, PREFIX
        self.ttft = Histogram(f"{p}_role_time_to_first_token_seconds", "request accepted -> first token, by the "
                              "prefill instance that made it", ["role", "instance"], buckets=LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram(f"{p}_role_time_per_output_token_seconds", "mean interval of the tokens a decode "
                              "instance made for a request", ["role", "instance"], buckets=LATENCY_BUCKETS, registry=r)
        self.transfer_bytes = Counter(f"{p}_transfer_bytes", "bytes of acknowledged cache transfers", registry=r)
        self.transfer_seconds = Histogram(f"{p}_transfer_seconds", "export start on the prefill instance -> "
                                          "import done on the decode instance", buckets=LATENCY_BUCKETS, registry=r)
        self.transfers_refused = Counter(f"{p}_transfers_refused", "payloads a decode instance refused "
                                         "(checksum or format)", registry=r)
        self.recomputed = Counter(f"{p}_requests_recomputed", "requests recomputed after a lost instance or "
                                  "refused transfers", registry=r)
        self.instance_restarts = Counter(f"{p}_instance_restarts", "instance processes restarted", ["role"], registry=r)
        self.queue_depth = Gauge(f"{p}_instance_queue_depth", "requests an instance holds: running + waiting + "
                                 "held for a transfer", ["role", "instance"], registry=r)
        self.instance = {name: Gauge(f"{p}_instance_{name}", f"{name} of an instance at its last step",
                                     ["role", "instance"], registry=r) for name in INSTANCE_GAUGES}
        self._seen = {"refused": 0, "recomputed": 0, "prefill": 0, "decode": 0}

    def observe(self, router: Router) -> None:
        """Gauges from the instances' last stats; counters by the router's increments."""
        for instance in router.all_instances():
            labels = {"role": instance.spec.role, "instance": instance.name}
            self.queue_depth.labels(**labels).set(instance.queue_depth())
            for name, gauge in self.instance.items():
                gauge.labels(**labels).set(instance.stats.get(name, 0))
        for name, counter in (("refused", self.transfers_refused), ("recomputed", self.recomputed)):
            self._bump(name, router.counts[name], counter)
        for role in ("prefill", "decode"):
            self._bump(role, router.restarts[role], self.instance_restarts.labels(role=role))

    def _bump(self, name: str, total: int, counter) -> None:
        if total > self._seen[name]:
            counter.inc(total - self._seen[name])
            self._seen[name] = total


class DisaggWorker:
    def __init__(self, config: ServiceConfig, settings: ServerSettings, model_loader: Callable,
                 metrics: ServerMetrics | None = None, faults: dict | None = None):
        self.config, self.settings = config, settings
        self.metrics = metrics or ServerMetrics()
        self.roles = DisaggMetrics(self.metrics)
        self._model_loader, self._faults = model_loader, faults
        self.router: Router | None = None
        self.model = None  # .config.vocab_size from the instances (the weights live there), .name_or_path
        self.last_stats: dict = {}
        self.transfers: deque[TransferRecord] = deque(maxlen=10_000)  # the latest ones

    @property
    def restarts(self) -> int:
        return 0 if self.router is None else sum(self.router.restarts.values())

    def start(self) -> None:
        self.router = Router(self.config, self._model_loader, self.settings.max_restarts, self._faults,
                             on_transfer=self._transferred).start()
        # what tokenizer_of reads: the tokenizer files of the checkpoint the instances loaded, as from_pretrained
        # records them on a colocated model, so both encode and decode text alike (no weights load here)
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=self.router.vocab_size),
                                     name_or_path=_checkpoint_directory(self.config))
        self._publish()

    def stop(self) -> str:
        """Stop the instance processes (each closes its engine, writing its prefix cache to disk_dir if it has
        one); returns what it did (serve's shutdown line)."""
        if self.router is None:
            return "no instance was running"
        self.router.stop()
        names = [instance.name for instance in self.router.all_instances()]
        return f"instance processes {', '.join(names)} stopped (each closed its engine)"

    def health_problem(self) -> str | None:
        self._publish()
        return self.router.problem()

    def submit(self, prompt_ids: list[int], params, deliver: Callable[[RequestEvent], None]) -> Future:
        future: Future = Future()
        accepted, token_times, decode_times = time.monotonic(), [], []

        def relay(event: RequestEvent) -> None:
            if event.token_ids:
                now = time.monotonic()
                role, name = event.source
                if not token_times:  # the first token: from a prefill instance (or a recompute's)
                    self.roles.ttft.labels(role=role, instance=name).observe(now - accepted)
                token_times.extend([now] * len(event.token_ids))
                if role == "decode":
                    decode_times.extend([(now, name)] * len(event.token_ids))
                self.metrics.generation_tokens.inc(len(event.token_ids))
            if event.finished:
                self._finished(event, accepted, token_times, decode_times)
            deliver(event)

        try:
            key = self.router.submit(prompt_ids, params, relay)
        except Exception as error:  # noqa: BLE001 - QueueFullError / RuntimeError: the client's answer
            future.set_exception(error)
            return future
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        self._publish()
        future.set_result(key)
        return future

    def abort(self, key: int, reason: str = "abort") -> None:
        self.router.abort(key, reason)

    def _finished(self, event: RequestEvent, accepted: float, token_times: list[float], decode_times: list) -> None:
        self.metrics.observe_finished(event.finish_reason, token_times, accepted, time.monotonic())
        if event.finish_reason == "error":
            self.metrics.errors.labels(kind=(event.error or "error").split(":")[0]).inc()
        if len(decode_times) > 1:  # the mean interval of the tokens the (last) decode instance made
            (first, _), (last, name) = decode_times[0], decode_times[-1]
            self.roles.tpot.labels(role="decode", instance=name).observe((last - first) / (len(decode_times) - 1))
        self._publish()

    def _transferred(self, transfer: TransferRecord) -> None:
        self.transfers.append(transfer)
        self.roles.transfer_bytes.inc(transfer.size)
        self.roles.transfer_seconds.observe(transfer.seconds)

    def _publish(self) -> None:
        """/health's figures: the service's blocks and slots over all instances (0 and 0 after a drain)."""
        router = self.router
        self.roles.observe(router)
        stats = [instance.stats for instance in router.all_instances()]
        self.last_stats = {name: sum(s.get(name, 0) for s in stats)
                           for name in ("running", "waiting", "held", "blocks_used", "slots_used")}
        self.last_stats["in_flight"] = router.in_flight()


def _checkpoint_directory(config: ServiceConfig) -> str | None:
    """The directory the instances load (model.checkpoint, resolved as from_pretrained resolves it); None: a preset."""
    checkpoint = config.model.checkpoint
    return None if checkpoint is None else str(resolve_checkpoint_dir(checkpoint))
