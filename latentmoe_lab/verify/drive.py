"""Drive the engine a service file describes through the verify workload, and record each request's paths.

Passes (each a fresh Engine on the same model):
    as written   the file itself: the cold wave, then (EPLB on) a rebalance triggered and the warm wave
                 under it, then the revisit wave after the device prefix cache was dropped (engine.reset:
                 hits then come from the spill tiers when the file has them, else they are recomputed)
    tight cache  the file with memory.cache_bytes cut to one request's blocks, so the cold wave preempts
                 and (prefix caching on) evicts, spilling to the tiers the file configures; the warm wave's
                 hits then come back from them. Skipped when the first pass already preempted.
    p/d          (disaggregation on) every cold and warm prompt prefilled on an engine with the prefill
                 role's config, moved to one with the decode role's, decoded there (drive_pd.py)

Evidence of the paths a request walked comes from the engine's own records: RequestMetrics
(prefix_hit_tokens, preemptions), the engine stats' tier-hit counters, the chunk budget, the file's
sections (speculation, offload, workers, EPLB).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.config import serving_layout
from latentmoe_lab.serving.planner import plan_cache
from latentmoe_lab.serving.service_plan import check_engine_plan
from latentmoe_lab.serving.workers.pipeline_stage import plan_stages
from latentmoe_lab.verify.workload import VerifyPrompt, long_prompts

TIER_HITS = ("prefix_hits_host", "prefix_hits_disk")


@dataclasses.dataclass
class EngineRun:
    """One request as the engine served it: tokens, their logprobs, and the paths it walked."""

    prompt: VerifyPrompt
    tokens: list[int]
    logprobs: list[float]
    paths: list[str]
    error: str | None = None
    sources: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (engine key, request id) that
    # computed its tokens: one engine here, the prefill and the decode engine in the p/d pass (verify/layer.py)


def file_paths(service: ServiceConfig) -> list[str]:
    """The state-moving paths this service file turns on (names from report.PATHS)."""
    mem, par = service.memory, service.parallel
    paths = ["batching", "chunked prefill", "preemption"]
    if mem.prefix_cache.enabled:
        paths.append("prefix hit")
    if mem.prefix_cache.spills:
        paths.append("tier restore")
    if service.speculative.enabled:
        paths.append("spec verify")
    if mem.offload.enabled:
        paths.append("offload swap-in")
    if uses_workers(par):
        paths.append("worker layout")
    if service.eplb.enabled:
        paths.append("expert migration")
    if service.disaggregation.enabled:
        paths.append("p/d import")
    return paths


def uses_workers(parallel) -> bool:
    """The forward runs in worker processes: a parallel size above 1, or parallel.forward_process."""
    sizes = (parallel.tensor_parallel_size, parallel.expert_parallel_size, parallel.pipeline_parallel_size)
    return max(sizes) > 1 or parallel.forward_process


def run_passes(model, service: ServiceConfig, prompts: list[VerifyPrompt], max_tokens: int,
               tick: Callable[[int], None] = lambda n: None, make_engine=Engine) -> list[EngineRun]:
    """Every single-engine pass over the workload; tick(n) after each n finished requests (a progress bar).
    make_engine(model, service, key) builds each engine (verify's injections wrap it; key numbers the engines
    of a verify run: 0 as written, 1 tight cache)."""
    by_wave = {wave: [p for p in prompts if p.wave == wave] for wave in ("cold", "warm", "revisit")}
    runs: list[EngineRun] = []
    engine = make_engine(model, service, 0)
    try:
        runs += _wave(engine, 0, service, by_wave["cold"], max_tokens, tick)
        if engine.balancer is not None:
            engine.balancer.rebalance_next_step()
        runs += _wave(engine, 0, service, by_wave["warm"], max_tokens, tick, migrating=engine.balancer is not None)
        if service.memory.prefix_cache.spills:  # the device prefix cache dropped; hits must come from the tiers
            engine.reset()
            runs += _wave(engine, 0, service, by_wave["revisit"], max_tokens, tick)
    finally:
        engine.close()
    if not any("preemption" in r.paths for r in runs):
        tight_service = tight_cache(model.config, service, prompts, max_tokens)
        longest = tight_service.model.max_model_len - max_tokens
        tight = make_engine(model, tight_service, 1)
        try:
            runs += _wave(tight, 1, service, by_wave["cold"] + long_prompts(2, longest, prompts), max_tokens, tick)
            runs += _wave(tight, 1, service, by_wave["warm"], max_tokens, tick)
        finally:
            tight.close()
    return runs


def tight_cache(config, service: ServiceConfig, prompts: list[VerifyPrompt], max_tokens: int) -> ServiceConfig:
    """`service` with memory.cache_bytes cut to the smallest budget the engine's own planner accepts (every rank's
    plan, as Engine.__init__ makes it) for the workload's longest request, and model.max_model_len raised to
    what that cache holds, so that two requests of max_model_len cannot both fit (preemption; with prefix
    caching, eviction into the tiers). Slots, snapshot rows, formats and the layout are unchanged."""
    block = service.memory.block_size
    longest = max(len(p.token_ids) for p in prompts) + max_tokens
    model = dataclasses.replace(service.model, max_model_len=min(service.model.max_model_len,
                                                                 -(-longest // block) * block))
    shorter = dataclasses.replace(service, model=model)

    def with_budget(budget: int) -> ServiceConfig:
        return dataclasses.replace(shorter, memory=dataclasses.replace(service.memory, cache_bytes=budget))

    def accepted(budget: int) -> bool:
        try:
            check_engine_plan(with_budget(budget), config)
        except ValueError:
            return False
        return True

    low, high = 0, service.memory.cache_bytes or 1
    while not accepted(high):
        low, high = high, 2 * high
    while high - low > 1:  # the smallest accepted budget
        middle = (low + high) // 2
        low, high = (low, middle) if accepted(middle) else (middle, high)
    tight = with_budget(high)
    # a pipeline stage that needs more bytes for its KDA slots leaves the others more blocks than one request
    holds = min(_num_blocks(config, tight) * block, service.model.max_model_len)
    return dataclasses.replace(tight, model=dataclasses.replace(tight.model, max_model_len=holds))


def _num_blocks(config, service: ServiceConfig) -> int:
    """The blocks every rank of this service's layout holds (the engine's plan)."""
    layout = serving_layout(config, service.parallel)
    if layout is None:
        return plan_cache(config, service).num_blocks
    return plan_stages(config, service, layout)[0].plan.num_blocks


def _wave(engine, key: int, service: ServiceConfig, prompts: list[VerifyPrompt], max_tokens: int, tick,
          migrating: bool = False) -> list[EngineRun]:
    before = _tier_hits(engine)
    params = SamplingParams(max_tokens=max_tokens, logprobs=0)
    outputs = engine.generate([p.token_ids for p in prompts], params, use_tqdm=False)
    tier_hit = _tier_hits(engine) > before
    runs = []
    for prompt, out in zip(prompts, outputs):
        paths = paths_of(service, prompt, out, tier_hit, migrating)
        runs.append(EngineRun(prompt, list(out.token_ids), [lp.logprob for lp in out.logprobs], paths, out.error,
                              [(key, out.request_id)]))
    tick(len(prompts))
    return runs


def _tier_hits(engine) -> int:
    stats = engine.stats()
    return sum(stats.get(key, 0) for key in TIER_HITS)


def paths_of(service: ServiceConfig, prompt: VerifyPrompt, out, tier_hit: bool, migrating: bool) -> list[str]:
    metrics = out.metrics
    hit = metrics.prefix_hit_tokens if metrics else 0
    paths = ["batching"]
    if service.scheduler.chunked_prefill and len(prompt.token_ids) - hit > service.scheduler.prefill_chunk_size:
        paths.append("chunked prefill")
    if metrics and metrics.preemptions:
        paths.append("preemption")
    if hit:  # a hit in a wave in which the host/disk tiers served hits may be one of theirs
        paths += ["prefix hit", "tier restore"] if tier_hit else ["prefix hit"]
    if metrics and metrics.spec_accepted_tokens:  # a draft kept: the state slot of an accepted draft carried on
        paths.append("spec verify")
    if service.memory.offload.enabled:
        paths.append("offload swap-in")
    if uses_workers(service.parallel):
        paths.append("worker layout")
    if migrating:
        paths.append("expert migration")
    return paths
