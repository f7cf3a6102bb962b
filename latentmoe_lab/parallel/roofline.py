"""Roofline step-time estimate of a layout: per layer max(FLOPs / peak, bytes / HBM) plus communication.

Per layer on one device, for `tokens` local tokens that each see `context` earlier positions:
  FLOPs   2 x local dense parameters x tokens; routed experts: tokens x K pairs arrive per rank on
          average, 6 l I / tp each; KDA core ~ (6 d_k d_v + 3 C d_k + C^2) per head and token
          (chunked, C = chunk size; 6 d_k d_v per step when decoding); DSA: the indexer scores every
          visible position (2 H_I d_I each, replicated on TP ranks) and attention runs over
          min(top-k, context) positions (2 (qk + v) per local head).
  bytes   local weights once per forward (only the experts some token touches), and when decoding
          the caches: every index key, the top-k latents, the KDA state read and written.
  comm    TP all-reduce as a ring, 2 (n-1)/n x payload over NVLink; the expert All-to-All with the
          share of peers off the node at the NIC bandwidth; a pipeline hand-off per stage.
Three schedules per layer: "sequential" (compute, then every transfer), "shared_overlap" (the
token dispatch hides behind the shared experts, as ParallelMoE does) and "overlapped" (every
transfer hidden behind compute: max of the two, the bound that micro-batch interleaving reaches).
A step of m micro-batches through pp stages takes (m + pp - 1) x the slowest stage.
"""
from __future__ import annotations

from latentmoe_lab.config import KDA, ModelConfig
from latentmoe_lab.meta import BITS_PER_WEIGHT
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.hardware import Hardware, Workload
from latentmoe_lab.parallel.traffic import COUNT_BYTES, META_BYTES_PER_SLOT, hit_probability

SCHEDULES = ("sequential", "shared_overlap", "overlapped")


def _ring_time(payload: float, n: int, bandwidth: float, latency: float) -> float:
    return 0.0 if n == 1 else 2 * (n - 1) / n * payload / bandwidth + 2 * (n - 1) * latency


def _ep_bandwidth(pconfig: ParallelConfig, hw: Hardware) -> tuple[float, float]:
    """(effective bytes/s, latency) of the ep group: members stride cp * tp ranks on the mesh."""
    stride = pconfig.cp * pconfig.tp
    on_node = max(1, min(pconfig.ep, hw.devices_per_node // stride)) if stride <= hw.devices_per_node else 1
    off_node = 1.0 if pconfig.ep == 1 else 1 - (on_node - 1) / (pconfig.ep - 1)
    seconds_per_byte = off_node / hw.inter_node_bandwidth + (1 - off_node) / hw.intra_node_bandwidth
    return 1 / seconds_per_byte, hw.inter_node_latency if off_node > 0 else hw.intra_node_latency


def layer_time(config: ModelConfig, pconfig: ParallelConfig, hw: Hardware, workload: Workload, layer: int,
               other_params: float, tokens: float, context: float, decode: bool, expert_load: float = 1.0,
               redundant_experts: int = 0) -> dict[str, float]:
    """Seconds of one layer on one device under the three schedules, plus its compute and comm parts.

    expert_load: max / mean routed pairs per EP rank in this layer (1: even); the device modelled is the
    busiest one, whose experts get expert_load x the mean. redundant_experts: extra expert slots of the
    layer (parallel/eplb/rebalance.py), ceil((E + R) / ep) on the fullest rank."""
    moe, tp, ep, act = config.moe, pconfig.tp, pconfig.ep, workload.act_bytes
    is_moe = config.is_moe_layer(layer)
    flops = 2 * other_params * tokens
    weight_bytes = other_params * 2
    cache_bytes = 0.0
    if config.layer_types[layer] == KDA:
        kda = config.kda
        heads = kda.num_heads // tp
        per_head = 6 * kda.head_dim_k * kda.head_dim_v
        if not decode:
            per_head += 3 * kda.chunk_size * kda.head_dim_k + kda.chunk_size ** 2
        flops += tokens * heads * per_head
        if decode:
            cache_bytes += 2 * tokens * heads * kda.head_dim_k * kda.head_dim_v * 4
    else:
        mla, idx = config.mla, config.indexer
        selected = min(idx.topk, context)
        own_indexer = config.index_source(layer) == layer  # dsa.index_share_every: reusers neither scan nor store
        flops += tokens * 2 * idx.num_heads * idx.head_dim * context * own_indexer
        flops += tokens * 2 * selected * mla.num_heads // tp * (mla.qk_nope_head_dim + mla.qk_rope_head_dim
                                                               + mla.v_head_dim)
        if decode:
            cache_bytes += tokens * (context * (idx.head_dim + 4) * own_indexer
                                     + selected * (mla.kv_lora_rank + mla.qk_rope_head_dim) * workload.cache_bytes)
    shared_flops = 0.0
    if is_moe:
        expert_params = 3 * moe.latent_size * (moe.expert_intermediate_size // tp)
        flops += expert_load * tokens * moe.top_k * 2 * expert_params
        local_experts = -(-(moe.num_experts + redundant_experts) // ep)  # the fullest rank's slots
        untouched = (1 - moe.top_k / moe.num_experts) ** (tokens * ep)
        bits = BITS_PER_WEIGHT["bf16" if workload.mode == "train" else workload.expert_format]
        weight_bytes += local_experts * (1 - untouched) * expert_params * bits / 8
        shared_flops = 2 * tokens * 3 * config.hidden_size * moe.num_shared_experts * moe.expert_intermediate_size / tp
    compute = max(flops / hw.peak_flops, (weight_bytes + cache_bytes) / hw.hbm_bandwidth)

    tp_payload = tokens * config.hidden_size * act
    if is_moe:
        tp_payload += tokens * (moe.latent_size * 4 + (config.hidden_size * act if moe.num_shared_experts else 0))
    else:
        tp_payload *= 2  # attention and dense FFN
    tp_time = _ring_time(tp_payload, tp, hw.intra_node_bandwidth, hw.intra_node_latency)
    dispatch = combine = 0.0
    if is_moe and ep > 1:
        rows = tokens * (ep - 1) * hit_probability(moe.num_experts, moe.top_k, ep)
        bandwidth, latency = _ep_bandwidth(pconfig, hw)
        dispatch = (rows * (moe.latent_size * act + moe.top_k * META_BYTES_PER_SLOT)
                    + (ep - 1) * COUNT_BYTES) / bandwidth + 2 * latency
        combine = rows * moe.latent_size * act / bandwidth + latency
    comm = tp_time + dispatch + combine
    shared_time = shared_flops / hw.peak_flops
    return {"compute": compute, "comm": comm, "sequential": compute + comm,
            "shared_overlap": compute + tp_time + max(0.0, dispatch - shared_time) + combine,
            "overlapped": max(compute, comm)}


def phase_inputs(pconfig: ParallelConfig, workload: Workload) -> dict[str, tuple[float, float, int]]:
    """{"prefill" | "decode": (tokens per device, context each token sees, micro-batches)} of one step."""
    if workload.mode == "train":
        prefill_tokens = workload.micro_batch_sequences * workload.seq_len // pconfig.cp
        micro = workload.micro_batches
    else:
        prefill_tokens = workload.prefill_chunk * max(1, workload.sequences // pconfig.data_shards) // pconfig.cp
        micro = 1
    decode_rows = max(1.0, workload.sequences / pconfig.data_shards)
    return {"prefill": (prefill_tokens, workload.seq_len / 2, micro), "decode": (decode_rows, workload.seq_len, 1)}


def stage_layer_times(config: ModelConfig, pconfig: ParallelConfig, hw: Hardware, workload: Workload,
                      stages: list[range], params_by_stage: list[dict[str, int]],
                      expert_load: dict[int, float] | None = None, redundant_experts: int = 0) -> dict[str, list[dict]]:
    """{"prefill" | "decode": per stage {layer: layer_time(...)}}: every layer's seconds in one stage pass;
    expert_load {layer: max / mean pairs per EP rank} (missing layers: 1)."""
    out = {}
    for phase, (tokens, context, _) in phase_inputs(pconfig, workload).items():
        out[phase] = []
        for s, (stage, params) in enumerate(zip(stages, params_by_stage)):
            # dense parameters per layer: the stage's non-expert parameters spread over its layers
            # (the first stage's embedding table is a lookup, not a matmul)
            embedding = config.vocab_size * config.hidden_size if s == 0 else 0
            other = (params["other"] - embedding) / len(stage)
            out[phase].append({i: layer_time(config, pconfig, hw, workload, i, other, tokens, context,
                                             phase == "decode", (expert_load or {}).get(i, 1.0),
                                             redundant_experts) for i in stage})
    return out


def step_times(config: ModelConfig, pconfig: ParallelConfig, hw: Hardware, workload: Workload,
               stages: list[range], params_by_stage: list[dict[str, int]],
               expert_load: dict[int, float] | None = None, redundant_experts: int = 0) -> dict[str, dict[str, float]]:
    """{"prefill" | "decode": {schedule: seconds, "compute", "comm"}}; decode also "tokens_per_s"."""
    inputs = phase_inputs(pconfig, workload)
    out = {}
    for phase, stage_layers in stage_layer_times(config, pconfig, hw, workload, stages, params_by_stage,
                                                 expert_load, redundant_experts).items():
        tokens, _, m = inputs[phase]
        per_stage = []
        for layers in stage_layers:
            totals = dict.fromkeys(SCHEDULES + ("compute", "comm"), 0.0)
            for times in layers.values():
                for key, seconds in times.items():
                    totals[key] += seconds
            if pconfig.pp > 1:
                hand_off = tokens * config.hidden_size * workload.act_bytes / hw.inter_node_bandwidth
                for key in SCHEDULES + ("comm",):
                    totals[key] += hand_off + hw.inter_node_latency
            per_stage.append(totals)
        slowest = {key: max(s[key] for s in per_stage) for key in per_stage[0]}
        out[phase] = {key: (m + pconfig.pp - 1) * value for key, value in slowest.items()}
    out["decode"]["tokens_per_s"] = workload.sequences / out["decode"]["sequential"]
    return out


# --------------------------------------------------------------------------- one decode token at long context
HOST_LINK_BANDWIDTH = 64e9  # bytes/s host -> device, one direction: PCIe Gen5 x16 nominal (the host tier's link)
ROOFLINE_PARTS = ("indexer scan", "top-k gather", "host -> hot swap", "sparse attention", "KDA state r/w",
                  "MoE weights", "other weights")


def decode_roofline(config: ModelConfig, pconfig: ParallelConfig, hw: Hardware, context: int = 2 ** 20,
                    kv_cache_dtype: str = "fp8", expert_format: str = "fp8", swap_fraction: float | None = None,
                    host_bandwidth: float = HOST_LINK_BANDWIDTH, index_key_dtype: str = "auto"
                    ) -> dict[str, dict[str, float]]:
    """One sequence's decode token at `context` positions, per part, summed over the layers (docs/design.md §15.2).

    A lone sequence crosses the pp stages one after the other, so its token takes the sum over every layer
    of that layer's time on its device: max(bytes / HBM bandwidth, FLOPs / peak) per part. Per layer:
      indexer scan       indexer layers only (dsa.index_share_every): every index key read, 2 H_I d_I FLOPs each
      top-k gather       min(top-k, context) latent + rope rows read
      host -> hot swap   with swap_fraction (memory.offload): that share of the top-k rows crosses the host
                         link (host_bandwidth) into the hot buffer; None: no host tier
      sparse attention   absorbed MLA over the top-k: 2 (kv_lora + rope + kv_lora) FLOPs per head and row
      KDA state r/w      the fp32 state [H / tp, d_k, d_v] read and written
      MoE weights        the routed experts one token touches on the busiest EP rank (ceil(top_k / ep)) and
                         the shared experts, intermediate / tp, in expert_format (shared in bf16)
      other weights      attention / KDA / dense-FFN projections / tp in bf16
    index_key_dtype: as memory.index_key_dtype (int4 / fp4: the scan reads 4-bit keys).
    -> {part: {"bytes", "flops", "seconds", "layers"}} plus "total": {"seconds", "tokens_per_s"}.
    """
    from latentmoe_lab.quant.kv import kv_bytes_per_token

    if not isinstance(context, int) or isinstance(context, bool) or context < 1:
        raise ValueError(f"context: must be a positive int, got {context!r}")
    if swap_fraction is not None and not 0 <= swap_fraction <= 1:
        raise ValueError(f"swap_fraction: must lie in [0, 1] or be None, got {swap_fraction!r}")
    mla, idx, kda, moe, tp = config.mla, config.indexer, config.kda, config.moe, pconfig.tp
    per_token = kv_bytes_per_token(config, kv_cache_dtype, index_key_dtype=index_key_dtype)
    selected = min(idx.topk, context)
    attention_params = _projection_params(config)
    parts = {name: {"bytes": 0.0, "flops": 0.0, "seconds": 0.0, "layers": 0} for name in ROOFLINE_PARTS}

    def add(name: str, bytes_: float, flops: float = 0.0, bandwidth: float = hw.hbm_bandwidth) -> None:
        part = parts[name]
        part["bytes"] += bytes_
        part["flops"] += flops
        part["seconds"] += max(bytes_ / bandwidth, flops / hw.peak_flops)
        part["layers"] += 1

    for layer, kind in enumerate(config.layer_types):
        if kind == KDA:
            heads = kda.num_heads // tp
            add("KDA state r/w", 2 * heads * kda.head_dim_k * kda.head_dim_v * 4, heads * 6 * kda.head_dim_k * kda.head_dim_v)
        else:
            if config.index_source(layer) == layer:
                add("indexer scan", context * per_token["index"], 2 * idx.num_heads * idx.head_dim * context)
            add("top-k gather", selected * per_token["mla"])
            if swap_fraction is not None:
                add("host -> hot swap", swap_fraction * selected * per_token["mla"], bandwidth=host_bandwidth)
            add("sparse attention", 0.0, 2 * mla.num_heads // tp * selected * (2 * mla.kv_lora_rank + mla.qk_rope_head_dim))
        add("other weights", attention_params[kind] / tp * 2)
        if config.is_moe_layer(layer):
            expert = 3 * moe.latent_size * (moe.expert_intermediate_size // tp)
            shared = 3 * config.hidden_size * moe.expert_intermediate_size * moe.num_shared_experts / tp
            add("MoE weights", -(-moe.top_k // pconfig.ep) * expert * BITS_PER_WEIGHT[expert_format] / 8 + shared * 2,
                2 * (-(-moe.top_k // pconfig.ep) * expert + shared))
        else:
            add("other weights", 3 * config.hidden_size * config.dense_intermediate_size / tp * 2)
    total = sum(part["seconds"] for part in parts.values())
    return parts | {"total": {"seconds": total, "tokens_per_s": 1 / total}}


def _projection_params(config: ModelConfig) -> dict[str, int]:
    """Parameters of one KDA and one DSA attention block (projections, norms, the indexer), counted on meta."""
    import torch

    from latentmoe_lab.layers.dsa import GatedDSA
    from latentmoe_lab.layers.kda import KimiDeltaAttention

    with torch.device("meta"):
        return {KDA: sum(p.numel() for p in KimiDeltaAttention(config).parameters()),
                "dsa": sum(p.numel() for p in GatedDSA(config).parameters())}


def decode_roofline_text(config: ModelConfig, pconfig: ParallelConfig, hw: Hardware, context: int = 2 ** 20,
                         kv_cache_dtype: str = "fp8", expert_format: str = "fp8",
                         swap_fraction: float | None = None, index_key_dtype: str = "auto") -> str:
    """decode_roofline as a table: one line per part, its share of the token's time."""
    rows = decode_roofline(config, pconfig, hw, context, kv_cache_dtype, expert_format, swap_fraction,
                           index_key_dtype=index_key_dtype)
    total = rows.pop("total")
    from latentmoe_lab.meta import format_bytes

    swap = "no host tier" if swap_fraction is None else f"host tier, {swap_fraction:.0%} of top-k rows swapped in"
    keys = "" if index_key_dtype == "auto" else f", {index_key_dtype} index keys"
    lines = [f"decode roofline, one sequence at {context:,} tokens, TP {pconfig.tp} x EP {pconfig.ep} x PP "
             f"{pconfig.pp} on {hw.name} ({kv_cache_dtype} cache{keys}, {expert_format} experts, {swap}, "
             f"dsa.index_share_every {config.dsa.index_share_every}):",
             f"  {'part':<20}{'layers':>7}{'bytes':>12}{'GFLOP':>9}{'ms':>9}{'share':>8}"]
    for name, part in rows.items():
        if part["layers"]:
            lines.append(f"  {name:<20}{part['layers']:>7}{format_bytes(part['bytes']):>12}{part['flops'] / 1e9:>9.2f}"
                         f"{part['seconds'] * 1e3:>9.3f}{part['seconds'] / total['seconds']:>8.1%}")
    lines.append(f"  {'token':<20}{'':>7}{'':>12}{'':>9}{total['seconds'] * 1e3:>9.3f}   "
                 f"= {total['tokens_per_s']:.1f} tokens/s for this sequence")
    return "\n".join(lines)
