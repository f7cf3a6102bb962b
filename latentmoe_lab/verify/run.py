"""verify_service: a service file -> VerifyReport (the whole of `latentmoe-lab verify` but printing).

The numeric mode decides the reference and the tolerance on logprobs (tokens must always be equal):

    fp32 weights and cache     model.generate + a full forward; |dlogp| <= 1e-4 (fp32 sums in other orders:
                               paged reads, chunk boundaries, a verify step's multi-token form)
    + scheduler.batch_invariant  also the same file's engine with every state-moving path off, one request at a
                               time ("solo engine"); |dlogp| = 0 against it (the engine promises the same bits
                               whatever shares a step or whatever was cached, serving/invariance.py)
    any lossy format           (bf16 / fp16 weights, a bf16 / fp8 / int8 cache) the solo engine only, |dlogp| <=
                               1e-3: the model in full precision is not what such an engine computes, but the
                               same engine on the plain path is, within summation order
"""
from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from tqdm.auto import tqdm

from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.verify.drive import EngineRun, file_paths, run_passes, uses_workers
from latentmoe_lab.verify.drive_pd import run_pd
from latentmoe_lab.verify.inject import Injector, check_injection
from latentmoe_lab.verify.layer import StepLog, engine_rows, first_divergent_tap, recording_context
from latentmoe_lab.verify.reference import Reference, reference_outputs
from latentmoe_lab.verify.report import RequestResult, VerifyReport, build_report
from latentmoe_lab.verify.workload import build_workload

FP32_TOLERANCE = 1e-4
LOSSY_TOLERANCE = 1e-3


def verify_service(config_path: str, model_dir: str | None = None, num_prompts: int = 6, max_tokens: int = 8,
                   seed: int = 0, inject: str | None = None, show_progress: bool = True) -> VerifyReport:
    """Load the file as `serve` does, build its model, run every pass, compare; see the module docstring."""
    from latentmoe_lab.server.loading import load_model, with_checkpoint
    from latentmoe_lab.serving.service_plan import load_service_config

    service = with_checkpoint(load_service_config(config_path), model_dir)
    paths_on = file_paths(service)
    check_injection(inject, paths_on)
    model = load_model(service)
    with tempfile.TemporaryDirectory(prefix="latentmoe-verify-") as scratch:
        tiers = service.memory.prefix_cache
        if tiers.disk_dir is not None:  # the file's disk tier, moved into a scratch directory: verify writes
            # nothing outside it, and entries a served engine left there cannot hit
            tiers = dataclasses.replace(tiers, disk_dir=str(Path(scratch) / "spill"))
            service = dataclasses.replace(service, memory=dataclasses.replace(service.memory, prefix_cache=tiers))
        return verify_engine(model, service, paths_on, str(config_path), num_prompts, max_tokens, seed, inject,
                             show_progress)


def verify_engine(model, service: ServiceConfig, paths_on: list[str], name: str, num_prompts: int, max_tokens: int,
                  seed: int, inject: str | None, show_progress: bool = False) -> VerifyReport:
    """The comparison on an already built model (tests call this directly)."""
    max_prompt_len = service.model.max_model_len - max_tokens
    prompts = build_workload(num_prompts, model.config.vocab_size, service.memory.block_size,
                             service.scheduler.prefill_chunk_size, max_prompt_len, seed)
    mode, tolerance, solo = numeric_mode(service)
    injector = Injector(inject)
    # at most: cold + warm, the revisit (tiers), the tight pass's cold + warm, the p/d pass's cold + warm
    total = num_prompts * (4 + service.memory.prefix_cache.spills + 2 * bool(service.disaggregation.enabled))
    with tqdm(total=total, desc="verify", disable=not show_progress) as bar:
        runs = _engine_runs(model, service, prompts, max_tokens, injector, bar.update)
        bar.total = bar.n  # the tight pass is skipped when the file's own pass already preempted
        bar.refresh()
    distinct = list({tuple(r.prompt.token_ids): None for r in runs})
    if solo:
        references = engine_reference(model, plain_path(service), [list(p) for p in distinct], max_tokens)
    else:
        references = reference_outputs(model, [list(p) for p in distinct], max_tokens)
    by_prompt = dict(zip(distinct, references))
    results = [_result(i, run, by_prompt[tuple(run.prompt.token_ids)]) for i, run in enumerate(runs)]
    report = build_report(results, paths_on, tolerance, name, mode, inject)
    if report.divergence is not None:
        report.divergence.layer = _divergent_layer(model, service, prompts, max_tokens, injector,
                                                   runs[report.divergence.request])
    return report


def _engine_runs(model, service, prompts, max_tokens, injector: Injector, tick, log: StepLog | None = None):
    """Every pass of the file over the workload (with the injection, if any); `log` records each step's layout."""
    inject = injector.engine(Engine)

    def make_engine(model, service, key):
        engine = inject(model, service)
        if log is not None:
            log.wrap(engine, key)
        return engine

    with injector.active():
        runs = run_passes(model, service, prompts, max_tokens, tick, make_engine)
        if service.disaggregation.enabled:
            runs += run_pd(model, service, prompts, max_tokens, tick, make_engine, on_payload=injector.payload)
    return runs


def _divergent_layer(model, service, prompts, max_tokens, injector: Injector, run) -> str:
    """Replay every pass with the taps on (deterministic: same workload, engines and injection) and name the
    first tap where the divergent request's own computed values leave the reference's (verify/layer.py)."""
    if uses_workers(service.parallel):
        return "not located (the forward runs in worker processes; rerun the file without a parallel: section)"
    log = StepLog()
    with recording_context(model) as recording:
        replay = _engine_runs(model, service, prompts, max_tokens, injector, lambda n: None, log)
    same = next((r for r in replay if r.sources and r.prompt == run.prompt and r.paths == run.paths), None)
    if same is None or same.tokens != run.tokens:
        return "not located (the replay did not reproduce the run)"
    rows = engine_rows(recording, log, same.sources)
    tap = first_divergent_tap(model, recording, rows, run.prompt.token_ids + run.tokens)
    return tap or "none of the layer taps differs (the difference is in sampling or the logits)"


def numeric_mode(service: ServiceConfig) -> tuple[str, float, bool]:
    """(description, logprob tolerance, whether the reference is the solo engine) of the module docstring."""
    lossy = service.model.dtype != "fp32" or service.cache_dtype != "fp32"
    if lossy:
        return (f"{service.model.dtype} weights, {service.cache_dtype} cache: against the solo engine",
                LOSSY_TOLERANCE, True)
    if service.scheduler.batch_invariant:
        return "fp32, batch-invariant: bit-exact against the solo engine", 0.0, True
    return "fp32: against model.generate and full forwards", FP32_TOLERANCE, False


def plain_path(service: ServiceConfig) -> ServiceConfig:
    """The same file with every state-moving path off: no prefix caching or tiers, no speculation, no P/D,
    no EPLB (the layout, formats and budgets stay)."""
    memory = dataclasses.replace(service.memory, prefix_cache=None)  # None: off
    data = dataclasses.replace(service, memory=memory).to_dict()
    for section in ("speculative", "disaggregation"):
        data.pop(section, None)
    data["eplb"] = {"enabled": False}
    return ServiceConfig.from_dict(data)


def engine_reference(model, service: ServiceConfig, prompts: list[list[int]], max_tokens: int) -> list[Reference]:
    """Each prompt alone in a fresh engine on `service` (plain_path): its greedy tokens and their logprobs."""
    params = SamplingParams(max_tokens=max_tokens, logprobs=0)
    references = []
    for prompt in prompts:
        engine = Engine(model, service)
        try:
            out = engine.generate([prompt], params, use_tqdm=False)[0]
        finally:
            engine.close()
        if out.error:
            raise RuntimeError(f"the solo engine failed a prompt of {len(prompt)} tokens: {out.error}")
        references.append(Reference(list(out.token_ids), [lp.logprob for lp in out.logprobs]))
    return references


def _result(index: int, run: EngineRun, reference: Reference) -> RequestResult:
    return RequestResult(index, run.prompt.wave, run.paths, run.tokens, reference.tokens, run.logprobs,
                         reference.logprobs, run.error)
