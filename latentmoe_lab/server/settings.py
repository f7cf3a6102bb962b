"""The service file: the engine's ServiceConfig (docs/design.md §6.1) plus our `server:` section (§10).

The engine's four sections are parsed by ServiceConfig, unchanged but for one default: a server's
engine log keeps SERVER_LOG_RECORDS records (scheduler.max_log_records; Prometheus has the history).
A fifth, optional section belongs to the HTTP service and is taken off before ServiceConfig sees the rest:

    server:
      max_retries         int >= 0   retries of a request whose step failed with it alone (the engine first
                                     bisects a failed step of several, docs/design.md §6.5); one more
                                     failure and it fails alone with a "engine_step_failed" error (default
                                     3). It is the engine's scheduler.max_step_retries, which a service
                                     file therefore may not set.
      max_restarts        int >= 0   engine restarts (weights reloaded) before the service gives up and
                                     /health turns 503 (default 10)
      step_timeout_s      float > 0  a step running longer counts as a silent engine: restarted (default 120)
      max_body_bytes      int >= 1   request bodies past this get HTTP 400 (default 1 MiB)
      request_timeout_s   float > 0  a request still unfinished after this is aborted with an error (default 600)
      body_timeout_s      float > 0  a request body not fully received after this gets HTTP 408 and the
                                     connection is closed (slow or stalled uploads; default 30)
      health_stall_s      float > 0  /health answers 503 "stalled" while a step has run longer (default 15)
      default_max_tokens  int >= 1   max_tokens of a request that gives none: the room left under
                                     max_model_len, at most this (default 256)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from latentmoe_lab.config_fields import describe, section_from_dict
from latentmoe_lab.serving import ServiceConfig
from latentmoe_lab.serving.config import read_service_file, section_values
from latentmoe_lab.yaml_loader import errors_name_file

SERVER_LOG_RECORDS = 1000  # the engine's log of a long-running server: the latest steps and requests only
MAX_TIMEOUT_S = 86400.0  # a day: longer is a mistake, and too long for the event loop's timers


@dataclass(frozen=True)
class ServerSettings:
    max_retries: int = 3
    max_restarts: int = 10
    step_timeout_s: float = 120.0
    max_body_bytes: int = 1 << 20
    request_timeout_s: float = 600.0
    body_timeout_s: float = 30.0
    health_stall_s: float = 15.0
    default_max_tokens: int = 256

    def __post_init__(self) -> None:
        if isinstance(self.default_max_tokens, bool) or not isinstance(self.default_max_tokens, int) \
                or self.default_max_tokens < 1:
            raise ValueError(f"server.default_max_tokens: must be an integer >= 1, "
                             f"got {describe(self.default_max_tokens)}")
        for name in ("max_retries", "max_restarts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"server.{name}: must be an integer >= 0, got {describe(value)}")
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) \
                or self.max_body_bytes < 1:
            raise ValueError(f"server.max_body_bytes: must be an integer >= 1, got {describe(self.max_body_bytes)}")
        for name in ("step_timeout_s", "request_timeout_s", "body_timeout_s", "health_stall_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
                raise ValueError(f"server.{name}: must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}], "
                                 f"got {describe(value)}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ServerSettings":
        if not isinstance(values, dict):
            raise ValueError(f"server: expected a mapping of keys, got {describe(values)}")
        return section_from_dict(cls, values, "server")


def split_service_dict(data: dict[str, Any]) -> tuple[ServiceConfig, ServerSettings]:
    """A parsed service file -> (the engine's ServiceConfig, our ServerSettings)."""
    if not isinstance(data, dict):
        raise ValueError(f"service config: expected a mapping of sections, got {describe(data)}")
    rest = {key: value for key, value in data.items() if key != "server"}
    scheduler = section_values(rest, "scheduler")
    if "max_step_retries" in scheduler:
        raise ValueError("scheduler.max_step_retries: a service file sets it as server.max_retries")
    rest["scheduler"] = {"max_log_records": SERVER_LOG_RECORDS, **scheduler}
    return ServiceConfig.from_dict(rest), ServerSettings.from_dict(section_values(data, "server"))


def engine_config_from_yaml(path: str | Path) -> ServiceConfig:
    """ServiceConfig.from_yaml with the file's `server:` section checked too (then left out): what plan-service
    and serve-bench load, so that a file they accept is one `serve` accepts."""
    from latentmoe_lab.serving.service_plan import check_loaded_plans

    data = read_service_file(path, "path")
    with errors_name_file(path):
        ServerSettings.from_dict(section_values(data, "server"))
    return check_loaded_plans(ServiceConfig.from_file_data(data, path), path)


def load_service_file(path: str | Path) -> tuple[ServiceConfig, ServerSettings]:
    """`serve`'s loader: split_service_dict of the file, then the engine's plan of a preset and the host's
    limits, as ServiceConfig.from_yaml checks them."""
    from latentmoe_lab.serving.service_plan import check_loaded_plans, check_role_plans

    data = read_service_file(path, "--config")
    with errors_name_file(path):
        config, settings = split_service_dict(data)
    check_loaded_plans(config, path)
    if config.disaggregation.enabled:  # each role's plan: a decode cache that holds one request
        with errors_name_file(path):
            check_role_plans(config)
    return config, settings
