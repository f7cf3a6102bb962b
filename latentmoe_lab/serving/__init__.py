"""The serving engine (docs/design.md §6): paged hybrid cache, continuous batching, chunked prefill,
preemption by recompute and prefix caching with KDA state snapshots.

    config.py         ServiceConfig: the YAML service file (§6.1)
    planner.py        a byte budget -> blocks and slots, every cache counted (§6.2); service_plan.py per device
    block_manager.py  refcounted blocks, KDA slots, the hash-chained prefix cache with snapshots (§6.3, §6.5)
    sequence.py       one request's tokens, holdings and clock readings
    scheduler.py      what runs in a step: decodes, prefill chunks, admissions, preemption (§6.5)
    model_runner.py   a scheduled batch -> ForwardBatch -> logits (§6.4)
    sampling.py       SamplingParams and per-request generators
    inputs.py         prompts (ids, text, images) -> checked token ids + images
    metrics.py        TTFT / TPOT / ITL / queue / e2e, per step records, percentiles (§6.6)
    failures.py       a failed step: StepError, blame by bisection, retries, failing alone (§6.5)
    engine.py         Engine: add_request / step / abort / reset / generate / stream / stats (§6.6)
    workload.py       the synthetic serve-bench workload; cli.py: plan-service and serve-bench
    spec/             speculative decoding (§12): the drafters (ngram, mtp) behind one interface

    from latentmoe_lab.serving import Engine, ServiceConfig, SamplingParams
"""
from latentmoe_lab.serving.config import ServiceConfig
from latentmoe_lab.serving.engine import Engine, QueueFullError, RequestOutput
from latentmoe_lab.serving.failures import StepError
from latentmoe_lab.serving.sampling import SamplingParams

__all__ = ["Engine", "QueueFullError", "RequestOutput", "SamplingParams", "ServiceConfig", "StepError"]
