"""The soak run: mixed requests against a live server for a bounded time (docs/design.md §10).

C client threads send a seeded mix through the official openai client: completions and chat, streamed
and not, prompts of 1..MAX_PROMPT bytes, 1..max_tokens new tokens, greedy or sampled, some with stop
strings. A sampler reads /metrics every `sample_s`: RSS (the server process plus its worker processes, when
the forward runs in them), KV blocks and KDA slots used, running and waiting requests, and the p50 / p99 latency of the requests finished since the last sample. After the deadline
(or max_requests) the clients stop, the server drains, and the run checks blocks == slots == 0.

Leak and drift, after a warm-up (the first `warmup` share of the run, while allocator pools grow):
    RSS slope   least-squares fit of RSS over time, MiB per minute (~0 when nothing leaks);
    drift table the post-warm-up run in WINDOWS equal windows: requests, p50 / p99, mean RSS, and the
                last window's p99 over the first's.
Loopback only: the server is started here on 127.0.0.1 (or --url must be a loopback address).
"""
from __future__ import annotations

import argparse
import os
import random
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
from prometheus_client.parser import text_string_to_metric_families

from latentmoe_lab.serving.metrics import percentiles

WINDOWS = 4
MAX_PROMPT = 200
LOOPBACK = ("127.0.0.1", "localhost", "::1")
GAUGES = {"process_resident_memory_bytes": "rss", "latentmoe_kv_blocks_used": "blocks",
          "latentmoe_kda_slots_used": "slots", "latentmoe_requests_running": "running",
          "latentmoe_requests_waiting": "waiting"}


@dataclass
class SoakResult:
    duration_s: float
    requests: list[tuple[float, float, str | None]] = field(default_factory=list)  # (end time, latency, error)
    samples: list[dict] = field(default_factory=list)
    drained: dict = field(default_factory=dict)

    @property
    def errors(self) -> list[str]:
        return [e for _, _, e in self.requests if e is not None]

    @property
    def ok(self) -> bool:
        return not self.errors and self.drained.get("blocks") == 0 and self.drained.get("slots") == 0

    def post_warmup(self, warmup: float) -> tuple[float, float]:
        return warmup * self.duration_s, self.duration_s

    def rss_slope_mib_per_min(self, warmup: float) -> float:
        start, _ = self.post_warmup(warmup)
        points = [(s["t"], s["rss"] / 2**20) for s in self.samples if s["t"] >= start]
        if len(points) < 2:
            return float("nan")
        mean_t = sum(t for t, _ in points) / len(points)
        mean_r = sum(r for _, r in points) / len(points)
        var = sum((t - mean_t) ** 2 for t, _ in points)
        return 60 * sum((t - mean_t) * (r - mean_r) for t, r in points) / var if var else float("nan")

    def drift_table(self, warmup: float) -> list[dict]:
        start, end = self.post_warmup(warmup)
        width = (end - start) / WINDOWS
        rows = []
        for w in range(WINDOWS):
            lo, hi = start + w * width, start + (w + 1) * width
            latencies = [lat for t, lat, err in self.requests if lo <= t < hi and err is None]
            rss = [s["rss"] for s in self.samples if lo <= s["t"] < hi]
            stats = percentiles(latencies)
            rows.append({"window": f"{lo:.0f}-{hi:.0f}s", "requests": len(latencies), "p50_ms": stats["p50"] * 1e3,
                         "p99_ms": stats["p99"] * 1e3, "rss_mib": sum(rss) / len(rss) / 2**20 if rss else float("nan")})
        return rows

    def summary(self, warmup: float) -> str:
        rows = self.drift_table(warmup)
        lines = [f"requests {len(self.requests)}, errors {len(self.errors)}, duration {self.duration_s:.0f} s",
                 "after drain: " + ", ".join(f"{k} {self.drained.get(k, float('nan')):.0f}"
                                             for k in ("blocks", "slots", "running", "waiting")),
                 f"RSS slope after warm-up: {self.rss_slope_mib_per_min(warmup):+.2f} MiB/min",
                 f"p99 drift (last window / first): {rows[-1]['p99_ms'] / rows[0]['p99_ms']:.2f}x",
                 "", f"{'window':<14}{'requests':>9}{'p50 ms':>10}{'p99 ms':>10}{'RSS MiB':>10}"]
        lines += [f"{r['window']:<14}{r['requests']:>9}{r['p50_ms']:>10.1f}{r['p99_ms']:>10.1f}{r['rss_mib']:>10.1f}"
                  for r in rows]
        lines += [f"error: {e}" for e in sorted(set(self.errors))[:10]]
        return "\n".join(lines)


def read_gauges(base_url: str) -> dict:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in GAUGES:
                values[GAUGES[sample.name]] = sample.value
            elif sample.name == "latentmoe_worker_resident_memory_bytes":  # a leak in a worker counts too
                values["worker_rss"] = values.get("worker_rss", 0.0) + sample.value
    values["rss"] = values.get("rss", 0.0) + values.pop("worker_rss", 0.0)
    return values


def _one_request(client, model: str, rng: random.Random) -> None:
    prompt = "".join(rng.choice("abcdefghij klmnopqrstuvwxyz.,") for _ in range(rng.randint(1, MAX_PROMPT)))
    sampling = {"max_tokens": rng.randint(1, 24), "temperature": rng.choice([0.0, 0.8]),
                "seed": rng.randint(0, 2**31)}
    if rng.random() < 0.2:
        sampling["stop"] = [rng.choice("aeiou")]
    stream, chat = rng.random() < 0.5, rng.random() < 0.5
    if chat:
        result = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                stream=stream, **sampling)
    else:
        result = client.completions.create(model=model, prompt=prompt, stream=stream, **sampling)
    if stream:
        for _ in result:
            pass


def run_soak(base_url: str, model: str, duration_s: float, concurrency: int, api_key: str = "-",
             max_requests: int = 100_000, sample_s: float = 1.0, seed: int = 0, drain_timeout_s: float = 60) -> SoakResult:
    import openai

    host = urlparse(base_url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"url: the soak run talks to loopback only, got host {host!r}")
    result = SoakResult(duration_s)
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=120)
    start = time.monotonic()
    deadline = start + duration_s
    budget = threading.Semaphore(max_requests)
    lock = threading.Lock()

    def client_loop(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.monotonic() < deadline and budget.acquire(blocking=False):
            begin, error = time.monotonic(), None
            try:
                _one_request(client, model, rng)
            except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                error = f"{type(exc).__name__}: {exc}"
            end = time.monotonic()
            with lock:
                result.requests.append((end - start, end - begin, error))

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    last = 0.0
    while any(t.is_alive() for t in threads):
        time.sleep(sample_s)
        now = time.monotonic() - start
        with lock:
            recent = [lat for t, lat, err in result.requests if last <= t < now and err is None]
        stats = percentiles(recent)
        result.samples.append({"t": now, **read_gauges(base_url), "p50": stats["p50"], "p99": stats["p99"]})
        last = now
    give_up = time.monotonic() + drain_timeout_s
    while True:
        result.drained = read_gauges(base_url)
        idle = result.drained.get("running") == 0 and result.drained.get("waiting") == 0
        if (idle and result.drained.get("blocks") == 0) or time.monotonic() > give_up:
            return result
        time.sleep(0.2)


def soak_report(result: SoakResult, warmup: float, path: str):
    import plotly.graph_objects as go

    from latentmoe_lab.report import Captioned, write_html_report

    t = [s["t"] for s in result.samples]

    def figure(series: dict, title: str, unit: str) -> go.Figure:
        fig = go.Figure([go.Scatter(x=t, y=ys, name=name, mode="lines+markers") for name, ys in series.items()])
        fig.add_vline(x=warmup * result.duration_s, line_dash="dot")
        return fig.update_layout(title=title, xaxis_title="time (s)", yaxis_title=unit, height=320)

    sections = [result.summary(warmup),
                Captioned(figure({"RSS": [s["rss"] / 2**20 for s in result.samples]}, "RSS, server + workers", "MiB"),
                          "Flat after the warm-up line means no leak; the slope is in the summary."),
                Captioned(figure({"blocks used": [s["blocks"] for s in result.samples],
                                  "slots used": [s["slots"] for s in result.samples]}, "KV blocks and KDA slots", "count"),
                          "They follow the load and must return to 0 after the drain."),
                Captioned(figure({"p50": [s["p50"] * 1e3 for s in result.samples],
                                  "p99": [s["p99"] * 1e3 for s in result.samples]}, "request latency", "ms"),
                          "Per sampling interval; a rising p99 at a steady load is drift.")]
    return write_html_report(path, "LatentMoE Lab soak run", sections)


def cmd_soak(args: argparse.Namespace) -> int:
    from latentmoe_lab.server.loading import with_checkpoint
    from latentmoe_lab.server.settings import load_service_file
    from latentmoe_lab.server.threaded import free_port

    if not 0 < args.minutes <= 24 * 60:
        raise ValueError(f"--minutes: must be in (0, 1440], got {args.minutes}")
    if not 1 <= args.concurrency <= 1024:
        raise ValueError(f"--concurrency: must be in [1, 1024], got {args.concurrency}")
    if args.max_requests < 1:
        raise ValueError(f"--max-requests: must be >= 1, got {args.max_requests}")
    if not args.sample_s > 0:
        raise ValueError(f"--sample-s: must be > 0, got {args.sample_s}")
    if not 0 <= args.warmup < 1:
        raise ValueError(f"--warmup: must be in [0, 1), got {args.warmup}")
    config, _ = load_service_file(args.config)
    config = with_checkpoint(config, None)  # the model, and so the name, that serve answers with
    server, url, api_key = None, args.url, "-"
    if url is None:
        port, api_key = free_port(), secrets.token_hex(16)  # nobody else on this machine can use our server
        server = subprocess.Popen([sys.executable, "-m", "latentmoe_lab", "serve", "--config", args.config,
                                   "--port", str(port)], env={**os.environ, "LATENTMOE_API_KEY": api_key})
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, server)
    try:
        result = run_soak(url, config.model.name, args.minutes * 60, args.concurrency, api_key,
                          args.max_requests, args.sample_s, args.seed)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    print(result.summary(args.warmup))
    print(f"HTML report: {soak_report(result, args.warmup, args.report)}")
    return 0 if result.ok else 1


def _wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode} before answering")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.terminate()
    raise RuntimeError(f"the server did not answer {url}/health within {timeout_s} s")
