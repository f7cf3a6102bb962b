"""What logprobs=5 costs in tokens/s (issue 25): the same greedy requests with and without logprobs.

    .venv/bin/python benchmarks/bench_logprobs.py            # tiny preset, 16 requests, 32 new tokens, 5 repeats
    .venv/bin/python benchmarks/bench_logprobs.py --quick    # 4 requests, 8 new tokens, 1 repeat

engine   Engine.generate in this process: SamplingParams(logprobs=5) against none (each generated token's
         log_softmax row, its logprob and top 5, on the engine thread)
http     the openai client against a live server on 127.0.0.1 (forward in this process): logprobs=5 on
         /v1/completions, non-streaming, against none (adds the JSON of the logprobs objects)
Runs alternate (none, logprobs, none, ...) and each figure is the median of --repeats. Outputs are
checked equal. Writes benchmarks/bench_logprobs.json.
"""
from __future__ import annotations

import statistics
import threading
import time

import openai
from common import apply_threads, machine_info, make_parser, write_json

from latentmoe_lab.server.loading import load_model
from latentmoe_lab.server.settings import split_service_dict
from latentmoe_lab.server.threaded import start_service
from latentmoe_lab.serving import Engine, SamplingParams

SERVICE = {"model": {"name": "bench", "preset": "tiny", "max_model_len": 1024},
           "memory": {"max_num_seqs": 16, "block_size": 16, "cache_bytes": 8_000_000},
           "scheduler": {"max_batch_size": 64, "prefill_chunk_size": 1024}}


def prompts(n: int) -> list[str]:
    return [(f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 2)[:64] for i in range(n)]


def engine_run(engine, texts, new_tokens, logprobs) -> tuple[float, list]:
    start = time.perf_counter()
    outs = engine.generate([list(t.encode()) for t in texts], SamplingParams(max_tokens=new_tokens, logprobs=logprobs),
                           use_tqdm=False)
    return time.perf_counter() - start, [o.token_ids for o in outs]


def http_run(url, texts, new_tokens, logprobs) -> tuple[float, list]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=300)
    outputs: list = [None] * len(texts)

    def one(i):
        try:
            choice = client.completions.create(model="bench", prompt=texts[i], max_tokens=new_tokens,
                                               temperature=0, logprobs=logprobs).choices[0]
            outputs[i] = choice.model_extra["token_ids"]
        except openai.OpenAIError as error:  # reported below: a failed run has no figure
            outputs[i] = error

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    failed = [out for out in outputs if isinstance(out, Exception)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(texts)} requests failed: {failed[0]}")
    return elapsed, outputs


def measure(run, target, texts, new_tokens, repeats) -> dict:
    seconds = {"none": [], "logprobs5": []}
    outputs = {}
    run(target, texts[:2], 2, None)  # warm-up
    for _ in range(repeats):
        for name, logprobs in (("none", None), ("logprobs5", 5)):
            elapsed, outputs[name] = run(target, texts, new_tokens, logprobs)
            seconds[name].append(elapsed)
    tokens = len(texts) * new_tokens
    rate = {name: tokens / statistics.median(values) for name, values in seconds.items()}
    return {"seconds": seconds, "tokens_per_s": rate, "overhead": 1 - rate["logprobs5"] / rate["none"],
            "identical": outputs["none"] == outputs["logprobs5"]}


def main() -> None:
    parser = make_parser(__doc__, default_threads=1)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each variant (default: %(default)s)")
    args = parser.parse_args()
    apply_threads(args)
    count, new_tokens, repeats = (4, 8, 1) if args.quick else (16, 32, args.repeats)
    texts = prompts(count)
    config, _ = split_service_dict(SERVICE)
    result = machine_info(requests=count, new_tokens=new_tokens, repeats=repeats)
    result["engine"] = measure(engine_run, Engine(load_model(config), config), texts, new_tokens, repeats)
    with start_service(SERVICE) as (served, _):
        result["http"] = measure(http_run, served.url, texts, new_tokens, repeats)
    for name in ("engine", "http"):
        r = result[name]
        print(f"{name:6s} tokens/s none {r['tokens_per_s']['none']:.1f}  logprobs=5 {r['tokens_per_s']['logprobs5']:.1f}"
              f"  overhead {100 * r['overhead']:.1f}%  outputs identical: {r['identical']}")
    print(f"wrote {write_json(__file__, result)}")


if __name__ == "__main__":
    main()
