"""One request's bytes on each tier with a host tier (memory.offload, docs/design.md §15.1), and plan-service's
long-context text (its decode roofline). The cache plan itself with a host tier is planner.plan_offloaded.
"""
from __future__ import annotations

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.meta import format_bytes
from latentmoe_lab.quant.kda_state import kda_slot_bytes
from latentmoe_lab.quant.kv import kv_bytes_per_token
from latentmoe_lab.serving.config import ServiceConfig


def request_tier_bytes(config: ModelConfig, seq_len: int, kv_cache_dtype: str = "fp8",
                       hot_rows: int | None = None, index_key_dtype: str = "auto",
                       state_dtype: str = "fp32") -> dict[str, float]:
    """One sequence of seq_len tokens with its latent rows offloaded, whole model: bytes on each tier.

    device: index keys of every indexer layer, the hot buffers (hot_rows per DSA layer, default 2 x top-k),
    the KDA state and conv tail; host: every DSA layer's latent + rope rows. Without offload the device
    would hold the host figure as well (service_plan.per_sequence_bytes). index_key_dtype: as
    memory.index_key_dtype (int4 / fp4: the device's index keys in 4 bits); state_dtype: memory.state_dtype."""
    per_token = kv_bytes_per_token(config, kv_cache_dtype, index_key_dtype=index_key_dtype)
    hot_rows = 2 * config.indexer.topk if hot_rows is None else hot_rows
    kda = kda_slot_bytes(config, state_dtype)
    return {
        "device: dsa_index": config.num_indexer_layers * seq_len * per_token["index"],
        "device: dsa_hot_buffers": config.num_dsa_layers * min(hot_rows, seq_len) * per_token["mla"],
        "device: kda_state": kda["kda_state"],
        "device: kda_conv": kda["kda_conv"],
        "host: dsa_latent": config.num_dsa_layers * seq_len * per_token["mla"],
    }


def request_tier_text(config: ModelConfig, seq_len: int, kv_cache_dtype: str = "fp8",
                      hot_rows: int | None = None, index_key_dtype: str = "auto", state_dtype: str = "fp32") -> str:
    parts = request_tier_bytes(config, seq_len, kv_cache_dtype, hot_rows, index_key_dtype, state_dtype)
    device = sum(v for k, v in parts.items() if k.startswith("device"))
    keys = "" if index_key_dtype == "auto" else f", {index_key_dtype} index keys"
    lines = [f"one {seq_len:,}-token sequence with memory.offload ({kv_cache_dtype} cache{keys}, whole model):"]
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
    hot_rows = mem.offload.hot_rows(config.indexer.topk) if mem.offload.enabled else None
    pconfig = ParallelConfig(tp=par.tensor_parallel_size, ep=par.expert_parallel_size, pp=par.pipeline_parallel_size)
    expert_format = "fp8" if service.model.dtype == "fp8" else "bf16"
    roofline = [decode_roofline_text(config, pconfig, HARDWARE[mem.device], seq_len, cache_dtype, expert_format,
                                     swap, mem.index_key_dtype) for swap in (None, 1.0)]
    tiers = request_tier_text(config, seq_len, cache_dtype, hot_rows, mem.index_key_dtype, mem.state_dtype)
    return "\n".join([tiers, *roofline])
