"""The layout planner: per-device memory, traffic and step time of a parallel layout at full scale, on paper.

Not serving/planner.py (the byte budget of one engine's paged caches) nor parallel/eplb/plan.py (a placement
of redundant experts, planned with this module); whether a layout fits is decided here.

    plan = plan_layout(ModelConfig.from_preset("k3-2.8t"), ParallelConfig.from_layout("EP64xTP8xPP4"),
                       HARDWARE["H100-80GB"], TRAIN_8K)

Memory per device (the most loaded pipeline stage decides whether a layout fits):
  weights     this rank's slice, counted on meta-device modules built at the local width: attention
              at heads / tp, experts E / ep at intermediate / tp, shared / dense FFN at width / tp;
              router, latent projections, norms, the DSA indexer and embeddings stay whole (as in
              the runtime); a DSA layer that reuses another's selection (dsa.index_share_every > 1)
              has no indexer. Routed experts in the workload's format when serving, bf16 otherwise.
  grads, optimizer (train)  fp32 grads; Adam's fp32 master + 2 moments sharded over the ranks
              that replicate a parameter (dp*ep for dense parts, dp for experts).
  kv_state    KDA state (fp32) + conv tail per KDA layer; per DSA layer the MLA latent and rope
              key (cache_bytes) and, in layers with their own indexer, FP8 index keys + scale, for
              every token of context. The CP runtime gathers the DSA cache, so cp does not divide it.
  activations train: layer inputs kept for recomputation x micro-batches alive (1F1B: pp, GPipe:
              all) + one layer's working set + fp32 logits; serve: one prefill chunk's working set.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache

from latentmoe_lab.config import DSA, KDA, ModelConfig
from latentmoe_lab.meta import BITS_PER_WEIGHT, format_bytes
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.hardware import SERVE_128K, TRAIN_8K, Hardware, Workload
from latentmoe_lab.parallel.pipeline import (activation_width, partition_layers, peak_live_micro_batches,
                                             SCHEDULE_FUNCTIONS)
from latentmoe_lab.parallel.roofline import step_times
from latentmoe_lab.parallel.traffic import moe_a2a_bytes

ADAM_BYTES, GRAD_BYTES = 12, 4


@dataclass
class DeviceMemory:
    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    kv_state: float = 0.0
    activations: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.kv_state + self.activations

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self) | {"total": self.total}


@dataclass
class LayoutPlan:
    name: str
    pconfig: ParallelConfig
    hardware: Hardware
    workload: Workload
    stages: list[range]
    memory_by_stage: list[DeviceMemory]
    traffic: dict[str, float]
    times: dict[str, dict[str, float]]
    fits: bool = False
    reason: str = ""
    params_by_stage: list[dict[str, int]] = field(default_factory=list)

    @property
    def memory(self) -> DeviceMemory:
        """The device of the most loaded stage."""
        return max(self.memory_by_stage, key=lambda m: m.total)


@lru_cache(maxsize=32)
def _local_block_params(config_json: str, tp: int, ep: int,
                        redundant_experts: int = 0) -> dict[tuple[str, bool], dict[str, int]]:
    """{(block kind, is_moe): {"experts": n, "other": n}} parameters of one layer on one rank (_block_kind)."""
    from accelerate import init_empty_weights

    from latentmoe_lab.layers.dsa import GatedDSA
    from latentmoe_lab.layers.dsa_indexer import SharedSelection
    from latentmoe_lab.layers.kda import KimiDeltaAttention
    from latentmoe_lab.layers.moe import LatentMoE
    from latentmoe_lab.parallel.tensor import local_config

    config = ModelConfig.from_json_text(config_json)
    d, moe = config.hidden_size, config.moe
    local = local_config(config, tp)
    with init_empty_weights(include_buffers=True):
        reuser = GatedDSA(local)
        reuser.share_selection(SharedSelection(0), "reuse")  # drops the indexer, as the model's reusing layers do
        attention = {"kda": _numel(KimiDeltaAttention(local)), "dsa": _numel(GatedDSA(local)),
                     "dsa_reuse": _numel(reuser)}
        full_moe = LatentMoE(config)
    experts_full, shared_full = _numel(full_moe.experts), _numel(full_moe.shared) if full_moe.shared else 0
    moe_other = _numel(full_moe) - experts_full - shared_full + shared_full // tp
    slots = -(-(moe.num_experts + redundant_experts) // ep)  # the fullest rank's expert slots
    experts_local = slots * 3 * moe.latent_size * (moe.expert_intermediate_size // tp)
    dense = 3 * d * (config.dense_intermediate_size // tp)
    out = {}
    for kind in attention:
        out[(kind, False)] = {"experts": 0, "other": attention[kind] + 2 * d + dense}
        out[(kind, True)] = {"experts": experts_local, "other": attention[kind] + 2 * d + moe_other}
    return out


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _block_kind(config: ModelConfig, layer: int) -> str:
    """"kda", "dsa" (a DSA layer with its own indexer) or "dsa_reuse" (one replaying another layer's top-k)."""
    if config.layer_types[layer] == DSA and config.index_source(layer) != layer:
        return "dsa_reuse"
    return config.layer_types[layer]


def stage_parameters(config: ModelConfig, pconfig: ParallelConfig,
                     redundant_experts: int = 0) -> tuple[list[range], list[dict[str, int]]]:
    """(stages, per stage {"experts", "other"} parameters held by one rank of that stage); with
    redundant_experts R, every MoE layer holds ceil((E + R) / ep) expert slots on its fullest rank
    (parallel/eplb/rebalance.py)."""
    stages = partition_layers(config, pconfig.pp)
    if isinstance(redundant_experts, bool) or not isinstance(redundant_experts, int) or redundant_experts < 0:
        raise ValueError(f"redundant_experts: must be an integer >= 0, got {redundant_experts!r}")
    blocks = _local_block_params(config.to_json(), pconfig.tp, pconfig.ep, redundant_experts)
    per_stage = []
    for s, stage in enumerate(stages):
        counts = {"experts": 0, "other": 0}
        for i in stage:
            for key, n in blocks[(_block_kind(config, i), config.is_moe_layer(i))].items():
                counts[key] += n
        if s == 0:
            counts["other"] += config.vocab_size * config.hidden_size
        if s == len(stages) - 1:
            counts["other"] += config.vocab_size * config.hidden_size + config.hidden_size
        per_stage.append(counts)
    return stages, per_stage


def device_memory(config: ModelConfig, pconfig: ParallelConfig, workload: Workload,
                  redundant_experts: int = 0) -> list[DeviceMemory]:
    """Bytes one device of each pipeline stage holds under `workload` (R redundant expert slots per layer)."""
    stages, params = stage_parameters(config, pconfig, redundant_experts)
    train = workload.mode == "train"
    expert_bits = BITS_PER_WEIGHT["bf16" if train else workload.expert_format]
    d, act, tp = config.hidden_size, workload.act_bytes, pconfig.tp
    sp_divisor = tp if pconfig.sequence_parallel else 1
    out = []
    for s, (stage, p) in enumerate(zip(stages, params)):
        mem = DeviceMemory(weights=p["experts"] * expert_bits / 8 + p["other"] * 2)
        if train:
            mem.grads = (p["experts"] + p["other"]) * GRAD_BYTES
            mem.optimizer = (p["experts"] * ADAM_BYTES / pconfig.dp
                             + p["other"] * ADAM_BYTES / (pconfig.dp * pconfig.ep))
            tokens = workload.micro_batch_sequences * workload.seq_len // pconfig.cp
            actions = SCHEDULE_FUNCTIONS[pconfig.schedule](workload.micro_batches, pconfig.pp, s)
            live = peak_live_micro_batches(actions)
            mem.activations = (live * len(stage) * tokens * d * act / sp_divisor
                               + 2 * _working_set(config, pconfig, tokens, act))
            if s == len(stages) - 1:
                mem.activations += 2 * tokens * config.vocab_size * 4  # fp32 logits and their grad
        else:
            rows = workload.sequences / pconfig.data_shards
            mem.kv_state = rows * sum(_cache_bytes_per_sequence(config, pconfig, workload, i) for i in stage)
            mem.activations = _working_set(config, pconfig, workload.prefill_chunk, act)
            if s == len(stages) - 1:
                mem.activations += workload.prefill_chunk * config.vocab_size * 4
        out.append(mem)
    return out


def _working_set(config: ModelConfig, pconfig: ParallelConfig, tokens: float, act: int) -> float:
    """Temporaries of one layer for `tokens` tokens: residual, q/k/v/o of the local heads, expert rows."""
    heads = max(config.kda.num_heads * (2 * config.kda.head_dim_k + 2 * config.kda.head_dim_v),
                config.mla.num_heads * (2 * (config.mla.qk_nope_head_dim + config.mla.qk_rope_head_dim)
                                        + 2 * config.mla.v_head_dim)) // pconfig.tp
    moe = config.moe
    expert_rows = moe.top_k * (2 * moe.latent_size + 3 * moe.expert_intermediate_size // pconfig.tp)
    return tokens * act * (4 * config.hidden_size + heads + expert_rows)


def _cache_bytes_per_sequence(config: ModelConfig, pconfig: ParallelConfig, workload: Workload, layer: int) -> float:
    if config.layer_types[layer] == KDA:
        kda = config.kda
        heads = kda.num_heads // pconfig.tp
        conv = (2 * kda.head_dim_k + kda.head_dim_v) * heads * (kda.conv_kernel - 1) * workload.act_bytes
        return heads * kda.head_dim_k * kda.head_dim_v * 4 + conv
    mla = config.mla
    per_token = (mla.kv_lora_rank + mla.qk_rope_head_dim) * workload.cache_bytes
    if _block_kind(config, layer) == DSA:  # a reusing layer caches no index keys
        per_token += config.indexer.head_dim + 4
    return workload.seq_len * per_token


def plan_layout(config: ModelConfig, pconfig: ParallelConfig, hardware: Hardware, workload: Workload,
                name: str | None = None, redundant_experts: int = 0,
                expert_load: dict[int, float] | None = None) -> LayoutPlan:
    """Memory, traffic and step times of `pconfig` for `config` on `hardware` under `workload`.

    redundant_experts: R extra expert slots per MoE layer (parallel/eplb/rebalance.py); expert_load {layer: max / mean
    routed pairs per EP rank}: the step time is then the busiest rank's (parallel/eplb/plan.py).
    """
    pconfig.validate_for(config)
    memory = device_memory(config, pconfig, workload, redundant_experts)
    stages, params = stage_parameters(config, pconfig, redundant_experts)
    tokens = (workload.micro_batch_sequences * workload.seq_len if workload.mode == "train"
              else workload.prefill_chunk * max(1, workload.sequences // pconfig.data_shards)) // pconfig.cp
    a2a = moe_a2a_bytes(config, pconfig.ep, tokens, workload.act_bytes)
    plan = LayoutPlan(name=name or pconfig.name(), pconfig=pconfig, hardware=hardware, workload=workload,
                      stages=stages, memory_by_stage=memory, params_by_stage=params,
                      traffic={"tokens_per_micro_batch": tokens, **{f"a2a_{k}": v for k, v in a2a.items()},
                               "tp_bytes_per_layer": _tp_payload(config, pconfig, tokens, workload.act_bytes),
                               "pp_bytes_per_micro_batch": tokens * config.hidden_size * workload.act_bytes * max(
                                   [activation_width(config, stage.stop) for stage in stages[:-1]], default=1)},
                      times=step_times(config, pconfig, hardware, workload, stages, params, expert_load,
                                       redundant_experts))
    plan.fits, plan.reason = _verdict(plan)
    return plan


def _tp_payload(config: ModelConfig, pconfig: ParallelConfig, tokens: float, act: int) -> float:
    """All-reduce payload per MoE layer on a TP rank: attention, fp32 expert sum, shared experts."""
    if pconfig.tp == 1:
        return 0.0
    shared = config.hidden_size * act if config.moe.num_shared_experts else 0
    return tokens * (config.hidden_size * act + config.moe.latent_size * 4 + shared)


def _verdict(plan: LayoutPlan) -> tuple[bool, str]:
    mem, usable = plan.memory, plan.hardware.usable_bytes
    parts = {k: v for k, v in mem.as_dict().items() if k != "total" and v > 0}
    largest = max(parts, key=parts.get)
    detail = ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items())
    if mem.total <= usable:
        return True, (f"fits: {format_bytes(mem.total)} of {format_bytes(usable)} usable on "
                      f"{plan.hardware.name} ({detail})")
    return False, (f"does not fit: {format_bytes(mem.total)} > {format_bytes(usable)} usable on "
                   f"{plan.hardware.name}; largest part {largest} {format_bytes(parts[largest])} ({detail})")


# The layouts named in the write-ups: two training layouts and one serving layout.
EXAMPLE_LAYOUTS: dict[str, tuple[ParallelConfig, Workload]] = {
    "EP64xTP8xPP4 = 2048 (training)": (ParallelConfig(ep=64, tp=8, pp=4, micro_batches=8), TRAIN_8K),
    "TP8xPP4xEP8xDP2 = 512 (training)": (ParallelConfig(tp=8, pp=4, ep=8, dp=2, micro_batches=8), TRAIN_8K),
    "TP8xEP8xPP2 = 128 (serving)": (ParallelConfig(tp=8, ep=8, pp=2), SERVE_128K),
}


def plan_examples(config: ModelConfig, hardware: Hardware) -> list[LayoutPlan]:
    return [plan_layout(config, p, hardware, w, name) for name, (p, w) in EXAMPLE_LAYOUTS.items()]


def plan_table(plans: list[LayoutPlan]) -> str:
    """One line per plan: devices, memory split of the fullest device, verdict, step times."""
    lines = [f"{'layout':<36}{'dev':>6}{'weights':>11}{'grad+opt':>11}{'kv/state':>11}{'activ.':>11}"
             f"{'total':>11}  fits  {'prefill s':>10}{'(overlap)':>10}{'decode ms':>10}"]
    for p in plans:
        m = p.memory
        lines.append(f"{p.name:<36}{p.pconfig.world_size:>6}{format_bytes(m.weights):>11}"
                     f"{format_bytes(m.grads + m.optimizer):>11}{format_bytes(m.kv_state):>11}"
                     f"{format_bytes(m.activations):>11}{format_bytes(m.total):>11}  {'yes ' if p.fits else 'NO  '}"
                     f"{p.times['prefill']['sequential']:>10.3f}{p.times['prefill']['overlapped']:>10.3f}"
                     f"{p.times['decode']['sequential'] * 1e3:>10.2f}")
    return "\n".join(lines)
