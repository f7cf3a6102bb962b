"""The synthetic serve-bench workload: Poisson arrivals, mixed prompt lengths, some prompts with an image.
(Not routing_workloads.py, router logits for imbalance studies, nor profiling/steps.py, traced callables.)

Requests arrive at exponentially spaced times (a Poisson process of `rate` requests per second). The
driver adds each request when the engine's clock passes its arrival time, between steps, so a
request's queue time starts at most one step late; with nothing to run it sleeps until the next arrival.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from latentmoe_lab.serving.engine import Engine, RequestOutput
from latentmoe_lab.serving.sampling import SamplingParams


@dataclass
class WorkloadRequest:
    arrival: float  # seconds after the start
    prompt: object  # token ids, or a dict {"text", "images"}
    params: SamplingParams


def synthetic_workload(num_requests: int, rate: float, min_prompt: int, max_prompt: int, max_tokens: int,
                       image_fraction: float, vocab_size: int, seed: int = 0, image_size: int = 56,
                       has_vision: bool = True) -> list[WorkloadRequest]:
    """num_requests requests; prompt lengths uniform in [min_prompt, max_prompt]; greedy, max_tokens each."""
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests: must be a positive integer, got {num_requests!r}")
    if not rate > 0:
        raise ValueError(f"rate: must be > 0 requests per second, got {rate!r}")
    if not 1 <= min_prompt <= max_prompt:
        raise ValueError(f"min_prompt, max_prompt: need 1 <= min_prompt <= max_prompt, got {min_prompt}, {max_prompt}")
    if not 0 <= image_fraction <= 1:
        raise ValueError(f"image_fraction: must be in [0, 1], got {image_fraction!r}")
    g = torch.Generator().manual_seed(seed)
    gaps = torch.empty(num_requests).exponential_(rate, generator=g)
    arrivals = (gaps.cumsum(0) - gaps[0]).tolist()  # the first request arrives at t = 0
    requests = []
    for arrival in arrivals:
        length = int(torch.randint(min_prompt, max_prompt + 1, (1,), generator=g))
        with_image = float(torch.rand(1, generator=g)) < image_fraction  # drawn always: the same lengths either way
        if has_vision and with_image:
            text = "<image>" + bytes(torch.randint(97, 123, (max(length - 6, 1),), generator=g).tolist()).decode()
            prompt = {"text": text, "images": [torch.rand(3, image_size, image_size, generator=g)]}
        else:
            prompt = torch.randint(0, min(vocab_size, 256), (length,), generator=g).tolist()
        requests.append(WorkloadRequest(arrival, prompt, SamplingParams(max_tokens=max_tokens)))
    return requests


def run_workload(engine: Engine, requests: list[WorkloadRequest], progress=None) -> list[RequestOutput]:
    """Drive the engine in real time through the arrivals; the finished outputs in request order."""
    start = time.monotonic()
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    index_of, results, next_up = {}, [None] * len(requests), 0
    while next_up < len(order) or index_of:
        now = time.monotonic() - start
        while next_up < len(order) and requests[order[next_up]].arrival <= now:
            i = order[next_up]
            index_of[engine.add_request(requests[i].prompt, requests[i].params)] = i
            next_up += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, requests[order[next_up]].arrival - (time.monotonic() - start)))
            continue
        for out in engine.step():
            if out.finished and out.request_id in index_of:
                results[index_of.pop(out.request_id)] = out
                if progress is not None:
                    progress.update()
    return results
