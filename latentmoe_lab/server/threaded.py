"""A uvicorn server on a background thread, for tests and notebooks (docs/design.md §10).

    with ServedApp(app) as served:          # 127.0.0.1, a free port; or start_service(dict) for it all
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="-")
"""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

START_TIMEOUT_S = 30


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServedApp:
    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None):
        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "ServedApp":
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@contextmanager
def start_service(service: dict, api_key: str | None = None, host: str = "127.0.0.1", faults: dict | None = None):
    """A whole service from a service-file dict: worker thread + app + uvicorn thread; yields (served, worker).
    With a disaggregation: section the worker is a DisaggWorker (instance processes; `faults` by instance name,
    tests only)."""
    from latentmoe_lab.server.app import build_app
    from latentmoe_lab.server.disagg_worker import DisaggWorker
    from latentmoe_lab.server.loading import load_model
    from latentmoe_lab.server.settings import split_service_dict
    from latentmoe_lab.server.worker import EngineWorker

    config, settings = split_service_dict(service)
    if config.disaggregation.enabled:
        worker = DisaggWorker(config, settings, load_model, faults=faults)
    else:
        worker = EngineWorker(config, settings, lambda: load_model(config))
    worker.start()
    try:
        with ServedApp(build_app(worker, api_key), host) as served:
            yield served, worker
    finally:
        worker.stop()
