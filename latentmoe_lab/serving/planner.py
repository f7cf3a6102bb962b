"""Memory planner: a byte budget -> DSA blocks and KDA slots, every cache counted (docs/design.md §6.2).
One engine's caches; service_plan.py plans each device of a deployment with it, parallel/planner.py the
layouts of training and inference (weights, activations), without a cache plan.

    per block (block_size tokens, every DSA layer)   MLA latent + rope key, indexer key (+ its scale in fp8)
    per slot  (every KDA layer)                      state [H, d_k, d_v] + conv tail [channels, kernel - 1] in
                                                     memory.state_dtype's formats (slot_formats; fp32 + model dtype)
              (a model with an MTP head)             + the hidden row of the slot's last position (mtp_row_bytes)
    slots = memory.max_num_seqs running (times K + 1 with speculative decoding: a state slot per verified
            token, docs/design.md §12) + memory.prefix_cache.snapshot_slots snapshots (prefix caching)
    blocks = (budget - slots * per_slot) // per_block

The bytes come from paged_pool_bytes, the function PagedPools' allocation is checked against, so the plan
and the allocation agree to the byte. `plan_cache` plans the in-process engine (budget memory.cache_bytes;
with_cache_budget gives an Engine on a CPU a default when it is left out); service_plan.py plans one
device of a multi-device deployment with it.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.meta import format_bytes
from latentmoe_lab.paged_pools import PagedPools, paged_pool_bytes
from latentmoe_lab.quant.kda_state import kda_slot_formats
from latentmoe_lab.quant.kv import kv_formats
from latentmoe_lab.serving.cache_tiers.offload_tier import OffloadedPools
from latentmoe_lab.serving.config import ServiceConfig

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
log = logging.getLogger(__name__)


@dataclass
class CachePlan:
    config: ModelConfig  # the layers the pools are shaped for (one device's share in plan_service)
    num_blocks: int
    block_size: int
    num_slots: int  # running slots (max_num_seqs, times K + 1 with speculative decoding)
    num_snapshots: int  # prefix-cache snapshot rows, after the running slots
    dtype: torch.dtype  # conv tails (and plain token storage)
    latent_format: object
    index_format: object
    budget: int
    block_bytes: int  # device bytes per block (with memory.offload: the index keys only)
    slot_bytes: int  # every KDA layer's state + conv tail, and the MTP hidden row (mtp_row_bytes)
    state_format: object  # KDA states and conv tails (slot_formats: memory.state_dtype)
    conv_format: object
    hot_rows: int = 0  # memory.offload: device rows per running slot and DSA layer; 0: no host tier
    hot_bytes: int = 0  # every hot buffer (plan_offloaded)
    host_block_bytes: int = 0  # host-tier bytes per block (every DSA layer's latent rows)
    host_budget: int = 0  # memory.offload.host_cache_bytes

    @property
    def pool_rows(self) -> int:
        return self.num_slots + self.num_snapshots

    def bytes_by_kind(self) -> dict[str, int]:
        """paged_pool_bytes of this plan, with the snapshot rows' share of the KDA pools split out (with a
        host tier: the latent rows there, the hot buffers on the device)."""
        kinds = paged_pool_bytes(self.config, self.num_blocks, self.block_size, self.pool_rows, self.dtype,
                                 self.latent_format, self.index_format, self.state_format, self.conv_format)
        if self.hot_rows:
            kinds = {"dsa_hot_buffers": self.hot_bytes} | kinds
            kinds["host tier: dsa_latent (not in total)"] = kinds.pop("dsa_latent")
        hidden = self.pool_rows * mtp_row_bytes(self.config, self.dtype)
        snapshots = self.num_snapshots * self.slot_bytes
        return kinds | ({"mtp_hidden_rows": hidden} if hidden else {}) | {"kda_snapshots (included above)": snapshots}

    @property
    def total_bytes(self) -> int:
        """Device bytes (the host tier apart)."""
        return self.num_blocks * self.block_bytes + self.pool_rows * self.slot_bytes + self.hot_bytes

    def table(self) -> str:
        kinds = self.bytes_by_kind()
        lines = [f"{'cache':<32}{'bytes':>14}"]
        lines += [f"{name:<32}{format_bytes(value):>14}" for name, value in kinds.items()]
        lines.append(f"{'total':<32}{format_bytes(self.total_bytes):>14}   of a {format_bytes(self.budget)} budget")
        lines.append(f"blocks: {self.num_blocks} x {self.block_size} tokens = {self.num_blocks * self.block_size} "
                     f"tokens ({format_bytes(self.block_bytes)} per block, every DSA layer)")
        lines.append(f"slots: {self.num_slots} running + {self.num_snapshots} prefix snapshots "
                     f"({format_bytes(self.slot_bytes)} per slot, every KDA layer)")
        if self.hot_rows:
            lines.append(f"host tier: {format_bytes(self.num_blocks * self.host_block_bytes)} of a "
                         f"{format_bytes(self.host_budget)} memory.offload.host_cache_bytes "
                         f"({format_bytes(self.host_block_bytes)} per block); hot buffers of {self.hot_rows} rows "
                         f"per running slot and DSA layer")
        return "\n".join(lines)


def cache_formats(config: ModelConfig, service: ServiceConfig) -> tuple[torch.dtype, object, object]:
    """(compute dtype of the conv tails, latent format, index format) for the service's kv_cache_dtype and
    index_key_dtype.

    fp8 / int8 are the codecs of latentmoe_lab.quant (docs/design.md §7: 656 + 132 bytes per token and DSA
    layer at full scale, index keys block-planar); the others store values as they are. index_key_dtype int4 /
    fp4 stores the index keys in 4 bits whatever kv_cache_dtype is (72 bytes per token at full scale).
    """
    latent_format, index_format = kv_formats(config, service.cache_dtype, service.compute_dtype,
                                             service.memory.index_key_dtype)
    return TORCH_DTYPES[service.compute_dtype], latent_format, index_format


def slot_formats(config: ModelConfig, service: ServiceConfig) -> tuple[object, object]:
    """(state_format, conv_format) of the KDA slots for memory.state_dtype (quant/kda_state.py)."""
    return kda_slot_formats(service.memory.state_dtype, cache_formats(config, service)[0], config.kda.head_dim_k,
                            config.kda.head_dim_v)


def plan_cache(config: ModelConfig, service: ServiceConfig, budget: int | None = None) -> CachePlan:
    """Blocks and slots for `config` within `budget` bytes (default memory.cache_bytes)."""
    mem = service.memory
    budget = mem.cache_bytes if budget is None else budget
    if budget is None:
        raise ValueError("memory.cache_bytes: required to size the caches of the in-process engine "
                         "(only an Engine on a CPU takes a default share of the host's memory)")
    dtype, latent_format, index_format = cache_formats(config, service)
    block_bytes, slot_bytes = pools_bytes(config, service, 1, 0), pools_bytes(config, service, 0, 1)
    rows = running_slots(service) + mem.snapshot_slots
    if rows * slot_bytes > budget:
        raise ValueError(f"memory.cache_bytes: {budget} bytes cannot hold the {rows} KDA slots (max_num_seqs "
                         f"(x K + 1 speculating) + prefix_cache.snapshot_slots) of {slot_bytes} bytes each")
    per_sequence = -(-service.model.max_model_len // mem.block_size)
    if mem.offload.enabled:  # the latent rows in a host tier (docs/design.md §15.1)
        return plan_offloaded(config, service, budget, running_slots(service), slot_bytes)
    if block_bytes == 0:  # a model without DSA layers: blocks cost nothing, give every slot a full sequence
        num_blocks = per_sequence * mem.max_num_seqs
    else:
        num_blocks = (budget - rows * slot_bytes) // block_bytes
    if num_blocks < per_sequence:
        raise ValueError(f"memory.cache_bytes: {budget} bytes leave {num_blocks} blocks of {mem.block_size} tokens "
                         f"after the KDA slots, fewer than one model.max_model_len sequence needs "
                         f"({per_sequence} blocks for {service.model.max_model_len} tokens)")
    return CachePlan(config, num_blocks, mem.block_size, running_slots(service), mem.snapshot_slots, dtype,
                     latent_format, index_format, budget, block_bytes, slot_bytes, *slot_formats(config, service))


def plan_offloaded(config: ModelConfig, service: ServiceConfig, budget: int, running: int,
                   slot_bytes: int) -> CachePlan:
    """The CachePlan of plan_cache when memory.offload is set; ValueError naming the key that is too small.

    The device budget (memory.cache_bytes) then holds the index keys of every block, the hot buffers
    (hot_rows_per_layer rows per running slot and DSA layer) and the KDA slots; memory.offload.host_cache_bytes
    holds every block's latent + rope rows. Blocks = the fewer of what each tier can hold:

        device   (cache_bytes - slots x slot_bytes - hot buffers) // index bytes per block
        host     host_cache_bytes // latent bytes per block
    """
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
                     latent_format, index_format, budget, device_block, slot_bytes,
                     *slot_formats(config, service), hot_rows=hot_rows,
                     hot_bytes=hot_bytes, host_block_bytes=host_block, host_budget=offload.host_cache_bytes)


def running_slots(service: ServiceConfig) -> int:
    """KDA slots of the running sequences: one each, K + 1 each with speculative decoding (the state after
    each token of a verify step has its own slot, docs/design.md §12)."""
    spec = service.speculative
    return service.memory.max_num_seqs * (1 + (spec.num_speculative_tokens if spec.enabled else 0))


def pools_bytes(config: ModelConfig, service: ServiceConfig, num_blocks: int, num_slots: int) -> int:
    """Bytes of every pool for `num_blocks` blocks and `num_slots` KDA rows in the service's formats, with the
    MTP hidden row of each KDA row."""
    dtype, latent_format, index_format = cache_formats(config, service)
    return sum(paged_pool_bytes(config, num_blocks, service.memory.block_size, num_slots, dtype, latent_format,
                                index_format, *slot_formats(config, service)).values()) \
        + num_slots * mtp_row_bytes(config, dtype)


def mtp_row_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the hidden row kept beside each KDA slot row of a model with an MTP head (hidden_size values in
    the compute dtype; serving/spec/hidden_rows.py): where a prefix hit, a spill restore or a transfer resumes a
    request, its MTP drafter starts from it. 0 without a head. A pipeline stage's config has none (the rows
    stay in the engine's process, workers/pipeline_stage.stage_config)."""
    return config.hidden_size * torch.empty((), dtype=dtype).element_size() if config.mtp_depth > 0 else 0


def default_cache_budget(config: ModelConfig, service: ServiceConfig) -> tuple[int, str]:
    """(memory.cache_bytes of one rank, how it was chosen) on a CPU when the file leaves it out:
    host_limits.default_cache_bytes, but without prefix caching no more than every running sequence at
    model.max_model_len can fill (further blocks could never be used)."""
    from latentmoe_lab.serving.host_limits import default_cache_bytes

    budget, how = default_cache_bytes(service)
    if not service.memory.prefix_cache.enabled:
        mem = service.memory
        blocks = mem.max_num_seqs * -(-service.model.max_model_len // mem.block_size)
        full = pools_bytes(config, service, blocks, running_slots(service) + mem.snapshot_slots)
        if full < budget:
            budget, how = full, (f"{how}; without prefix caching capped at what {mem.max_num_seqs} sequences of "
                                 f"model.max_model_len fill")
    return budget, how


def with_cache_budget(config: ModelConfig, service: ServiceConfig, device="cpu") -> ServiceConfig:
    """`service` with memory.cache_bytes set, for an Engine of `config` on `device`: the given value
    unchanged; left out on a CPU, default_cache_budget, logged; left out elsewhere, unchanged (plan_cache
    then asks for it). Resolved once per Engine, so every stage of a parallel layout plans one figure."""
    if service.memory.cache_bytes is not None or torch.device(device).type != "cpu":
        return service
    budget, how = default_cache_budget(config, service)
    log.warning("%s: %s of cache pools per rank", how, format_bytes(budget))
    return dataclasses.replace(service, memory=dataclasses.replace(service.memory, cache_bytes=budget))


def check_model_fits(model, service: ServiceConfig) -> None:
    """The loaded model against the service: model.max_model_len within its positions, model.dtype its
    weights' dtype (fp8 is a planning format: any weights); ValueError naming the key."""
    if service.model.max_model_len > model.config.max_position_embeddings:
        raise ValueError(f"model.max_model_len: ({service.model.max_model_len}) exceeds the model's "
                         f"max_position_embeddings ({model.config.max_position_embeddings})")
    weights, expected = next(model.parameters()).dtype, TORCH_DTYPES.get(service.model.dtype)
    if expected is not None and weights != expected:
        raise ValueError(f"model.dtype: the config says {service.model.dtype} but the model's weights are {weights}")


def allocate_pools(config: ModelConfig, plan: CachePlan, device=None) -> PagedPools:
    """The PagedPools of a plan: rows [0, num_slots) running slots, then the snapshot rows (OffloadedPools,
    latent rows on the host, when the plan has a host tier)."""
    if plan.hot_rows:
        return OffloadedPools(config, plan.num_blocks, plan.block_size, plan.pool_rows, plan.hot_rows,
                              plan.num_slots, plan.dtype, device, plan.latent_format, plan.index_format,
                              state_format=plan.state_format, conv_format=plan.conv_format)
    return PagedPools(config, plan.num_blocks, plan.block_size, plan.pool_rows, plan.dtype, device,
                      plan.latent_format, plan.index_format, plan.state_format, plan.conv_format)
