"""Inference service benchmarks (issue 16): the HTTP service against the in-process engine, and recovery.

    .venv/bin/python benchmarks/bench_server.py            # tiny preset, 16 concurrent, 32 new tokens
    .venv/bin/python benchmarks/bench_server.py --quick    # 4 concurrent, 8 new tokens: checks the harness

overhead   16 concurrent greedy requests (64-byte prompts): wall time through the openai client against a
           live server on 127.0.0.1 (non-streaming and SSE) against Engine.generate of the same 16 prompts
           in this process; median of --repeats, interleaved (target: <= 15% at 16 concurrent). The clients
           run in a separate process, as a user's clients would (--clients-in-process: in this one, where
           their JSON parsing competes with the server and the engine for one GIL). The server runs its
           forward in a worker process (parallel.forward_process, as configs/service-cpu.yaml does;
           --forward-in-server: on the engine thread, sharing the event loop's GIL).
recovery   the engine thread is killed (an exception that escapes its loop) mid-generation with 16 streams
           running: seconds from the kill to the first token any client gets after it (the watchdog poll,
           the weights reloaded, the pools rebuilt, then the first step of the fresh engine, which
           recomputes prompt + tokens so far and samples the next token), and whether every
           stream still equals the unfaulted run. With the forward in a worker process, also kill -9 of
           that process: seconds from the kill to the next token (a fresh process, weights reloaded,
           recompute).
Writes benchmarks/bench_server.json. The soak figures come from `latentmoe-lab soak` (see RESULTS.md).
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


class EngineKilled(BaseException):
    """Escapes the step loop, so the engine thread ends as if it had crashed."""


def service(concurrency: int, forward_process: bool) -> dict:
    return {"model": {"name": "bench", "preset": "tiny", "max_model_len": 1024},
            "parallel": {"forward_process": forward_process},
            "memory": {"max_num_seqs": concurrency, "block_size": 16, "cache_bytes": 8_000_000},
            "scheduler": {"max_batch_size": 4 * concurrency, "prefill_chunk_size": 1024}}


def prompts(n: int) -> list[str]:
    return [(f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 2)[:64] for i in range(n)]


def over_http_here(url: str, texts: list[str], new_tokens: int, stream: bool) -> tuple[float, list[list[int]]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=300)
    outputs: list = [None] * len(texts)
    times: list = [None] * len(texts)

    def one(i):
        result = client.completions.create(model="bench", prompt=texts[i], max_tokens=new_tokens, temperature=0,
                                           stream=stream)
        if stream:
            ids, stamps = [], []
            for chunk in result:
                ids += chunk.choices[0].model_extra["token_ids"]
                stamps.append(time.monotonic())
            outputs[i], times[i] = ids, stamps
        else:
            outputs[i] = result.choices[0].model_extra["token_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, outputs if not stream else (outputs, times)


def client_process():
    """One spawned process that runs `over_http_here` (its time is measured inside it, so start-up is left out)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))


def main() -> None:
    parser = make_parser(__doc__, default_threads=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients-in-process", action="store_true",
                        help="run the client threads in the server's process (the earlier measurement)")
    parser.add_argument("--forward-in-server", action="store_true",
                        help="run the server's forward on its engine thread (parallel.forward_process false)")
    args = parser.parse_args()
    apply_threads(args)
    concurrency, new_tokens = (4, 8) if args.quick else (16, 32)
    spec = service(concurrency, forward_process=not args.forward_in_server)
    config, _ = split_service_dict(service(concurrency, forward_process=False))  # the in-process baseline
    texts = prompts(concurrency)
    engine = Engine(load_model(config), config)
    params = SamplingParams(max_tokens=new_tokens)
    reference = [o.token_ids for o in engine.generate([list(t.encode()) for t in texts], params, use_tqdm=False)]
    runs = {"engine": [], "http": [], "http_sse": []}
    clients = None if args.clients_in_process else client_process()

    def over_http(url, texts, new_tokens, stream):
        if clients is None:
            return over_http_here(url, texts, new_tokens, stream)
        return clients.submit(over_http_here, url, texts, new_tokens, stream).result()

    with start_service(spec) as (served, worker):
        over_http(served.url, texts, new_tokens, stream=False)  # warm-up (and the client process's imports)
        for _ in range(args.repeats):
            start = time.perf_counter()
            assert [o.token_ids for o in engine.generate([list(t.encode()) for t in texts], params,
                                                         use_tqdm=False)] == reference
            runs["engine"].append(time.perf_counter() - start)
            seconds, outputs = over_http(served.url, texts, new_tokens, stream=False)
            assert outputs == reference
            runs["http"].append(seconds)
            seconds, (outputs, _) = over_http(served.url, texts, new_tokens, stream=True)
            assert outputs == reference
            runs["http_sse"].append(seconds)
        recovery = measure_recovery(served.url, worker, texts, new_tokens, reference)
        if not args.forward_in_server:
            recovery["forward_process_killed"] = measure_process_kill(served.url, worker, texts, new_tokens,
                                                                      reference)
    if clients is not None:
        clients.shutdown()
    median = {k: statistics.median(v) for k, v in runs.items()}
    result = machine_info(concurrency=concurrency, new_tokens=new_tokens, repeats=args.repeats, seconds=runs,
                          clients="in the server's process" if args.clients_in_process else "a separate process",
                          forward="the engine thread" if args.forward_in_server else "a worker process",
                          median_s=median, overhead_http=median["http"] / median["engine"] - 1,
                          overhead_sse=median["http_sse"] / median["engine"] - 1, recovery=recovery)
    print(f"{concurrency} concurrent x {new_tokens} tokens: engine {median['engine']:.2f} s, "
          f"HTTP {median['http']:.2f} s ({result['overhead_http']:+.1%}), "
          f"SSE {median['http_sse']:.2f} s ({result['overhead_sse']:+.1%})")
    print(f"recovery after a killed engine thread: {recovery['seconds_to_first_token']:.2f} s to the next token, "
          f"outputs equal the unfaulted run: {recovery['outputs_equal']}")
    if "forward_process_killed" in recovery:
        killed = recovery["forward_process_killed"]
        print(f"recovery after kill -9 of the forward process: {killed['seconds_to_next_token']:.2f} s to the "
              f"next token, outputs equal the unfaulted run: {killed['outputs_equal']}")
    print(f"wrote {write_json(__file__, result)}")


def measure_process_kill(url: str, worker, texts: list[str], new_tokens: int, reference) -> dict:
    """kill -9 of the forward process once the streams decode -> seconds to the next token anywhere."""
    import os
    import signal

    pid, decoded, times = worker.engine.runner.pids[0], worker.last_stats["decode_tokens"], []

    def streams():
        times.append(over_http_here(url, texts, new_tokens, stream=True)[1])

    thread = threading.Thread(target=streams)
    thread.start()
    while worker.last_stats["decode_tokens"] == decoded:
        time.sleep(0.002)
    runner = worker.engine.runner
    restarts, killed_at = runner.restarts, time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while runner.restarts == restarts:  # the fresh process is up; tokens after this are the recomputed ones
        time.sleep(0.002)
    restarted_at = time.monotonic()
    thread.join(timeout=120)
    outputs, stamps = times[0]
    after = min(t for s in stamps for t in s if t > restarted_at)
    return {"seconds_to_next_token": after - killed_at, "outputs_equal": outputs == reference}


def measure_recovery(url: str, worker, texts: list[str], new_tokens: int, reference) -> dict:
    engine, killed_at = worker.engine, []
    original, calls = engine.step, [0]

    def step():
        calls[0] += 1
        if calls[0] == max(2, new_tokens // 2):
            killed_at.append(time.monotonic())
            raise EngineKilled()
        return original()

    engine.step = step
    recovered_at = []

    def watch():  # the first step of the restarted engine is where tokens flow again
        while not recovered_at:
            if worker.engine is not engine and worker.last_stats.get("steps", 0) >= 1:
                recovered_at.append(time.monotonic())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    _, (outputs, _) = over_http_here(url, texts, new_tokens, stream=True)
    watcher.join(timeout=60)
    return {"seconds_to_first_token": recovered_at[0] - killed_at[0], "outputs_equal": outputs == reference,
            "restarts": worker.restarts}


if __name__ == "__main__":
    main()
