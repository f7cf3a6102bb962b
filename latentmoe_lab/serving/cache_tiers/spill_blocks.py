"""Where the prefix-cache spill finds its blocks and snapshot rows: through the runner's rows (docs/design.md
§15.3), whether the pools are in the engine's process or in its worker processes.

SpillingBlockManager (serving/cache_tiers/spill.py) reads an entry when the device cache evicts it and writes entries
back on a hit, always in one layout, whatever the process layout:

    rows   {"layer{i}.latent": block i's latent storage, "layer{i}.index": its index storage}  every DSA
           layer i of the whole model (index: layers that keep keys), each as the pool's format stores ONE
           block (fp8 codes stay codes)
    kda    {"layer{i}.state": fp32 [H, d_k, d_v], "layer{i}.conv": [channels, kernel - 1]}  every KDA layer,
           as the slot formats store one slot (memory.state_dtype int8: codes, scales and residuals as bytes),
           whole heads; with an MTP head also "mtp.hidden" [hidden] in the compute dtype, the hidden row kept
           beside the snapshot row (spec/hidden_rows.py: the MTP drafter starts from it after a restore). It
           is optional: an entry without it restores the state, and the drafter starts after the boundary

`RunnerBlocks` reads and writes them with the runner's read_rows / write_rows, the interface a transfer uses
(model_runner.LocalPools in this process; ParallelRunner over worker processes, gathered over tensor-parallel
heads and pipeline stages by serving/transport/tp_rows.py). Rows carry each token's stored bytes, which
`BlockBytes` lays out as the block's storage and back, byte for byte. So an entry is the same file whichever
process layout spilled it, and a disk spill serves any other.

A worker group lost during a read or a write (WorkerGroupError) drops that entry with a warning: the group
is dead, the engine's next step restarts it, and a restart empties the device cache anyway (engine.py).
"""
from __future__ import annotations

import logging

import torch

from latentmoe_lab.config import DSA
from latentmoe_lab.paged_pools import kda_shapes, slot_layout
from latentmoe_lab.serving.cache_tiers.spill_host import Entry
from latentmoe_lab.serving.transport.pool_rows import flat_positions, token_byte_offsets
from latentmoe_lab.serving.workers.parallel_runner import WorkerGroupError

ROWS, KDA = "rows", "kda"
HIDDEN = "mtp.hidden"  # a "kda" entry's MTP hidden row, where the model has a head
log = logging.getLogger(__name__)


class BlockBytes:
    """One block of a storage format <-> its tokens' stored bytes uint8 [block_size, bytes/token] (the rows
    a read_rows message carries, serving/transport/pool_rows.py), a permutation of the block's bytes."""

    def __init__(self, fmt, dim: int, block_size: int):
        probe = fmt.allocate(1, block_size, dim, "cpu")
        self.dtype, self.shape = probe.dtype, tuple(probe.shape[1:])
        self.offsets = token_byte_offsets(fmt, probe, dim, torch.arange(block_size))
        self.nbytes = probe.numel() * probe.element_size()
        if self.offsets.numel() != self.nbytes or self.offsets.unique().numel() != self.nbytes:
            raise TypeError(f"format: {type(fmt).__name__} stores bytes outside its tokens' rows; a spilled block "
                            "could not be rebuilt from them")

    def to_block(self, tokens: torch.Tensor) -> torch.Tensor:
        flat = torch.empty(self.nbytes, dtype=torch.uint8)
        flat[self.offsets] = tokens
        return flat.view(self.dtype).view(self.shape)

    def to_tokens(self, block: torch.Tensor) -> torch.Tensor:
        return block.contiguous().view(-1).view(torch.uint8)[self.offsets]


class RunnerBlocks:
    """The engine's pools through `runner` (its ModelRunner or ParallelRunner, set by connect_runner once it
    exists; any model_runner.LocalPools). config: the whole model's; plan: a rank's CachePlan, or PagedPools
    (what is read of it: block_size, latent_format, index_format, state_format, conv_format and dtype)."""

    def __init__(self, config, plan, runner=None):
        self.block_size, self.runner = plan.block_size, runner
        self.hidden_rows = None  # the engine's SlotHiddenRows (spec/hidden_rows.py), set by connect_runner
        self.hidden_shape = {HIDDEN: (plan.dtype, (config.hidden_size,))} if config.mtp_depth > 0 else {}
        self.lost_group = None  # runner.restarts when its group was lost under a read or write: skip until restart
        self.dsa = [i for i, kind in enumerate(config.layer_types) if kind == DSA]
        # the layers that keep index keys, as PagedPools allocates them (none for dense MLA, dsa.use_indexer off)
        self.indexed = [i for i in self.dsa if config.dsa.use_indexer and config.index_source(i) == i]
        self.kda = [i for i, kind in enumerate(config.layer_types) if kind != DSA]
        self.latent = BlockBytes(plan.latent_format, config.mla.kv_lora_rank + config.mla.qk_rope_head_dim,
                                 plan.block_size)
        self.index = BlockBytes(plan.index_format, config.indexer.head_dim, plan.block_size)
        (state, state_dtype), (conv, conv_dtype) = (slot_layout(fmt, shape) for fmt, shape in
                                                    zip((plan.state_format, plan.conv_format), kda_shapes(config)))
        self.kda_shapes = {"state": (state_dtype, state), "conv": (conv_dtype, conv)}  # one slot, whole heads

    def optional(self, kind: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """What an entry of `kind` may hold besides shapes(kind): a "kda" entry's MTP hidden row."""
        return self.hidden_shape if kind == KDA else {}

    def shapes(self, kind: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        if kind == KDA:
            return {f"layer{i}.{part}": shape for i in self.kda for part, shape in self.kda_shapes.items()}
        shapes = {}
        for i in self.dsa:
            shapes[f"layer{i}.latent"] = (self.latent.dtype, self.latent.shape)
            if i in self.indexed:
                shapes[f"layer{i}.index"] = (self.index.dtype, self.index.shape)
        return shapes

    def read(self, kind: str, index: int) -> Entry | None:
        """Block `index` (ROWS) or KDA row `index` (KDA), CPU copies; None if the worker group was lost."""
        if self.lost_group == self.runner.restarts:
            return None
        size = self.block_size
        positions = flat_positions([index], size, size) if kind == ROWS else torch.zeros(0, dtype=torch.long)
        try:
            rows = self.runner.read_rows(positions, index if kind == KDA else None)
        except WorkerGroupError as error:
            self.lost_group = self.runner.restarts
            log.warning("prefix cache spill: the worker group was lost reading a %s entry; it is dropped (and "
                        "every entry until the engine restarts the group): %s", kind, error)
            return None
        if kind == KDA:
            hidden = None if self.hidden_rows is None else self.hidden_rows.stored(index)
            return {f"layer{i}.{part}": rows[f"kda_{part}"][j].cpu() for j, i in enumerate(self.kda)
                    for part in ("state", "conv")} | ({} if hidden is None else {HIDDEN: hidden})
        entry = {f"layer{i}.latent": self.latent.to_block(rows["dsa_latent"][j].cpu()) for j, i in enumerate(self.dsa)}
        return entry | {f"layer{i}.index": self.index.to_block(rows["dsa_index"][j].cpu())
                        for j, i in enumerate(self.indexed)}

    def write(self, items: list[tuple[str, int, Entry]]) -> None:
        """Every block and the snapshot row (at most one) of a hit, in one write_rows message."""
        if self.lost_group == self.runner.restarts:
            return
        blocks = [(index, tensors) for kind, index, tensors in items if kind == ROWS]
        snapshots = [(index, tensors) for kind, index, tensors in items if kind == KDA]
        positions = flat_positions([index for index, _ in blocks], self.block_size, len(blocks) * self.block_size)
        rows = {"dsa_latent": self._tokens(blocks, self.dsa, "latent", self.latent),
                "dsa_index": self._tokens(blocks, self.indexed, "index", self.index)}
        for part, (dtype, shape) in self.kda_shapes.items():
            rows[f"kda_{part}"] = (torch.stack([snapshots[0][1][f"layer{i}.{part}"] for i in self.kda])
                                   if snapshots and self.kda else torch.zeros((0, *shape), dtype=dtype))
        if snapshots and self.hidden_rows is not None:  # engine-side: no message to the workers
            self.hidden_rows.write(snapshots[0][0], snapshots[0][1].get(HIDDEN))
        try:
            self.runner.write_rows(positions, snapshots[0][0] if snapshots else None, rows)
        except WorkerGroupError as error:
            self.lost_group = self.runner.restarts
            log.warning("prefix cache spill: the worker group was lost restoring a hit; the next step restarts "
                        "it with an empty device cache: %s", error)

    def _tokens(self, blocks, layers: list[int], part: str, layout: BlockBytes) -> torch.Tensor:
        """uint8 [len(layers), tokens of the blocks, bytes/token]: each layer's rows of the blocks' entries."""
        size = self.block_size
        tokens = torch.empty(len(layers), len(blocks) * size, layout.offsets.shape[1], dtype=torch.uint8)
        for j, i in enumerate(layers):
            for b, (_, tensors) in enumerate(blocks):
                tokens[j, b * size:(b + 1) * size] = layout.to_tokens(tensors[f"layer{i}.{part}"])
        return tokens
