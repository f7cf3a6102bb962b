"""plan-service: the memory plan of one device of a multi-device deployment, with no allocation (docs/design.md §6.2).

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

from latentmoe_lab.config import DSA, ModelConfig
from latentmoe_lab.meta import BITS_PER_WEIGHT, format_bytes
from latentmoe_lab.quant.kv import kv_bytes_per_token
from latentmoe_lab.serving.config import ServiceConfig
from latentmoe_lab.serving.disagg.transfer_bytes import transfer_table
from latentmoe_lab.serving.offload_plan import long_context_text
from latentmoe_lab.serving.planner import CachePlan, default_cache_budget, plan_cache


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


def stage_config(config: ModelConfig, layers: range, tp: int) -> ModelConfig:
    """The cache-shaping part of one device's share: the stage's layer types, KDA / MLA heads / tp."""
    from latentmoe_lab.parallel.tensor import local_config

    local = local_config(config, tp)
    return local.replace(num_layers=len(layers), layer_types=[config.layer_types[i] for i in layers],
                         first_dense_layers=min(config.first_dense_layers, len(layers)))


def plan_service(service: ServiceConfig, config: ModelConfig) -> list[StagePlan]:
    """One StagePlan per pipeline stage (a device of that stage)."""
    from latentmoe_lab.parallel.config import ParallelConfig
    from latentmoe_lab.parallel.hardware import HARDWARE, Workload
    from latentmoe_lab.parallel.planner import device_memory, stage_parameters

    from latentmoe_lab.serving.parallel_runner import serving_layout  # lazy: it builds on this module

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
    memory = dataclasses.replace(service.memory, max_num_seqs=seqs,
                                 prefix_snapshot_slots=snapshots if service.memory.enable_prefix_caching else None)
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
    lines.append(per_sequence_text(config, service.model.max_model_len))
    lines.append("")
    lines.append(long_context_text(config, service))  # issue 29: tiers and the decode roofline
    lines.append("")
    lines.append(transfer_table(config, service.model.max_model_len, service.cache_dtype,
                                "bf16" if service.model.dtype == "fp8" else service.model.dtype))
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


def per_sequence_bytes(config: ModelConfig, seq_len: int, kv_cache_dtype: str) -> dict[str, float]:
    """Whole-model cache of ONE sequence of seq_len tokens (no parallel split), by kind.

    kv_cache_dtype: "bf16", "fp8", ... as memory.kv_cache_dtype; the bytes per token are the codecs' own
    (quant.kv_bytes_per_token: scales included). KDA: fp32 state + conv tail in bf16, independent of seq_len.
    """
    kda = config.kda
    num_dsa = config.layer_types.count(DSA)
    num_kda = config.num_layers - num_dsa
    per_token = kv_bytes_per_token(config, kv_cache_dtype)
    return {
        "dsa_latent": num_dsa * seq_len * per_token["mla"],
        "dsa_index": num_dsa * seq_len * per_token["index"],
        "kda_state": num_kda * kda.num_heads * kda.head_dim_k * kda.head_dim_v * 4,
        "kda_conv": num_kda * kda.num_heads * (2 * kda.head_dim_k + kda.head_dim_v) * (kda.conv_kernel - 1) * 2,
    }


def gqa_reference_bytes(seq_len: int, layers: int = 80, kv_heads: int = 8, head_dim: int = 128,
                        value_bytes: float = 1) -> float:
    """The public GQA example of docs/design.md §1.6: 2 x layers x kv_heads x head_dim x seq_len x bytes."""
    return 2 * layers * kv_heads * head_dim * seq_len * value_bytes


def per_sequence_text(config: ModelConfig, seq_len: int) -> str:
    lines = [f"one {seq_len:,}-token sequence, whole model (before any parallel split):",
             f"{'cache':<14}{'bf16':>12}{'fp8':>12}"]
    bf16, fp8 = per_sequence_bytes(config, seq_len, "bf16"), per_sequence_bytes(config, seq_len, "fp8")
    for kind in bf16:
        lines.append(f"{kind:<14}{format_bytes(bf16[kind]):>12}{format_bytes(fp8[kind]):>12}")
    lines.append(f"{'total':<14}{format_bytes(sum(bf16.values())):>12}{format_bytes(sum(fp8.values())):>12}")
    lines.append(f"{'GQA example':<14}{format_bytes(gqa_reference_bytes(seq_len, value_bytes=2)):>12}"
                 f"{format_bytes(gqa_reference_bytes(seq_len)):>12}   (80 layers x 8 KV heads x 128, §1.6)")
    return "\n".join(lines)
