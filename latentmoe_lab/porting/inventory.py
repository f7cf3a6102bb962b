"""The operator inventory: every op the model dispatches, per layer type, on the meta device (docs/design.md §16).

    inv = operator_inventory(ModelConfig.from_preset("k3-2.8t"), "prefill", tokens=4096)
    inv.rows        # one OpRow per (layer type, op): count, shapes, dtypes, FLOPs, bytes, standard / custom
    inv.top("flops"), inv.top("bytes")     # the heaviest ops, merged over layer types

How: the model is built on the meta device (no storage), its fused paths go through the custom ops
(porting/swap.py), and porting/recorder.py records every op a forward dispatches with the module it came
from, its shapes, dtypes, FLOPs and bytes. One representative block of each kind (attention type x dense /
MoE FFN) runs, and its ops count once per layer of that kind: blocks of one kind dispatch the same ops on
the same shapes (tests/test_porting_inventory.py checks it against a dispatch trace of every layer of a
real run).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from latentmoe_lab.cache import DSALayerCache, KDALayerCache
from latentmoe_lab.config import KDA, ModelConfig
from latentmoe_lab.layers.vision import patch_positions
from latentmoe_lab.porting.module_path import ModuleTracker, layer_type
from latentmoe_lab.porting.recorder import DispatchRecorder, OpCall
from latentmoe_lab.porting.swap import use_custom_ops

PHASES = ("prefill", "decode")
IMAGE_GRID = (32, 32)  # patches per image side: a 448 x 448 image at patch 14, 256 tokens after the 2x2 merger
# What needs custom work on a new accelerator: the KDA recurrence / chunk, top-k, index gather / scatter,
# grouped GEMM and the sort-based permutation. Everything else (matmuls, elementwise, reductions, views,
# copies) a vendor library already has.
CUSTOM_WORK = {"latentmoe", "topk", "sort", "argsort", "gather", "scatter", "scatter_add", "scatter_", "index",
               "index_select", "index_add", "index_add_", "index_put", "index_put_", "index_copy", "index_copy_",
               "bincount", "_grouped_mm", "linalg_solve_triangular", "masked_scatter", "nonzero"}


def op_kind(name: str) -> str:
    """"custom" for the ops needing custom work on a new accelerator, else "standard"."""
    namespace, _, base = name.partition(".")
    return "custom" if namespace == "latentmoe" or base in CUSTOM_WORK else "standard"


@dataclass
class OpRow:
    """One (layer type, op) of the inventory, summed over its calls and layers."""

    layer_type: str
    op: str
    kind: str
    count: int = 0
    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    shapes: list = field(default_factory=list)  # distinct input shapes, first few
    dtypes: list = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass
class Inventory:
    """The inventory of one forward: rows, and what it was taken of."""

    preset: str
    phase: str
    tokens: int
    context: int
    rows: list[OpRow]

    @property
    def total_flops(self) -> int:
        return sum(r.flops for r in self.rows)

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.rows)

    def flops_per_token(self) -> float:
        return self.total_flops / self.tokens

    def by_op(self) -> dict[str, OpRow]:
        """Rows merged over layer types, keyed by op name."""
        merged: dict[str, OpRow] = {}
        for row in self.rows:
            into = merged.setdefault(row.op, OpRow("all", row.op, row.kind))
            into.count += row.count
            into.flops += row.flops
            into.bytes_read += row.bytes_read
            into.bytes_written += row.bytes_written
        return merged

    def top(self, key: str = "flops", n: int = 10) -> list[OpRow]:
        """The n ops (merged over layer types) with the most FLOPs or bytes."""
        if key not in ("flops", "bytes"):
            raise ValueError(f"key: must be 'flops' or 'bytes', got {key!r}")
        ranked = sorted(self.by_op().values(), key=lambda r: getattr(r, key), reverse=True)
        return [r for r in ranked if getattr(r, key)][:n]


def aggregate(calls: list[OpCall], model, multiplier: dict[str, int] | None = None) -> list[OpRow]:
    """Sum OpCalls into OpRows by (layer type, op); a call in block i counts multiplier[str(i)] times."""
    rows: dict[tuple[str, str], OpRow] = {}
    for call in calls:
        kind = layer_type(call.path, model)
        parts = call.path.split(".")
        times = (multiplier or {}).get(parts[1], 1) if parts[0] == "layers" and len(parts) > 1 else 1
        row = rows.setdefault((kind, call.op), OpRow(kind, call.op, op_kind(call.op)))
        row.count += times
        row.flops += times * call.flops
        row.bytes_read += times * call.bytes_read
        row.bytes_written += times * call.bytes_written
        if call.shapes not in row.shapes and len(row.shapes) < 4:
            row.shapes.append(call.shapes)
        if call.dtypes not in row.dtypes and len(row.dtypes) < 4:
            row.dtypes.append(call.dtypes)
    return list(rows.values())


def representative_blocks(config: ModelConfig) -> dict[int, int]:
    """First layer index of each block kind (attention type, dense or MoE FFN) -> layers of that kind."""
    first: dict[tuple[str, bool], int] = {}
    counts: Counter = Counter()
    for i in range(config.num_layers):
        kind = (config.layer_types[i], config.is_moe_layer(i))
        first.setdefault(kind, i)
        counts[kind] += 1
    return {index: counts[kind] for kind, index in first.items()}


def _decode_cache(block, config: ModelConfig, batch: int, context: int, weight: torch.Tensor):
    """A layer cache (zeros, on weight's device and dtype) holding `context` tokens, with room for one more
    (so the traced step does not regrow it)."""
    like = dict(device=weight.device, dtype=weight.dtype)
    if block.attention_type == KDA:
        kda = config.kda
        return KDALayerCache(
            conv_state=torch.zeros(batch, block.attn.conv_channels, kda.conv_kernel - 1, **like),
            recurrent_state=torch.zeros(batch, kda.num_heads, kda.head_dim_k, kda.head_dim_v, device=weight.device))
    mla, cache = config.mla, DSALayerCache()
    cache.append(torch.zeros(batch, context + 1, mla.kv_lora_rank, **like),
                 torch.zeros(batch, context + 1, mla.qk_rope_head_dim, **like),
                 torch.zeros(batch, context + 1, config.indexer.head_dim, **like))
    cache.latent, cache.k_rope, cache.index_keys = (t[:, :context] for t in
                                                     (cache.latent, cache.k_rope, cache.index_keys))
    return cache


def _check_request(config: ModelConfig, phase: str, tokens: int, context: int) -> None:
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
    if phase not in PHASES:
        raise ValueError(f"phase: must be one of {PHASES}, got {phase!r}")
    for name, value, low in (("tokens", tokens, 1), ("context", context, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")
    longest = context + (tokens if phase == "prefill" else 1)
    if longest > config.max_position_embeddings:
        raise ValueError(f"context: context + new tokens ({longest}) exceed max_position_embeddings "
                         f"({config.max_position_embeddings})")


def encode_images(model, images: int, tracker: ModuleTracker) -> torch.Tensor:
    """VisionTower.forward on `images` images of IMAGE_GRID patches (zeros), without its value checks (meta
    tensors hold no values): patch embedding, every ViT block, merger, projector -> [images * 256, hidden]."""
    vision, device = model.vision, model.vision.patch_embed.weight.device
    with tracker.inside("vision"):  # the position bookkeeping the tower does outside its submodules
        grid = torch.tensor([IMAGE_GRID] * images)
        rows, cols, owner = (t.to(device) for t in patch_positions(grid, vision.merge_size))
        same_image = owner[:, None] == owner[None, :]
        pixels = torch.zeros(int(grid.prod(dim=1).sum()), vision.patch_dim, device=device,
                             dtype=vision.patch_embed.weight.dtype)
    x = vision.patch_embed(pixels)
    for block in vision.blocks:
        x = block(x, rows, cols, same_image)
    return vision.projector(vision.merger(x))


def _check_images(config: ModelConfig, phase: str, tokens: int, images: int) -> None:
    if isinstance(images, bool) or not isinstance(images, int) or images < 0:
        raise ValueError(f"images: must be an integer >= 0, got {images!r}")
    if not images:
        return
    if config.vision is None:
        raise ValueError(f"images: preset {config.name!r} has no vision tower")
    if phase != "prefill":
        raise ValueError("images: only a prefill runs the vision tower (decode steps are text)")
    per_image = IMAGE_GRID[0] * IMAGE_GRID[1] // config.vision.merge_size ** 2
    if images * per_image > tokens:
        raise ValueError(f"images: {images} images of {per_image} tokens each exceed the {tokens} prefill tokens")


def trace_forward(model, phase: str, tokens: int, context: int, layers: dict[int, int] | None = None,
                  images: int = 0) -> list[OpCall]:
    """Run embedding (and the vision tower on `images` images), the chosen blocks (all when layers is None),
    final norm and LM head under the recorder.

    prefill: input [1, tokens] after `context` cached tokens; decode: [tokens, 1], each with `context`.
    The images' merged tokens are counted among the prefill's `tokens` (their embeddings are replaced).
    The model's parameters may be on the meta device or real; the inputs are made on the same device.
    """
    config = model.config
    device = model.embed_tokens.weight.device
    batch, length = (1, tokens) if phase == "prefill" else (tokens, 1)
    input_ids = torch.zeros(batch, length, dtype=torch.long, device=device)
    chosen = range(config.num_layers) if layers is None else sorted(layers)
    caches = {i: _decode_cache(model.layers[i], config, batch, context, model.embed_tokens.weight)
              if (phase == "decode" or context) else None
              for i in chosen}
    with torch.no_grad(), use_custom_ops(), ModuleTracker(model) as tracker, DispatchRecorder(tracker) as recorder:
        x = model.embed_tokens(input_ids)
        if images:
            encode_images(model, images, tracker)
        for i in chosen:
            x = model.layers[i](x, caches[i])
        logits = model.lm_head(model.norm(x))
        with tracker.inside("lm_head"):  # the model's fp32 cast of the logits
            logits.float()
    return recorder.calls


def operator_inventory(config: ModelConfig, phase: str = "prefill", tokens: int = 4096, context: int = 0,
                       every_layer: bool = False, dtype: torch.dtype = torch.bfloat16, images: int = 0) -> Inventory:
    """The inventory of one forward of `config` built on the meta device (nothing is allocated).

    images: prefill only, that many images of IMAGE_GRID patches through the vision tower; their merged
    tokens are among the `tokens` (so tokens >= images x 256). The closed-form budget covers the text path.

    dtype: the weights' and activations' storage (bf16, as deployed; routers, KDA state and softmax stay fp32).
    every_layer: run all blocks instead of one per kind (slower at full scale; same result).
    """
    from latentmoe_lab.meta import build_meta_model

    _check_request(config, phase, tokens, context)
    _check_images(config, phase, tokens, images)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: must be torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}")
    model = build_meta_model(config).to(dtype)
    layers = None if every_layer else representative_blocks(config)
    calls = trace_forward(model, phase, tokens, context, layers, images)
    multiplier = {str(i): n for i, n in (layers or {}).items()}
    return Inventory(config.name, phase, tokens, context, aggregate(calls, model, multiplier))
