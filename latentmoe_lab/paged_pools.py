"""Paged cache pools for serving (docs/design.md §6.2-6.3): DSA blocks shared by every DSA layer, KDA slots.

One block id b holds tokens [b * block_size, (b + 1) * block_size) of one sequence in EVERY DSA layer, so a
sequence needs one block table whatever the number of layers. A token's flat pool position is
b * block_size + offset. Per DSA layer the pools hold

    latent  [c_kv | k_rope] per token          kv_lora_rank + qk_rope_head_dim values   (through latent_format)
    index   the lightning indexer's key          d_I values                               (through index_format)

and per KDA layer, one row per slot (a running sequence owns one slot; spare slots hold prefix snapshots):

    state   [H, d_k, d_v] per slot                through state_format (fp32 by default, docs/design.md §4)
    conv    [channels, kernel - 1] per slot       through conv_format (`dtype` by default): the last
                                                  kernel-1 q|k|v conv inputs

Slot storage goes through a slot format (memory.state_dtype: quant/kda_state.py), the compute staying fp32:

    bytes_per_slot(shape) -> int
    allocate(num_slots, shape, device) -> Tensor               [num_slots, ...], num_slots * bytes_per_slot bytes
    read(storage, slots [S] int64) -> [S, *shape] floating     a copy; the caller casts to its compute dtype
    write(storage, slots [S], values [S, *shape], carry_from [S] | None)   carry_from: whose rounding error
                                                  the write continues (formats with error feedback)
    in_place: bool    the storage holds the values at fp32 or wider: the fused decode may advance them there

copy_slot and zero_slot move and clear a slot's stored bytes whatever the format (zero bytes decode to zero).

Token storage goes through a format, so quantized codecs plug in from outside (they live in quant/, above
this module). A format is any object with

    bytes_per_token(dim) -> int                                  bytes one token of `dim` values takes
    allocate(num_blocks, block_size, dim, device) -> Tensor      exactly num_blocks * block_size * bytes_per_token
    write(storage, slot_mapping [N] int64, values [N, dim])      in place, at flat positions
    read(storage, positions [M] int64) -> [M, dim] floating      the caller casts to its compute dtype

The pools are an inference cache: writes store detached values and no gradient flows through them.
`paged_pool_bytes` counts the same bytes without allocating; the serving planner sizes from it.
A DSA layer that reuses another layer's top-k selection (dsa.index_share_every > 1) keeps no index keys: its
index storage has 0 blocks. offload_tier.OffloadedPools overrides `_dsa_pool` to put the latent rows in a
host tier (docs/design.md §15.1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from latentmoe_lab.config import DSA, ModelConfig


class PlainFormat:
    """The reference format: storage [num_blocks, block_size, dim] in `dtype`, values stored as they are."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype: expected a floating-point torch.dtype, got {dtype!r}")
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"PlainFormat({self.dtype})"

    def bytes_per_token(self, dim: int) -> int:
        return dim * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self, num_blocks: int, block_size: int, dim: int, device=None) -> torch.Tensor:
        return torch.zeros(num_blocks, block_size, dim, dtype=self.dtype, device=device)

    def write(self, storage: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
        storage.view(-1, storage.shape[-1]).index_copy_(0, slot_mapping, values.detach().to(self.dtype))

    def read(self, storage: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return storage.view(-1, storage.shape[-1]).index_select(0, positions)


@dataclass
class DSAPool:
    """One DSA layer's token storage: latent rows [c_kv | k_rope] and index-key rows, both by flat position."""

    offloaded: ClassVar[bool] = False  # True in a host-tier pool (serving/cache_tiers/offload_tier.py)
    latent: torch.Tensor
    index: torch.Tensor
    latent_format: object
    index_format: object
    latent_dim: int
    index_dim: int

    def write(self, slot_mapping: torch.Tensor, latent_rope: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        """slot_mapping [N]; latent_rope [N, kv_lora + rope]; index_keys [N, d_I], None in a layer that
        reuses another layer's selection (dsa.index_share_every; its index pool is empty)."""
        self.latent_format.write(self.latent, slot_mapping, latent_rope.detach())
        if index_keys is not None:
            self.index_format.write(self.index, slot_mapping, index_keys.detach())

    def read(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """positions [M] flat -> (latent_rope [M, kv_lora + rope], index_keys [M, d_I]; None in a layer
        without index keys of its own)."""
        index = self.index_format.read(self.index, positions) if self.index.numel() else None
        return self.latent_format.read(self.latent, positions), index


class PlainSlotFormat:
    """The reference slot format: storage [num_slots, *shape] in `dtype`, values stored as they are."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype: expected a floating-point torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.in_place = torch.finfo(dtype).bits >= 32  # a bf16 state would be advanced in bf16 where it lives

    def __repr__(self) -> str:
        return f"PlainSlotFormat({self.dtype})"

    def bytes_per_slot(self, shape: tuple[int, ...]) -> int:
        return math.prod(shape) * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self, num_slots: int, shape: tuple[int, ...], device=None) -> torch.Tensor:
        return torch.zeros(num_slots, *shape, dtype=self.dtype, device=device)

    def read(self, storage: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return storage.index_select(0, slots)

    def write(self, storage: torch.Tensor, slots: torch.Tensor, values: torch.Tensor,
              carry_from: torch.Tensor | None = None) -> None:
        storage.index_copy_(0, slots, values.detach().to(self.dtype))


@dataclass
class KDAPool:
    """One KDA layer's per-slot rows: state [num_slots, ...] and conv [num_slots, ...] as their formats store
    them (PlainSlotFormat of the tensors' dtypes when not given: state [num_slots, H, d_k, d_v], conv
    [num_slots, channels, kernel-1])."""

    state: torch.Tensor
    conv: torch.Tensor
    state_format: object = None
    conv_format: object = None

    def __post_init__(self) -> None:
        self.state_format = PlainSlotFormat(self.state.dtype) if self.state_format is None else self.state_format
        self.conv_format = PlainSlotFormat(self.conv.dtype) if self.conv_format is None else self.conv_format

    def read_state(self, slots: torch.Tensor) -> torch.Tensor:
        """slots [S] -> [S, H, d_k, d_v] in fp32 (or the storage's wider dtype), an owned copy."""
        values = self.state_format.read(self.state, slots)
        return values if torch.finfo(values.dtype).bits >= 32 else values.float()

    def write_state(self, slots: torch.Tensor, values: torch.Tensor, carry_from: torch.Tensor | None = None) -> None:
        """values [S, H, d_k, d_v] into slots [S] (carry_from: see the slot protocol above)."""
        self.state_format.write(self.state, slots, values.detach(), carry_from)

    def read_conv(self, slots: torch.Tensor) -> torch.Tensor:
        """slots [S] -> [S, channels, kernel - 1] floating (the caller casts)."""
        return self.conv_format.read(self.conv, slots)

    def write_conv(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.conv_format.write(self.conv, slots, values.detach())


def slot_layout(fmt, shape: tuple[int, ...]) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of ONE slot's storage in format `fmt` (what a transfer or a spill carries per layer)."""
    probe = fmt.allocate(0, shape, "cpu")
    return tuple(probe.shape[1:]), probe.dtype


def _dims(config: ModelConfig) -> dict[str, int]:
    kda, mla = config.kda, config.mla
    return {"latent": mla.kv_lora_rank + mla.qk_rope_head_dim, "index": config.indexer.head_dim,
            "heads": kda.num_heads, "d_k": kda.head_dim_k, "d_v": kda.head_dim_v,
            "channels": kda.num_heads * (2 * kda.head_dim_k + kda.head_dim_v), "history": kda.conv_kernel - 1}


def kda_shapes(config: ModelConfig) -> tuple[tuple[int, int, int], tuple[int, int]]:
    """(state shape [H, d_k, d_v], conv tail shape [channels, kernel - 1]) of one slot of one KDA layer."""
    d = _dims(config)
    return (d["heads"], d["d_k"], d["d_v"]), (d["channels"], d["history"])


def _check_slot_formats(dtype, state_format, conv_format) -> tuple[object, object]:
    """(state_format, conv_format), PlainSlotFormat fp32 / `dtype` by default; TypeError naming a bad one."""
    state_format = PlainSlotFormat(torch.float32) if state_format is None else state_format
    conv_format = PlainSlotFormat(dtype) if conv_format is None else conv_format
    for name, fmt in (("state_format", state_format), ("conv_format", conv_format)):
        missing = [m for m in ("bytes_per_slot", "allocate", "read", "write") if not callable(getattr(fmt, m, None))]
        if missing or not isinstance(getattr(fmt, "in_place", None), bool):
            raise TypeError(f"{name}: a slot format needs methods bytes_per_slot, allocate, read and write and a "
                            f"bool in_place; {type(fmt).__name__} lacks {missing or ['in_place']}")
    return state_format, conv_format


def _check_arguments(config, num_blocks, block_size, num_slots, dtype, latent_format, index_format):
    """Validate PagedPools / paged_pool_bytes arguments; return the two formats (PlainFormat(dtype) by default)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
    for name, value, minimum in (("num_blocks", num_blocks, 0), ("block_size", block_size, 1),
                                 ("num_slots", num_slots, 0)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if value < minimum:
            raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating-point torch.dtype, got {dtype!r}")
    formats = []
    for name, fmt in (("latent_format", latent_format), ("index_format", index_format)):
        fmt = PlainFormat(dtype) if fmt is None else fmt
        missing = [m for m in ("bytes_per_token", "allocate", "write", "read") if not callable(getattr(fmt, m, None))]
        if missing:
            raise TypeError(f"{name}: a KV format needs methods bytes_per_token, allocate, write and read; "
                            f"{type(fmt).__name__} lacks {missing}")
        formats.append(fmt)
    return formats


def paged_pool_bytes(config: ModelConfig, num_blocks: int, block_size: int, num_slots: int,
                     dtype: torch.dtype = torch.float32, latent_format=None, index_format=None,
                     state_format=None, conv_format=None) -> dict[str, int]:
    """Bytes PagedPools(...) with the same arguments allocates, by kind, without allocating anything.

    -> {"dsa_latent", "dsa_index", "kda_state", "kda_conv"} (ints). The serving planner's numbers.
    """
    latent_format, index_format = _check_arguments(config, num_blocks, block_size, num_slots, dtype,
                                                   latent_format, index_format)
    state_format, conv_format = _check_slot_formats(dtype, state_format, conv_format)
    d = _dims(config)
    num_dsa = sum(kind == DSA for kind in config.layer_types)
    num_kda = config.num_layers - num_dsa
    tokens = num_blocks * block_size
    state_shape, conv_shape = kda_shapes(config)
    return {
        "dsa_latent": num_dsa * tokens * latent_format.bytes_per_token(d["latent"]),
        "dsa_index": config.num_indexer_layers * tokens * index_format.bytes_per_token(d["index"]),
        "kda_state": num_kda * num_slots * state_format.bytes_per_slot(state_shape),
        "kda_conv": num_kda * num_slots * conv_format.bytes_per_slot(conv_shape),
    }


class PagedPools:
    """Every layer's paged cache. pools.layer(i) -> DSAPool or KDAPool, in config.layer_types order.

    num_blocks: DSA blocks of block_size tokens (shared by all DSA layers); num_slots: KDA state rows.
    dtype: the default PlainFormat and conv tails; state_format / conv_format: the KDA slots' (default fp32
    states and `dtype` conv tails; quant/kda_state.py for memory.state_dtype).
    """

    offloaded: ClassVar[bool] = False  # True for OffloadedPools (serving/cache_tiers/offload_tier.py)

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, num_slots: int,
                 dtype: torch.dtype = torch.float32, device=None, latent_format=None, index_format=None,
                 state_format=None, conv_format=None):
        self.latent_format, self.index_format = _check_arguments(config, num_blocks, block_size, num_slots, dtype,
                                                                 latent_format, index_format)
        self.state_format, self.conv_format = _check_slot_formats(dtype, state_format, conv_format)
        self.config, self.num_blocks, self.block_size, self.num_slots = config, num_blocks, block_size, num_slots
        self.dtype, self.device = dtype, torch.device("cpu") if device is None else torch.device(device)
        d = _dims(config)
        self.layers: list[DSAPool | KDAPool] = []
        for layer_idx, kind in enumerate(config.layer_types):
            if kind == DSA:
                self.layers.append(self._dsa_pool(d, config.dsa.use_indexer and config.index_source(layer_idx) == layer_idx))
            else:
                self.layers.append(self._kda_pool())

    def _kda_pool(self) -> KDAPool:
        """One KDA layer's slots in the slot formats, each allocation checked against bytes_per_slot."""
        parts = []
        for name, fmt, shape in zip(("state_format", "conv_format"), (self.state_format, self.conv_format),
                                    kda_shapes(self.config)):
            storage = fmt.allocate(self.num_slots, shape, self.device)
            expected = self.num_slots * fmt.bytes_per_slot(shape)
            if not isinstance(storage, torch.Tensor) or storage.numel() * storage.element_size() != expected \
                    or storage.shape[:1] != (self.num_slots,):
                raise ValueError(f"{name}: allocate() must return a tensor [num_slots, ...] of num_slots * "
                                 f"bytes_per_slot({shape}) = {expected} bytes (the planner counts that)")
            parts.append(storage)
        return KDAPool(*parts, self.state_format, self.conv_format)

    def _dsa_pool(self, d: dict[str, int], own_indexer: bool) -> DSAPool:
        """One DSA layer's pool on self.device; a layer that reuses another's selection keeps no index keys."""
        latent = self._allocate(self.latent_format, "latent_format", d["latent"])
        index = self._allocate(self.index_format, "index_format", d["index"], self.num_blocks if own_indexer else 0)
        return DSAPool(latent, index, self.latent_format, self.index_format, d["latent"], d["index"])

    def _allocate(self, fmt, name: str, dim: int, num_blocks: int | None = None, device=None) -> torch.Tensor:
        num_blocks = self.num_blocks if num_blocks is None else num_blocks
        storage = fmt.allocate(num_blocks, self.block_size, dim, self.device if device is None else device)
        expected = num_blocks * self.block_size * fmt.bytes_per_token(dim)
        if not isinstance(storage, torch.Tensor) or storage.numel() * storage.element_size() != expected:
            got = storage.numel() * storage.element_size() if isinstance(storage, torch.Tensor) else type(storage)
            raise ValueError(f"{name}: allocate() must return a tensor of num_blocks * block_size * "
                             f"bytes_per_token({dim}) = {expected} bytes (the planner counts that), got {got}")
        return storage

    def layer(self, layer_idx: int) -> DSAPool | KDAPool:
        return self.layers[layer_idx]

    def __len__(self) -> int:
        return len(self.layers)

    def nbytes(self) -> dict[str, int]:
        """Bytes actually allocated, by kind: dsa_latent, dsa_index, kda_state, kda_conv."""
        totals = dict.fromkeys(("dsa_latent", "dsa_index", "kda_state", "kda_conv"), 0)
        for pool in self.layers:
            named = ((("dsa_latent", pool.latent), ("dsa_index", pool.index)) if isinstance(pool, DSAPool)
                     else (("kda_state", pool.state), ("kda_conv", pool.conv)))
            for kind, tensor in named:
                totals[kind] += tensor.numel() * tensor.element_size()
        return totals

    # ------------------------------------------------------------------------------ KDA slots
    def copy_slot(self, src: int, dst: int) -> None:
        """Copy slot src's state and conv tail into slot dst in every KDA layer (prefix snapshots, restores)."""
        self._check_slot("src", src)
        self._check_slot("dst", dst)
        for pool in self.layers:
            if isinstance(pool, KDAPool):
                pool.state[dst].copy_(pool.state[src])
                pool.conv[dst].copy_(pool.conv[src])

    def zero_slot(self, slot: int) -> None:
        """Reset slot's state and conv tail in every KDA layer (the forward also treats context_len 0 as zero)."""
        self._check_slot("slot", slot)
        for pool in self.layers:
            if isinstance(pool, KDAPool):
                pool.state[slot].zero_()
                pool.conv[slot].zero_()

    def _check_slot(self, name: str, slot: int) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool):
            raise TypeError(f"{name}: expected an int slot id, got {type(slot).__name__}")
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"{name}: slot id must lie in [0, num_slots={self.num_slots}), got {slot}")

    def check_compatible(self, config: ModelConfig) -> None:
        """Raise ValueError unless these pools were shaped for a model with `config`'s layers and cache dims."""
        if list(config.layer_types) != list(self.config.layer_types) or _dims(config) != _dims(self.config) \
                or config.dsa.index_share_every != self.config.dsa.index_share_every:
            raise ValueError("pools: built for a model with different layers or cache dims than this one "
                             f"(layer_types {list(self.config.layer_types)} vs {list(config.layer_types)})")
