"""One request's rows of the paged pools, as the bytes they are stored in (docs/design.md §13.1).

A transfer moves the DSA rows of a request in their STORAGE format, never decoded and re-encoded: the
decode side's pools then hold bit for bit what the prefill side wrote. Each token's stored bytes are
gathered into one row per token, so the two sides may use different block sizes and block ids:

    latent  [N, latent bytes/token]   bf16 / fp32 values viewed as bytes (PlainFormat), or the token's
                                      fp8 / int8 entry (quant/kv_mla.py: codes | scales | bf16 rope)
    index   [N, index bytes/token]    the plain values, or the token's codes then its scales, gathered
                                      from the block-planar layout of quant/kv_index.py

Where a token's bytes lie in the storage (its byte view, flattened), by layout:

    token-interleaved (PlainFormat, QuantizedLatentFormat)   position p: [p * E, (p + 1) * E)
    block-planar (QuantizedIndexFormat)                      block b = p // bs, offset o = p % bs:
                                                             values  b*bs*E + o*D + [0, D)
                                                             scales  b*bs*E + bs*D + o*4G + [0, 4G)

The KDA rows are one slot per layer, as the slot formats store them (memory.state_dtype, quant/kda_state.py):
state fp32 [H, d_k, d_v] and conv tail [channels, kernel - 1] by default; int8 codes, scales and residuals
as bytes otherwise, heads (and channel groups) first, so the state arrives with its error-feedback carry.
"""
from __future__ import annotations

import torch

from latentmoe_lab.paged_pools import DSAPool, KDAPool, PagedPools, PlainFormat, kda_shapes, slot_layout
from latentmoe_lab.quant.kv_index import QuantizedIndexFormat
from latentmoe_lab.quant.kv_mla import QuantizedLatentFormat


def token_byte_offsets(fmt, storage: torch.Tensor, dim: int, positions: torch.Tensor) -> torch.Tensor:
    """Offsets [N, bytes/token] int64 into storage's flattened byte view of each flat position's bytes."""
    if not isinstance(fmt, (PlainFormat, QuantizedLatentFormat, QuantizedIndexFormat)):
        raise TypeError(f"format: a transfer knows the byte layouts of PlainFormat, QuantizedLatentFormat and "
                        f"QuantizedIndexFormat, got {type(fmt).__name__}")
    per_token = fmt.bytes_per_token(dim)
    positions = positions.long()
    if not isinstance(fmt, QuantizedIndexFormat):  # token-interleaved
        return positions[:, None] * per_token + torch.arange(per_token, device=positions.device)
    block_size = storage.shape[1] // per_token
    block, offset = positions.div(block_size, rounding_mode="floor"), positions % block_size
    base = (block * block_size * per_token)[:, None]
    scale_bytes = 4 * fmt.groups
    values = base + offset[:, None] * fmt.dim + torch.arange(fmt.dim, device=positions.device)
    scales = (base + block_size * fmt.dim + offset[:, None] * scale_bytes
              + torch.arange(scale_bytes, device=positions.device))
    return torch.cat([values, scales], dim=1)


def _flat_bytes(storage: torch.Tensor) -> torch.Tensor:
    """storage's bytes as one flat uint8 view (writes through it land in the pool)."""
    return storage.view(-1).view(torch.uint8)


def read_token_bytes(fmt, storage: torch.Tensor, dim: int, positions: torch.Tensor) -> torch.Tensor:
    """positions [N] flat -> uint8 [N, bytes/token], each token's stored bytes (a copy, on storage's device)."""
    return _flat_bytes(storage)[token_byte_offsets(fmt, storage, dim, positions.to(storage.device))]


def write_token_bytes(fmt, storage: torch.Tensor, dim: int, positions: torch.Tensor, rows: torch.Tensor) -> None:
    """Store rows uint8 [N, bytes/token] as the tokens at flat positions [N], byte for byte."""
    positions = positions.to(storage.device)
    _flat_bytes(storage)[token_byte_offsets(fmt, storage, dim, positions)] = rows.to(storage.device)


def _dsa_pools(pools: PagedPools) -> tuple[list[DSAPool], list[DSAPool]]:
    """(every DSA layer's pool, those that keep index keys): with dsa.index_share_every > 1 a layer that reuses
    another's selection has an empty index pool (docs/design.md §15.2)."""
    dsa = [pool for pool in pools.layers if isinstance(pool, DSAPool)]
    return dsa, [pool for pool in dsa if pool.index.numel() > 0]


def read_request_rows(pools: PagedPools, positions: torch.Tensor, slot: int | None) -> dict[str, torch.Tensor]:
    """A request's rows: its tokens at flat positions [N] in every DSA layer, its slot in every KDA layer
    (slot None: no KDA rows, [0, ...]; the prefix-cache spill reads a block alone, serving/cache_tiers/spill_blocks.py).

    -> {"dsa_latent": uint8 [L_dsa, N, E_latent], "dsa_index": uint8 [L_indexer, N, E_index] (the layers that
        keep index keys), "kda_state": [L_kda, *one slot's stored state] (fp32 [L_kda, H, d_k, d_v] by default),
        "kda_conv": [L_kda, *one slot's stored conv tail] ([L_kda, channels, kernel - 1])}
    (copies). With memory.offload the latent rows are read from the host tier, which holds every row.
    """
    dsa, indexed = _dsa_pools(pools)
    kda = [pool for pool in pools.layers if isinstance(pool, KDAPool) and slot is not None]
    tokens = len(positions)
    state_shape, conv_shape = kda_shapes(pools.config)
    return {
        "dsa_latent": _stack([read_token_bytes(p.latent_format, p.latent, p.latent_dim, positions) for p in dsa],
                             (tokens, _per_token(pools, "latent")), torch.uint8),
        "dsa_index": _stack([read_token_bytes(p.index_format, p.index, p.index_dim, positions) for p in indexed],
                            (tokens, _per_token(pools, "index")), torch.uint8),
        "kda_state": _stack([p.state[slot].clone() for p in kda], *slot_layout(pools.state_format, state_shape)),
        "kda_conv": _stack([p.conv[slot].clone() for p in kda], *slot_layout(pools.conv_format, conv_shape)),
    }


def write_request_rows(pools: PagedPools, positions: torch.Tensor, slot: int, rows: dict[str, torch.Tensor]) -> None:
    """The inverse of read_request_rows: rows stored at flat positions [N] and in KDA slot `slot`. With
    memory.offload the latent rows go to the host tier and any hot copies of those positions are dropped,
    as every write of the host tier does (serving/cache_tiers/offload_tier.py)."""
    dsa, indexed = _dsa_pools(pools)
    for pool, latent in zip(dsa, rows["dsa_latent"]):
        write_token_bytes(pool.latent_format, pool.latent, pool.latent_dim, positions, latent)
        if pool.offloaded:
            pool.hot.invalidate(positions)
    for pool, index in zip(indexed, rows["dsa_index"]):
        write_token_bytes(pool.index_format, pool.index, pool.index_dim, positions, index)
    kda = [pool for pool in pools.layers if isinstance(pool, KDAPool)]
    for pool, state, conv in zip(kda, rows["kda_state"], rows["kda_conv"]):
        pool.state[slot].copy_(state)
        pool.conv[slot].copy_(conv)


def _per_token(pools: PagedPools, kind: str) -> int:
    dim = {"latent": pools.config.mla.kv_lora_rank + pools.config.mla.qk_rope_head_dim,
           "index": pools.config.indexer.head_dim}[kind]
    return (pools.latent_format if kind == "latent" else pools.index_format).bytes_per_token(dim)


def _stack(parts: list[torch.Tensor], shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """torch.stack, or an empty [0, *shape] tensor for a model without layers of that kind."""
    return torch.stack(parts) if parts else torch.zeros((0, *shape), dtype=dtype)


def flat_positions(block_table: list[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """Flat pool positions [num_tokens] of a sequence's first num_tokens tokens through its block table."""
    positions = torch.arange(num_tokens)
    blocks = torch.tensor(block_table, dtype=torch.int64)
    return blocks[positions // block_size] * block_size + positions % block_size


def rows_to_wire(rows: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """Rows as name -> (uint8 numpy, dtype name, shape), for a pipe between processes (numpy has no bf16)."""
    return {name: (t.contiguous().view(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."),
                   tuple(t.shape)) for name, t in rows.items()}


def rows_from_wire(wire: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """The inverse of rows_to_wire."""
    return {name: torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)
            for name, (raw, dtype, shape) in wire.items()}
