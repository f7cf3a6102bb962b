"""`latentmoe-lab serve` and `latentmoe-lab soak` (docs/design.md §10)."""
from __future__ import annotations

import argparse
import copy
import logging
import os
import sys

API_KEY_ENV = "LATENTMOE_API_KEY"


def add_parser(subparsers) -> None:
    serve = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Load the model of a service file, run the serving engine on its own thread, and serve "
                    "/v1/completions, /v1/chat/completions (SSE streaming too), /v1/models, /health and "
                    "/metrics (Prometheus) with FastAPI on uvicorn.")
    serve.add_argument("--config", required=True, help="service YAML (configs/service-cpu.yaml)")
    serve.add_argument("--checkpoint", default=None, metavar="DIR",
                       help="a save_pretrained directory to serve instead of model.preset")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    serve.add_argument("--api-key", default=None,
                       help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV} if set); "
                            "visible in the process list, unlike --api-key-file")
    serve.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="read the API key from this file (its first line), so that it stays out of `ps`")
    serve.add_argument("--threads", type=int, default=None,
                       help="torch threads of the forward (default: one per core, or with parallel.forward_process "
                            "one per core but one, which the server process keeps for its event loop and sampling)")
    serve.set_defaults(func=cmd_serve)
    add_soak_parser(subparsers)


def cmd_serve(args: argparse.Namespace) -> int:
    """Every check first (the port is bound before the model loads), then load, serve and the one shutdown of
    server/lifecycle.py, whatever stops it (SIGTERM, SIGINT, SIGHUP, the parent gone)."""
    from latentmoe_lab.server.app import build_app
    from latentmoe_lab.server.lifecycle import StopRequests, bind_port, load, serve, shutdown
    from latentmoe_lab.server.loading import load_model, resolve_service, source_line
    from latentmoe_lab.server.worker import EngineWorker

    config, settings = resolve_service(args.config, args.checkpoint)  # as plan-service and serve-bench do
    api_key = _api_key(args)
    sock = bind_port(args.host, args.port)  # before anything prints or loads: a port in use is one line
    try:
        config = _set_threads(config, args.threads)
        if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
            print(f"warning: serving on {args.host} without an API key", file=sys.stderr)
        if config.disaggregation.enabled:  # instance processes with roles, one endpoint (docs/design.md §13.2)
            from latentmoe_lab.server.disagg_worker import DisaggWorker

            d = config.disaggregation
            worker = DisaggWorker(config, settings, load_model)
            print(f"disaggregated: {d.prefill_instances} prefill + {d.decode_instances} decode instance "
                  f"processes, transport {d.transport}", file=sys.stderr)
        else:
            worker = EngineWorker(config, settings, lambda: load_model(config))
        with StopRequests() as stop:
            print(f"{source_line(config)}; loading ...", file=sys.stderr, flush=True)
            try:
                loaded = load(worker.start, stop)
            except BaseException:
                worker.stop()  # whatever the failed load had started
                raise
            try:
                if loaded:
                    serve(build_app(worker, api_key), sock, stop, access_log_config())
            finally:
                shutdown(worker.stop, stop)
    finally:
        sock.close()
    return 0


class QueryOmittedFilter(logging.Filter):
    """Drops the query string from uvicorn's access-log lines: a client that puts its API key (or any other
    secret) in the URL must not find it in the server's log. No endpoint reads query parameters."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args  # uvicorn's access record: (client, method, path with query, http version, status)
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?<query omitted>", *args[3:])
        return True


def access_log_config() -> dict:
    """uvicorn's default logging config with QueryOmittedFilter on the access handler."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["query_omitted"] = {"()": QueryOmittedFilter}
    config["handlers"]["access"]["filters"] = ["query_omitted"]
    return config


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, --api-key-file (its first line) or $LATENTMOE_API_KEY; ValueError naming the flag."""
    if args.api_key_file is None:
        return args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.api_key is not None:
        raise ValueError("--api-key-file: give it or --api-key, not both")
    if not os.path.isfile(args.api_key_file):  # a FIFO or a device would block the read
        raise ValueError(f"--api-key-file: {args.api_key_file!r} is not a regular file")
    try:
        with open(args.api_key_file, encoding="utf-8") as handle:
            key = handle.readline(4096).strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--api-key-file: cannot read {args.api_key_file!r} ({error})") from None
    if not key:
        raise ValueError(f"--api-key-file: {args.api_key_file!r} holds no key on its first line")
    return key


def _set_threads(config, threads: int | None):
    """This process's torch threads, and the forward process's. An OpenMP thread per core in a process that
    shares its cores makes every parallel op wait for a descheduled thread (oversubscription: a 2-thread
    forward ran 5-10x slower beside a busy server process on 2 cores), so with the forward in its own
    process the server keeps one core and one thread."""
    import dataclasses

    import torch

    if threads is not None and threads < 1:
        raise ValueError(f"--threads: must be >= 1, got {threads}")
    from latentmoe_lab.threads import apply_threads, available_cores

    if not config.parallel.forward_process:
        apply_threads(threads, echo=lambda line: print(line, file=sys.stderr))
        return config
    cores = available_cores()  # affinity and cgroup quota, not the machine's count
    torch.set_num_threads(1)
    forward_threads = config.parallel.forward_threads or threads or max(1, cores - 1)  # the file's value wins
    source = ("parallel.forward_threads" if config.parallel.forward_threads else "--threads" if threads
              else f"{cores} cores available; --threads N to change")
    print(f"torch threads: 1 in the server, {forward_threads} in the forward process ({source})", file=sys.stderr)
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, forward_threads=forward_threads))


def add_soak_parser(subparsers) -> None:
    soak = subparsers.add_parser(
        "soak", help="soak a server with mixed requests: RSS slope, drift, blocks == slots == 0 after drain",
        description="Start `latentmoe-lab serve` on 127.0.0.1 (or use --url, loopback only), send mixed requests "
                    "through the openai client for --minutes with --concurrency threads, sample RSS, blocks, "
                    "slots and latency, drain, check for leaks and write an HTML report.")
    soak.add_argument("--config", required=True, help="service YAML the server is started with")
    soak.add_argument("--minutes", type=float, required=True, help="how long to send requests")
    soak.add_argument("--concurrency", type=int, default=8, help="client threads (default: %(default)s)")
    soak.add_argument("--max-requests", type=int, default=100_000, help="stop after this many (default: %(default)s)")
    soak.add_argument("--url", default=None, help="a running server (loopback) instead of starting one")
    soak.add_argument("--warmup", type=float, default=0.25, help="share of the run left out of the slope")
    soak.add_argument("--sample-s", type=float, default=1.0, help="seconds between samples (default: %(default)s)")
    soak.add_argument("--seed", type=int, default=0, help="seed of the request mix (default: %(default)s)")
    soak.add_argument("--report", default="reports/soak.html", help="HTML report path (default: %(default)s)")
    soak.set_defaults(func=cmd_soak)


def cmd_soak(args: argparse.Namespace) -> int:
    from latentmoe_lab.server.soak import cmd_soak as run

    return run(args)
