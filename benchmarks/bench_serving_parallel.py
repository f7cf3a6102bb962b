"""Parallel serving benchmarks (issue 16): EP2xTP2 on 4 worker processes and PP2 on 2 against one process, and recovery.

    .venv/bin/python benchmarks/bench_serving_parallel.py            # tiny, 16 prompts x 64 tokens, 32 new
    .venv/bin/python benchmarks/bench_serving_parallel.py --quick    # 4 prompts, 8 new tokens: the harness

throughput  greedy Engine.generate of the same prompts, one process vs EP2xTP2 (the engine process plus 4
            gloo workers) and vs PP2 (2 workers: layers [0, 2) then [2, 4), hidden states sent between
            them), each torch thread 1; generated tokens / wall seconds, best of --repeats, after a
            warm-up run each. Under EP2xTP2 every worker runs every token (TP splits widths, EP duplicates
            the routing of the broadcast tokens); under PP2 a step passes the stages in turn (one step in
            flight, a 1/2 bubble). On a CPU with fewer cores than processes this measures overhead.
            Also every rank's forward and collective milliseconds per step (every run, the warm-up
            included; a PP stage's collective time includes waiting for the stage before it).
recovery    one EP2xTP2 worker killed with SIGKILL mid-generation: seconds of the step that saw it
            (detection, the group killed, 4 fresh workers with the weights reloaded), then seconds from
            the kill to the next token, and whether every output equals the unfaulted run.
Writes benchmarks/bench_serving_parallel.json.
"""
from __future__ import annotations

import os
import signal
import time

import torch
from common import apply_threads, machine_info, make_parser, write_json

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig

SERVICE = {"model": {"preset": "tiny", "max_model_len": 1024},
           "memory": {"max_num_seqs": 16, "block_size": 16, "cache_bytes": 8_000_000},
           "scheduler": {"max_batch_size": 64, "prefill_chunk_size": 1024}}
EP2TP2 = SERVICE | {"parallel": {"tensor_parallel_size": 2, "expert_parallel_size": 2}}
PP2 = SERVICE | {"parallel": {"pipeline_parallel_size": 2}}


def per_rank_ms(engine: Engine) -> dict:
    """Every rank's forward and collective milliseconds per step, and the collective share of each."""
    stats = engine.stats()
    forward, collective = stats["rank_forward_seconds"], stats["rank_collective_seconds"]
    return {"forward_ms_per_step": [round(1e3 * f / stats["steps"], 2) for f in forward],
            "collective_ms_per_step": [round(1e3 * c / stats["steps"], 2) for c in collective],
            "collective_share": [round(c / f, 3) for c, f in zip(collective, forward)]}


def tokens_per_second(engine: Engine, prompts: list, params: SamplingParams, repeats: int) -> tuple[float, list]:
    engine.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    best, outputs = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = engine.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return sum(len(o.token_ids) for o in outputs) / best, [o.token_ids for o in outputs]


def recovery(engine: Engine, prompts: list, params: SamplingParams) -> dict:
    ids = [engine.add_request(p, params) for p in prompts]
    results, killed, failing_step, next_token = {}, None, None, None
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        if killed is not None and failing_step is None:
            failing_step = time.perf_counter() - start
        if killed is not None and next_token is None and any(o.new_token_ids for o in outputs):
            next_token = time.perf_counter() - killed
        results.update({o.request_id: o.token_ids for o in outputs if o.finished})
        if killed is None and any(seq.generated_ids for seq in engine.scheduler.running):
            os.kill(engine.runner.pids[2], signal.SIGKILL)
            killed = time.perf_counter()
    return {"failing_step_s": round(failing_step, 2), "kill_to_next_token_s": round(next_token, 2),
            "outputs": [results[i] for i in ids]}


def main() -> None:
    parser = make_parser(__doc__, 1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    apply_threads(args)
    count, new_tokens = (4, 8) if args.quick else (16, 32)
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny")).eval()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, model.config.vocab_size, (64,), generator=generator).tolist() for _ in range(count)]
    params = SamplingParams(max_tokens=new_tokens)
    single, reference = tokens_per_second(Engine(model, ServiceConfig.from_dict(SERVICE)), prompts, params,
                                          args.repeats)
    engine = Engine(model, ServiceConfig.from_dict(EP2TP2))
    try:
        parallel, outputs = tokens_per_second(engine, prompts, params, args.repeats)
        forward = per_rank_ms(engine)
        recovered = recovery(engine, prompts, params)
    finally:
        engine.close()
    engine = Engine(model, ServiceConfig.from_dict(PP2))
    try:
        pipelined, pp_outputs = tokens_per_second(engine, prompts, params, args.repeats)
        pp_forward = per_rank_ms(engine) | {"stages": [str(stage.layers) for stage in engine.stages]}
    finally:
        engine.close()
    result = {"machine": machine_info(cores=os.cpu_count(), load_average=os.getloadavg()[0]),
              "workload": {"prompts": count, "prompt_tokens": 64, "new_tokens": new_tokens, "preset": "tiny"},
              "one_process_tokens_per_s": round(single, 1), "ep2tp2_tokens_per_s": round(parallel, 1),
              "ep2tp2_equals_one_process": outputs == reference, "ep2tp2_per_rank": forward,
              "pp2_tokens_per_s": round(pipelined, 1), "pp2_equals_one_process": pp_outputs == reference,
              "pp2_per_rank": pp_forward,
              "recovery": {k: v for k, v in recovered.items() if k != "outputs"},
              "recovered_outputs_equal": recovered["outputs"] == reference}
    print(result)
    print("wrote", write_json(__file__, result))


if __name__ == "__main__":
    main()
