"""Prometheus metrics of the service, on its own CollectorRegistry (docs/design.md §6.6, §10).

Latencies are measured by the service from the moment a request is accepted (so they include the wait
for the engine thread and survive a retry onto a fresh engine); monotonic clocks throughout.
Gauges are set from Engine.stats() after every step. Counters of the engine (preemptions, prefix hits)
restart from zero with a restarted engine, so the service adds the engine's increments; so do the
per-rank forward and collective seconds of a parallel engine (one `rank` label per worker process).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
PREFIX = "latentmoe"
# step_failed: engine rebuilt on the same weights; worker_died / worker_hung: weights reloaded too;
# parallel_worker_lost: a parallel engine replaced its worker processes itself (Engine.stats()["worker_restarts"])
RESTART_CAUSES = ("step_failed", "worker_died", "worker_hung", "parallel_worker_lost")
ENGINE_COUNTS = ("preemptions", "prefix_hit_tokens", "worker_restarts", "spec_draft_tokens", "spec_accepted_tokens",
                 "prefix_dsa_hit_tokens", "prefix_kda_snapshots_reused", "prefix_tokens_recomputed")


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes etc., read by the soak run
        r, p = self.registry, PREFIX

        def histogram(name, what):
            return Histogram(f"{p}_{name}_seconds", what, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = histogram("time_to_first_token", "request accepted -> first generated token")
        self.tpot = histogram("time_per_output_token", "mean decode interval of a request (2+ tokens)")
        self.itl = histogram("inter_token_latency", "every interval between two generated tokens")
        self.e2e = histogram("e2e_request_latency", "request accepted -> finished")
        self.step_time = histogram("engine_step", "one Engine.step()")
        self.running = Gauge(f"{p}_requests_running", "requests the engine is running", registry=r)
        self.waiting = Gauge(f"{p}_requests_waiting", "requests the engine holds waiting", registry=r)
        self.blocks_used = Gauge(f"{p}_kv_blocks_used", "paged KV blocks held by requests", registry=r)
        self.blocks_free = Gauge(f"{p}_kv_blocks_free", "paged KV blocks not held by requests", registry=r)
        self.slots_used = Gauge(f"{p}_kda_slots_used", "KDA state slots held by requests", registry=r)
        self.slots_free = Gauge(f"{p}_kda_slots_free", "KDA state slots free", registry=r)
        self.cached_blocks = Gauge(f"{p}_prefix_cached_blocks", "blocks kept by the prefix cache", registry=r)
        self.preemptions = Counter(f"{p}_preemptions", "sequences preempted (recompute)", registry=r)
        self.prefix_hit_tokens = Counter(f"{p}_prefix_hit_tokens", "prompt tokens served from the prefix cache",
                                         registry=r)
        # the two kinds of a hybrid hit apart (serving/prefix_hits.py): dsa = hit + recomputed
        self.prefix_kinds = {
            "prefix_dsa_hit_tokens": Counter(f"{p}_prefix_dsa_hit_tokens", "prompt tokens whose DSA rows were "
                                             "found in the prefix cache", registry=r),
            "prefix_kda_snapshots_reused": Counter(f"{p}_prefix_kda_snapshots_reused", "prefix hits that restored "
                                                   "a KDA state snapshot", registry=r),
            "prefix_tokens_recomputed": Counter(f"{p}_prefix_tokens_recomputed", "cached prompt tokens computed "
                                                "again from the nearest KDA snapshot before them", registry=r)}
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter(f"{p}_generation_tokens", "tokens generated", registry=r)
        self.requests = Counter(f"{p}_requests_finished", "finished requests by finish reason", ["reason"],
                                registry=r)
        self.errors = Counter(f"{p}_request_errors", "refused or failed requests by kind", ["kind"], registry=r)
        self.retries = Counter(f"{p}_request_retries", "request re-queues after a failed engine step", registry=r)
        self.restarts = Counter(f"{p}_engine_restarts", "engine restarts, by cause", ["cause"], registry=r)
        for cause in RESTART_CAUSES:
            self.restarts.labels(cause=cause)  # exported at 0 from the start
        self.rank_seconds = {  # keys: the Engine.stats() lists, one value per rank
            "rank_forward_seconds": Counter(f"{p}_rank_forward_seconds", "a worker rank's part of the engine "
                                            "steps (its layers, collectives included)", ["rank"], registry=r),
            "rank_collective_seconds": Counter(f"{p}_rank_collective_seconds", "a worker rank's seconds in "
                                               "collectives and pipeline send / receive", ["rank"], registry=r)}
        self.rank_resident = Gauge(f"{p}_worker_resident_memory_bytes", "a worker rank's resident memory at its "
                                   "last step (the server process's own is process_resident_memory_bytes)",
                                   ["rank"], registry=r)
        # expert-parallel load (parallel/eplb/load.py): mean / max routed tokens per EP rank over the
        # recorder's window, averaged over MoE layers; routed tokens per (MoE layer, logical expert)
        self.expert_balancedness = Gauge(f"{p}_expert_balancedness", "mean / max routed tokens per EP rank over "
                                         "the last eplb.window_steps steps, averaged over MoE layers", registry=r)
        self.expert_tokens = Counter(f"{p}_expert_tokens", "tokens routed to a logical expert of an MoE layer",
                                     ["layer", "expert"], registry=r)
        self.eplb_bytes_moved = Counter(f"{p}_eplb_bytes_moved", "expert weight bytes copied by EPLB migrations",
                                        registry=r)
        # prefix cache spill (serving/cache_tiers/spill.py): Engine.stats() has these keys only with a spilling
        # memory.prefix_cache, and the series appear when it does
        self.prefix_hits = Counter(f"{p}_prefix_hits", "prefix-cache hits by the deepest tier they read "
                                   "(refused: a spilled entry failed its checks and was recomputed)", ["tier"],
                                   registry=r)
        self.spill_bytes = Counter(f"{p}_prefix_spill_bytes", "bytes the prefix-cache spill copied, by direction",
                                   ["direction"], registry=r)
        # speculative decoding (docs/design.md §12), under vLLM's names: drafts verified, accepted, per position
        self.spec_counts = {
            "spec_draft_tokens": Counter("vllm:spec_decode_num_draft_tokens", "draft tokens verified", registry=r),
            "spec_accepted_tokens": Counter("vllm:spec_decode_num_accepted_tokens", "draft tokens accepted",
                                            registry=r)}
        self.spec_per_position = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "draft tokens accepted "
                                         "at each draft position", ["position"], registry=r)
        self.engine_replaced()

    def observe_engine(self, stats: dict) -> None:
        """Engine.stats() after a step -> gauges, and the engine's counter increments since the last call."""
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.blocks_used.set(stats["blocks_used"])
        self.blocks_free.set(stats["num_blocks"] - stats["blocks_used"])
        self.slots_used.set(stats["slots_used"])
        self.slots_free.set(stats["num_slots"] - stats["slots_used"])
        self.cached_blocks.set(stats["cached_blocks"])
        for name, counter in (("preemptions", self.preemptions), ("prefix_hit_tokens", self.prefix_hit_tokens),
                              ("worker_restarts", self.restarts.labels(cause="parallel_worker_lost"))):
            increment = stats[name] - self._engine_counts[name]
            if increment > 0:
                counter.inc(increment)
            self._engine_counts[name] = stats[name]
        for name, counter in self.rank_seconds.items():
            seen = self._rank_seconds[name]
            seen += [0.0] * (len(stats[name]) - len(seen))
            for rank, total in enumerate(stats[name]):
                counter.labels(rank=str(rank)).inc(max(total - seen[rank], 0.0))
                seen[rank] = total
        for rank, resident in enumerate(stats["rank_resident_bytes"]):
            self.rank_resident.labels(rank=str(rank)).set(resident)
        self.expert_balancedness.set(stats.get("expert_balancedness", 1.0))  # an engine without MoE: 1
        for layer, row in enumerate(stats.get("expert_tokens", [])):
            for expert, total in enumerate(row):
                key = (layer, expert)
                if total > self._expert_tokens.get(key, 0):
                    self.expert_tokens.labels(layer=str(layer), expert=str(expert)).inc(
                        total - self._expert_tokens.get(key, 0))
                self._expert_tokens[key] = total
        for name, counter in (self.spec_counts | self.prefix_kinds).items():
            increment = stats.get(name, 0) - self._engine_counts[name]
            if increment > 0:
                counter.inc(increment)
            self._engine_counts[name] = stats.get(name, 0)
        for position, total in enumerate(stats.get("spec_accepted_per_position", [])):
            seen = self._spec_per_position.get(position, 0)
            if total > seen:
                self.spec_per_position.labels(position=str(position)).inc(total - seen)
            self._spec_per_position[position] = total
        moved = stats.get("eplb_bytes_moved", 0)
        if moved > self._engine_counts["eplb_bytes_moved"]:
            self.eplb_bytes_moved.inc(moved - self._engine_counts["eplb_bytes_moved"])
        self._engine_counts["eplb_bytes_moved"] = moved
        for key, (counter, label) in self._spill_series().items():
            if key in stats:
                series = counter.labels(label)  # exported from the first step on, at 0 until it counts
                increment = stats[key] - self._engine_counts.get(key, 0)
                if increment > 0:
                    series.inc(increment)
                self._engine_counts[key] = stats[key]

    def _spill_series(self) -> dict:
        """Engine.stats() key -> (counter, label value) of the prefix-cache spill."""
        hits = {f"prefix_hits_{tier}": (self.prefix_hits, tier) for tier in ("device", "host", "disk", "refused")}
        return hits | {f"spill_bytes_{way}": (self.spill_bytes, way) for way in
                       ("device_to_host", "host_to_disk", "host_to_device", "disk_to_device")}

    def engine_replaced(self) -> None:
        """A fresh engine counts from zero again."""
        self._engine_counts = dict.fromkeys(ENGINE_COUNTS + ("eplb_bytes_moved",), 0)
        self._expert_tokens: dict[tuple[int, int], int] = {}
        self._spec_per_position: dict[int, int] = {}
        self._rank_seconds: dict[str, list[float]] = {name: [] for name in self.rank_seconds}

    def observe_finished(self, reason: str, token_times: list[float], accepted: float, finished: float) -> None:
        self.requests.labels(reason=reason).inc()
        self.e2e.observe(finished - accepted)
        if token_times:
            self.ttft.observe(token_times[0] - accepted)
        for a, b in zip(token_times, token_times[1:]):
            self.itl.observe(b - a)
        if len(token_times) > 1:
            self.tpot.observe((token_times[-1] - token_times[0]) / (len(token_times) - 1))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
