"""The service file's `disaggregation:` section and the instances' configs it describes (docs/design.md §13.2).

A service file with a `disaggregation:` section describes the whole service; each instance runs the file's
config with `parallel.role` set to its role and that role's overrides applied:

    disaggregation:
      prefill_instances: 1
      decode_instances: 1
      transport: pipe
      decode: {memory: {cache_bytes: 67108864}}    # {section: {key: value}}, sections below only

What the two roles must share, because the decode side continues the cache the prefill side wrote, is
checked here and refused naming the key the override changed: the weights (model.preset, checkpoint, seed,
dtype), the cache's storage format (memory.kv_cache_dtype resolved: auto and fp32 agree for fp32 weights;
memory.state_dtype) and model.max_model_len. Each role's own plan (a decode cache that cannot hold one max_model_len request) is
checked by service_plan.py's check_role_plans, when the file is loaded as `serve` loads it. Instances compare
their loaded weights' fingerprints at start-up too (router.py): a checkpoint directory may hold other weights
than its name says.
"""
from __future__ import annotations

import copy

from dataclasses import dataclass

from latentmoe_lab.config_fields import check, check_choice, check_positive_int, describe, key_name

ROLES = ("colocated", "prefill", "decode")
MAX_INSTANCES = 64  # per role; the host's memory bounds them further (service_plan.check_role_plans)
TRANSPORTS = ("pipe",)
INSTANCE_ROLES = ("prefill", "decode")
ROLE_SECTIONS = ("model", "parallel", "memory", "scheduler")
SHARED_KEYS = (("model", "preset"), ("model", "checkpoint"), ("model", "checkpoint_if_present"), ("model", "seed"),
               ("model", "dtype"), ("model", "max_model_len"), ("memory", "state_dtype"))


@dataclass
class DisaggregationSection:
    prefill_instances: int = 0  # 0 and 0: the section is absent, one colocated engine serves
    decode_instances: int = 0
    transport: str = "pipe"
    prefill: dict | None = None  # {section: {key: value}} overriding the file for the prefill instances
    decode: dict | None = None
    enabled: bool = True  # false: the section stays, one colocated engine serves (as with no instances given)

    def __post_init__(self) -> None:
        if self.enabled is True and self.prefill_instances == 0 and self.decode_instances == 0:
            self.enabled = False


def check_disaggregation(config) -> None:
    """parallel.role and the disaggregation: section of a ServiceConfig `config`; in the service file (role
    colocated), each role's instance config too (check_role_configs)."""
    role, d = config.parallel.role, config.disaggregation
    check_choice("parallel.role", role, ROLES)
    if not d.enabled:
        check(role == "colocated", "parallel.role", f"{role!r} needs the disaggregation: section (a "
              f"prefill instance hands its requests to a decode instance)")
        return
    for key in ("prefill_instances", "decode_instances"):
        check_positive_int(f"disaggregation.{key}", getattr(d, key))
        check(getattr(d, key) <= MAX_INSTANCES, f"disaggregation.{key}", f"at most {MAX_INSTANCES} (each instance "
              f"is a process with its own weights and cache pools), got {describe(getattr(d, key))}")
    check_choice("disaggregation.transport", d.transport, TRANSPORTS)
    if role == "colocated":  # the service file; its instances' configs carry their role and no overrides
        check_role_configs(config)


def role_config(config, role: str):
    """The ServiceConfig of an instance of `role`: the file's `config`, its role's overrides applied, parallel.role
    set and no overrides left. ValueError naming `disaggregation.<role>.<section>.<key>` for a bad override."""
    if role not in INSTANCE_ROLES:
        raise ValueError(f"role: must be one of {list(INSTANCE_ROLES)}, got {describe(role)}")
    data = copy.deepcopy(config.to_dict())
    changed = overrides(config, role)
    for section, values in changed.items():
        data[section].update(values)
    data["parallel"]["role"] = role
    data["disaggregation"].update(prefill=None, decode=None)
    # a prefill instance runs each request to its first token only: a verify step there (1 + drafts tokens at
    # once) would keep the request instead of handing it over. The decode instances draft.
    if role == "prefill":
        data["speculative"] = {}
    try:
        return type(config).from_dict(data)
    except ValueError as error:
        raise in_role(error, role, changed) from None


def check_role_configs(config) -> None:
    """Every role's config builds, and the two agree on what a transfer needs: SHARED_KEYS, and the format the
    rows are stored and moved in (memory.kv_cache_dtype resolved against model.dtype: auto and fp32 may agree)."""
    configs = {role: role_config(config, role) for role in INSTANCE_ROLES}

    def value(role: str, section: str, key: str):
        chosen = configs[role]
        return chosen.cache_dtype if key == "kv_cache_dtype" else getattr(getattr(chosen, section), key)

    for section, key in (*SHARED_KEYS, ("memory", "kv_cache_dtype")):
        values = {role: value(role, section, key) for role in INSTANCE_ROLES}
        if values["prefill"] != values["decode"]:
            blamed = "decode" if key in (overrides(config, "decode").get(section) or {}) else "prefill"
            other = "prefill" if blamed == "decode" else "decode"
            raise ValueError(f"disaggregation.{blamed}.{section}.{key}: {describe(values[blamed])} differs from the "
                             f"{other} instances' {describe(values[other])}: the decode side continues the prefill "
                             f"side's cache, which needs the same weights, cache format and model.max_model_len on "
                             f"both")


def overrides(config, role: str) -> dict:
    """disaggregation.<role> of `config`: {section: {key: value}}, each section one an instance may override."""
    values = getattr(config.disaggregation, role)
    if values is None:
        return {}
    for section, keys in values.items():
        if section not in ROLE_SECTIONS:
            raise ValueError(f"disaggregation.{role}.{key_name(section)}: not a section an instance may override; "
                             f"expected some of {list(ROLE_SECTIONS)}")
        if not isinstance(keys, dict):
            raise ValueError(f"disaggregation.{role}.{section}: expected a mapping of keys, got {describe(keys)}")
        if section == "parallel" and "role" in keys:
            raise ValueError(f"disaggregation.{role}.parallel.role: set by the service (each instance gets its own)")
    return values


def in_role(error: ValueError, role: str, changed: dict) -> ValueError:
    """An instance config's error with the role's key path: `disaggregation.decode.memory.cache_bytes: ...` when
    the override set that key, else `disaggregation.decode (the decode instances' config): memory....`."""
    message = str(error)
    path = message.split(":", 1)[0]
    section, _, key = path.partition(".")
    if key.split(".")[0] in (changed.get(section) or {}):
        return ValueError(f"disaggregation.{role}.{message}")
    return ValueError(f"disaggregation.{role} (the {role} instances' config): {message}")
