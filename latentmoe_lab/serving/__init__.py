"""The serving engine (docs/design.md §6): paged hybrid cache, continuous batching, chunked prefill,
preemption by recompute and prefix caching with KDA state snapshots.

The core, at the top (read in this order; nano-vllm's roles):
    config.py          ServiceConfig: the YAML service file (§6.1); each feature's section lives with the feature
    planner.py         a byte budget -> blocks and slots, every cache counted (§6.2); service_plan.py per device,
                       and the checks of a loaded file (load_service_config); host_limits.py what this host holds
    block_manager.py   refcounted blocks, KDA slots, the hash-chained prefix cache with snapshots (§6.3, §6.5);
                       prefix_hits.py a hit at any block boundary: DSA rows, the nearest snapshot, the tail
    sequence.py        one request's tokens, holdings and clock readings
    scheduler.py       what runs in a step: decodes, prefill chunks, admissions, preemption (§6.5)
    model_runner.py    a scheduled batch -> ForwardBatch -> logits (§6.4); it owns the pools (read/write rows)
    sampling.py        SamplingParams and per-request generators; step_sampling.py a step's logits -> tokens;
                       logprobs.py the returned log-probabilities
    inputs.py          prompts (ids, text, images) -> checked token ids + images
    failures.py        a failed step: StepError, blame by bisection, retries, failing alone (§6.5)
    engine.py          Engine: add_request / step / abort / reset / generate / stream / stats (§6.6)
    client_request.py  a request as a front end holds it (the server's worker, the disaggregated router)
    metrics.py         TTFT / TPOT / ITL / queue / e2e, per step records, percentiles (§6.6)
    invariance.py      batch-invariant serving (scheduler.batch_invariant): tokens independent of step-mates
    serve_bench.py     serve-bench's run on one engine; bench_workload.py its synthetic workload
The features, one sub-package each:
    spec/              speculative decoding (§12): the drafters (ngram, mtp) behind one interface
    cache_tiers/       the prefix-cache spill to host and disk, DSA rows in a host tier (§15)
    transport/         one request's cache as rows, out of one engine and into another (§13.1)
    disagg/            prefill/decode disaggregation as a service: instances and the router (§13.2)
    workers/           the worker processes of a parallel layout (§10)

    from latentmoe_lab.serving import Engine, ServiceConfig, SamplingParams
"""
from latentmoe_lab.serving.config import ServiceConfig
from latentmoe_lab.serving.engine import Engine, QueueFullError, RequestOutput
from latentmoe_lab.serving.failures import StepError
from latentmoe_lab.serving.sampling import SamplingParams

__all__ = ["Engine", "QueueFullError", "RequestOutput", "SamplingParams", "ServiceConfig", "StepError"]
