"""Cache plans with a host tier (memory.offload, docs/design.md §15.1), and one request's bytes on each tier.

With offload the device budget (memory.cache_bytes) holds the index keys of every block, the hot buffers
(hot_rows_per_layer rows per running slot and DSA layer) and the KDA slots; memory.offload.host_cache_bytes
holds every block's latent + rope rows. Blocks = the fewer of what each tier can hold:

    device   (cache_bytes - slots x slot_bytes - hot buffers) // index bytes per block
    host     host_cache_bytes // latent bytes per block
"""
from __future__ import annotations

from latentmoe_lab.config import DSA, ModelConfig
from latentmoe_lab.meta import format_bytes
from latentmoe_lab.paged_pools import paged_pool_bytes
from latentmoe_lab.quant.kv import kv_bytes_per_token
from latentmoe_lab.serving.config import ServiceConfig
from latentmoe_lab.serving.planner import CachePlan, cache_formats


def plan_offloaded(config: ModelConfig, service: ServiceConfig, budget: int, running: int,
                   slot_bytes: int) -> CachePlan:
    """The CachePlan of plan_cache when memory.offload is set; ValueError naming the key that is too small."""
    mem, offload = service.memory, service.memory.offload
    dtype, latent_format, index_format = cache_formats(config, service)
    hot_rows = offload.hot_rows(config.indexer.topk)
    one_block = paged_pool_bytes(config, 1, mem.block_size, 0, dtype, latent_format, index_format)
    device_block, host_block = one_block["dsa_index"], one_block["dsa_latent"]
    latent_dim = config.mla.kv_lora_rank + config.mla.qk_rope_head_dim
    hot_bytes = config.num_dsa_layers * running * hot_rows * latent_format.bytes_per_token(latent_dim)
    rows = running + mem.snapshot_slots
    room = budget - rows * slot_bytes - hot_bytes
    if room < 0:
        raise ValueError(f"memory.cache_bytes: {budget} bytes cannot hold the {rows} KDA slots and the hot buffers "
                         f"({format_bytes(hot_bytes)}: {hot_rows} memory.offload.hot_rows_per_layer x {running} "
                         f"running slots x {config.num_dsa_layers} DSA layers)")
    per_sequence = -(-service.model.max_model_len // mem.block_size)
    host_blocks = offload.host_cache_bytes // host_block if host_block else per_sequence * mem.max_num_seqs
    if host_blocks < per_sequence:
        raise ValueError(f"memory.offload.host_cache_bytes: {offload.host_cache_bytes} bytes hold {host_blocks} "
                         f"blocks of {mem.block_size} tokens, fewer than one model.max_model_len sequence needs "
                         f"({per_sequence} blocks = {format_bytes(per_sequence * host_block)} for "
                         f"{service.model.max_model_len} tokens)")
    device_blocks = room // device_block if device_block else host_blocks
    if device_blocks < per_sequence:
        raise ValueError(f"memory.cache_bytes: {budget} bytes leave {device_blocks} blocks of index keys after the "
                         f"KDA slots and hot buffers, fewer than one model.max_model_len sequence needs "
                         f"({per_sequence} blocks for {service.model.max_model_len} tokens)")
    return CachePlan(config, min(device_blocks, host_blocks), mem.block_size, running, mem.snapshot_slots, dtype,
                     latent_format, index_format, budget, device_block, slot_bytes, hot_rows=hot_rows,
                     hot_bytes=hot_bytes, host_block_bytes=host_block, host_budget=offload.host_cache_bytes)


def request_tier_bytes(config: ModelConfig, seq_len: int, kv_cache_dtype: str = "fp8",
                       hot_rows: int | None = None) -> dict[str, float]:
    """One sequence of seq_len tokens with its latent rows offloaded, whole model: bytes on each tier.

    device: index keys of every indexer layer, the hot buffers (hot_rows per DSA layer, default 2 x top-k),
    the KDA state and conv tail; host: every DSA layer's latent + rope rows. Without offload the device
    would hold the host figure as well (service_plan.per_sequence_bytes)."""
    per_token = kv_bytes_per_token(config, kv_cache_dtype)
    hot_rows = 2 * config.indexer.topk if hot_rows is None else hot_rows
    kda = config.kda
    num_kda = config.layer_types.count("kda")
    num_dsa = config.layer_types.count(DSA)
    return {
        "device: dsa_index": config.num_indexer_layers * seq_len * per_token["index"],
        "device: dsa_hot_buffers": num_dsa * min(hot_rows, seq_len) * per_token["mla"],
        "device: kda_state": num_kda * kda.num_heads * kda.head_dim_k * kda.head_dim_v * 4,
        "device: kda_conv": num_kda * kda.num_heads * (2 * kda.head_dim_k + kda.head_dim_v) * (kda.conv_kernel - 1) * 2,
        "host: dsa_latent": num_dsa * seq_len * per_token["mla"],
    }


def request_tier_text(config: ModelConfig, seq_len: int, kv_cache_dtype: str = "fp8",
                      hot_rows: int | None = None) -> str:
    parts = request_tier_bytes(config, seq_len, kv_cache_dtype, hot_rows)
    device = sum(v for k, v in parts.items() if k.startswith("device"))
    lines = [f"one {seq_len:,}-token sequence with memory.offload ({kv_cache_dtype} cache, whole model):"]
    lines += [f"  {name:<28}{format_bytes(value):>12}" for name, value in parts.items()]
    lines.append(f"  {'device total':<28}{format_bytes(device):>12}   "
                 f"({device / (device - parts['device: dsa_hot_buffers'] + parts['host: dsa_latent']):.1%} of the "
                 f"no-offload device figure)")
    return "\n".join(lines)


def long_context_text(config: ModelConfig, service: ServiceConfig) -> str:
    """plan-service's long-context part: one model.max_model_len request's bytes per tier with memory.offload,
    and its decode-token roofline on the file's layout and device (without a host tier, and with one whose
    every top-k row is swapped in: the upper bound of the host link's share)."""
    from latentmoe_lab.parallel.config import ParallelConfig
    from latentmoe_lab.parallel.hardware import HARDWARE
    from latentmoe_lab.parallel.roofline import decode_roofline_text

    par, mem, seq_len = service.parallel, service.memory, service.model.max_model_len
    cache_dtype = "fp8" if service.cache_dtype in ("fp8", "int8") else "bf16"
    hot_rows = None if mem.offload is None else mem.offload.hot_rows(config.indexer.topk)
    pconfig = ParallelConfig(tp=par.tensor_parallel_size, ep=par.expert_parallel_size, pp=par.pipeline_parallel_size)
    expert_format = "fp8" if service.model.dtype == "fp8" else "bf16"
    roofline = [decode_roofline_text(config, pconfig, HARDWARE[mem.device], seq_len, cache_dtype, expert_format,
                                     swap) for swap in (None, 1.0)]
    return "\n".join([request_tier_text(config, seq_len, cache_dtype, hot_rows), *roofline])
