"""plan-service: the memory plan of one device of a multi-device deployment, with no allocation (docs/design.md §6.2),
and the checks that refuse at load a file `serve` would refuse at start (load_service_config).

For each pipeline stage, one device holds
    weights      its slice of the stage's layers, counted on the meta device by parallel/planner.py
                 (attention heads / TP, experts / EP at intermediate / TP, the rest whole); routed experts
                 in FP8 when model.dtype is fp8, everything else bf16 (fp32 when model.dtype is fp32)
    activations  one prefill chunk's working set (parallel/planner.py), + the chunk's fp32 logits on the last stage
    caches       what is left of gpu_memory_utilization x device memory, planned by plan_cache on the
                 device's share of the model: the stage's layers with KDA / MLA heads / TP. The MLA latent and
                 indexer keys are per token, not per head, so TP does not divide them. Sequences are spread
                 over the EP ranks (each attends over its own rows, as parallel/planner.py models it):
                 ceil(max_num_seqs / EP) slots per device.

The layout is checked first, as the engine checks it (serving_layout): EP must divide the routed experts,
TP the heads and widths, and PP at most the layers; an error names the parallel.* key. The text ends with
the budget an in-process Engine on this CPU would take (memory.cache_bytes, or its default share of this
host's memory when left out).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.meta import BITS_PER_WEIGHT, format_bytes
from latentmoe_lab.parallel.eplb.online import check_redundant_experts
from latentmoe_lab.quant.kda_state import kda_slot_bytes
from latentmoe_lab.quant.kv import kv_bytes_per_token
from latentmoe_lab.serving.cache_tiers.offload_plan import long_context_text
from latentmoe_lab.serving.config import ServiceConfig, serving_layout
from latentmoe_lab.serving.disagg.section import INSTANCE_ROLES, in_role, overrides, role_config
from latentmoe_lab.serving.planner import CachePlan, default_cache_budget, plan_cache
from latentmoe_lab.serving.transport.transfer_bytes import transfer_table
from latentmoe_lab.serving.workers.pipeline_stage import plan_stages, stage_config
from latentmoe_lab.yaml_loader import errors_name_file


@dataclass
class StagePlan:
    layers: range
    weights: float
    activations: float
    device_bytes: float
    cache: CachePlan | None
    problem: str | None  # why the caches do not fit, when they do not

    def lines(self, max_model_len: int) -> list[str]:
        out = [f"stage layers [{self.layers.start}, {self.layers.stop}): weights {format_bytes(self.weights)}, "
               f"activations {format_bytes(self.activations)}, of {format_bytes(self.device_bytes)} usable"]
        if self.cache is None:
            return out + [f"  does not fit: {self.problem}"]
        tokens = self.cache.num_blocks * self.cache.block_size
        out += ["  " + line for line in self.cache.table().splitlines()]
        out.append(f"  -> {tokens:,} cached tokens per device = {tokens / max_model_len:.2f} sequences of "
                   f"model.max_model_len ({max_model_len:,})")
        return out


def plan_service(service: ServiceConfig, config: ModelConfig) -> list[StagePlan]:
    """One StagePlan per pipeline stage (a device of that stage)."""
    from latentmoe_lab.parallel.config import ParallelConfig
    from latentmoe_lab.parallel.hardware import HARDWARE, Workload
    from latentmoe_lab.parallel.planner import device_memory, stage_parameters


    par = service.parallel
    serving_layout(config, par)  # ValueError naming parallel.*: e.g. EP past the routed experts
    pconfig = ParallelConfig(tp=par.tensor_parallel_size, ep=par.expert_parallel_size, pp=par.pipeline_parallel_size)
    expert_format = "fp8" if service.model.dtype == "fp8" else "bf16"
    other_bytes = 4 if service.model.dtype == "fp32" else 2
    stages, params = stage_parameters(config, pconfig)
    workload = Workload(mode="serve", seq_len=service.model.max_model_len, sequences=1,
                        prefill_chunk=service.scheduler.prefill_chunk_size, expert_format=expert_format)
    memories = device_memory(config, pconfig, workload)
    seqs = -(-service.memory.max_num_seqs // pconfig.ep)
    snapshots = -(-service.memory.snapshot_slots // pconfig.ep)
    prefix_cache = dataclasses.replace(service.memory.prefix_cache, snapshot_slots=snapshots)
    memory = dataclasses.replace(service.memory, max_num_seqs=seqs, prefix_cache=prefix_cache)
    device_service = dataclasses.replace(service, memory=memory)
    usable = service.memory.gpu_memory_utilization * HARDWARE[service.memory.device].memory_bytes
    plans = []
    for layers, counts, mem in zip(stages, params, memories):
        weights = counts["experts"] * BITS_PER_WEIGHT[expert_format] / 8 + counts["other"] * other_bytes
        budget = int(usable - weights - mem.activations)
        try:
            cache = plan_cache(stage_config(config, layers, pconfig.tp), device_service, budget=max(budget, 0))
            problem = None
        except ValueError as error:
            cache, problem = None, str(error)
        plans.append(StagePlan(layers, weights, mem.activations, usable, cache, problem))
    return plans


def service_plan_text(service: ServiceConfig, config: ModelConfig) -> str:
    par = service.parallel
    world = par.tensor_parallel_size * par.expert_parallel_size * par.pipeline_parallel_size
    lines = [f"{config.name}: TP {par.tensor_parallel_size} x EP {par.expert_parallel_size} x PP "
             f"{par.pipeline_parallel_size} = {world} devices of {service.memory.device}, "
             f"gpu_memory_utilization {service.memory.gpu_memory_utilization}, model.dtype {service.model.dtype}, "
             f"kv_cache_dtype {service.memory.kv_cache_dtype}, block_size {service.memory.block_size}",
             "per device (nothing allocated; weights counted on the meta device):"]
    for stage in plan_service(service, config):
        lines += stage.lines(service.model.max_model_len)
    lines.append("")
    lines.append(per_sequence_text(config, service.model.max_model_len, service.memory.state_dtype))
    lines.append("")
    lines.append(long_context_text(config, service))  # issue 29: tiers and the decode roofline
    lines.append("")
    lines.append(transfer_table(config, service.model.max_model_len, service.cache_dtype, service.compute_dtype))
    lines.append("")
    lines.append(cpu_budget_text(config, service))
    return "\n".join(lines)


def cpu_budget_text(config: ModelConfig, service: ServiceConfig) -> str:
    """The cache budget of each rank of an Engine running this service on this CPU."""
    given = service.memory.cache_bytes
    if given is not None:
        return f"on a CPU (serve, serve-bench): memory.cache_bytes {format_bytes(given)} of cache pools per rank"
    budget, how = default_cache_budget(config, service)
    return f"on this CPU (serve, serve-bench): {how}: {format_bytes(budget)} of cache pools per rank"


def per_sequence_bytes(config: ModelConfig, seq_len: int, kv_cache_dtype: str,
                       state_dtype: str = "fp32") -> dict[str, float]:
    """Whole-model cache of ONE sequence of seq_len tokens (no parallel split), by kind.

    kv_cache_dtype: "bf16", "fp8", ... as memory.kv_cache_dtype; the bytes per token are the codecs' own
    (quant.kv_bytes_per_token: scales included). KDA: state + conv tail as memory.state_dtype stores them
    (fp32: fp32 state, conv tail in bf16), independent of seq_len.
    """
    per_token = kv_bytes_per_token(config, kv_cache_dtype)
    return {
        "dsa_latent": config.num_dsa_layers * seq_len * per_token["mla"],
        "dsa_index": config.num_indexer_layers * seq_len * per_token["index"],  # reusers keep no index keys
        **kda_slot_bytes(config, state_dtype),
    }


def gqa_reference_bytes(seq_len: int, layers: int = 80, kv_heads: int = 8, head_dim: int = 128,
                        value_bytes: float = 1) -> float:
    """The public GQA example of docs/design.md §1.6: 2 x layers x kv_heads x head_dim x seq_len x bytes."""
    return 2 * layers * kv_heads * head_dim * seq_len * value_bytes


def per_sequence_text(config: ModelConfig, seq_len: int, state_dtype: str = "fp32") -> str:
    lines = [f"one {seq_len:,}-token sequence, whole model (before any parallel split; KDA state {state_dtype}):",
             f"{'cache':<14}{'bf16':>12}{'fp8':>12}"]
    bf16, fp8 = (per_sequence_bytes(config, seq_len, dtype, state_dtype) for dtype in ("bf16", "fp8"))
    for kind in bf16:
        lines.append(f"{kind:<14}{format_bytes(bf16[kind]):>12}{format_bytes(fp8[kind]):>12}")
    lines.append(f"{'total':<14}{format_bytes(sum(bf16.values())):>12}{format_bytes(sum(fp8.values())):>12}")
    lines.append(f"{'GQA example':<14}{format_bytes(gqa_reference_bytes(seq_len, value_bytes=2)):>12}"
                 f"{format_bytes(gqa_reference_bytes(seq_len)):>12}   (80 layers x 8 KV heads x 128, §1.6)")
    return "\n".join(lines)


def load_service_config(path: str | Path) -> ServiceConfig:
    """ServiceConfig.from_yaml, then what `serve` would refuse at start: check_loaded_plans."""
    return check_loaded_plans(ServiceConfig.from_yaml(path), path)


def check_loaded_plans(service: ServiceConfig, path: str | Path) -> ServiceConfig:
    """The engine's layout and cache plan of a loaded file (check_engine_plan) and the sizes this host cannot
    run (host_limits.check_fits_host); errors name the file. -> `service`."""
    from latentmoe_lab.serving.host_limits import check_fits_host

    with errors_name_file(path):
        check_engine_plan(service)
        check_fits_host(service)
    return service


def check_engine_plan(service: ServiceConfig, model_config: ModelConfig | None = None) -> None:
    """Plan what Engine.__init__ would (its worker layout, every rank's cache plan) for `model_config` (a
    checkpoint's, server/loading.resolve_service reads it) or else the preset the service names, so that a
    file `serve` would refuse at start is refused when it is loaded; ValueError naming the key."""
    if model_config is None and service.model.preset is None:
        return
    config = model_config or ModelConfig.from_preset(service.model.preset)
    if service.memory.cache_bytes is None:
        budget = default_cache_budget(config, service)[0]
        service = dataclasses.replace(service, memory=dataclasses.replace(service.memory, cache_bytes=budget))
    if service.eplb.enabled:  # what the Engine's OnlineBalancer would refuse after building the model
        check_redundant_experts(config.moe.num_experts, service.parallel.expert_parallel_size,
                                service.eplb.num_redundant_experts)
    layout = serving_layout(config, service.parallel)
    if layout is None:
        plan_cache(config, service)
    else:
        plan_stages(config, service, layout)


def check_role_plans(config: ServiceConfig, model_config: ModelConfig | None = None) -> None:
    """Each role's cache plan of a disaggregated service (check_engine_plan): a decode instance whose cache
    cannot hold one model.max_model_len request is refused before anything starts. Each role's sizes against
    this host (check_fits_host: a role's memory override is checked like a colocated file's), then every
    instance's pools together: prefill_instances + decode_instances processes each allocate their own."""
    from latentmoe_lab.serving.host_limits import (available_memory_bytes, check_fits_host, default_cache_bytes,
                                                   ranks_on_host)

    available, needs = available_memory_bytes(), {}
    for role in INSTANCE_ROLES:
        instance = role_config(config, role)
        try:
            check_engine_plan(instance, model_config)
            check_fits_host(instance)
        except ValueError as error:
            raise in_role(error, role, overrides(config, role)) from None
        if available is not None:
            cache = instance.memory.cache_bytes or default_cache_bytes(instance)[0]
            needs[role] = getattr(config.disaggregation, f"{role}_instances") * ranks_on_host(instance) * cache
    if available is not None and sum(needs.values()) > available:
        d, blamed = config.disaggregation, max(needs, key=needs.get)
        raise ValueError(f"disaggregation.{blamed}_instances: {d.prefill_instances} prefill + {d.decode_instances} "
                         f"decode instance processes hold {format_bytes(sum(needs.values()))} of cache pools "
                         f"together, more than the {format_bytes(available)} of memory available on this host; "
                         f"run fewer instances or give each less memory.cache_bytes")
