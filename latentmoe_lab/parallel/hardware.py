"""Hardware and workload descriptions the layout planner takes (nominal public datasheet figures).

A Workload here is a shape to plan for (mode, sequence length, sequences per step), not a routing pattern
(routing_workloads.py) nor serve-bench's request arrivals.

Bandwidths are bytes/s per device in one direction; FLOP/s are dense bf16 (no sparsity).
`devices_per_node` decides which groups stay on NVLink: the mesh puts tp innermost, so a
group whose member stride times its size fits in a node talks at intra-node speed.
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: float
    hbm_bandwidth: float
    peak_flops: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency: float
    inter_node_latency: float
    devices_per_node: int = 8
    usable_fraction: float = 0.9  # the rest: CUDA context, allocator fragmentation, comm buffers

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes * self.usable_fraction


HARDWARE = {
    "H100-80GB": Hardware("H100-80GB", 80 * GB, 3.35e12, 989e12, 450 * GB, 50 * GB, 3e-6, 10e-6),
    "H200-141GB": Hardware("H200-141GB", 141 * GB, 4.8e12, 989e12, 450 * GB, 50 * GB, 3e-6, 10e-6),
    "B200-192GB": Hardware("B200-192GB", 192 * GB, 8.0e12, 2.25e15, 900 * GB, 100 * GB, 3e-6, 10e-6),
}


@dataclass(frozen=True)
class Workload:
    """What one step does.

    train: `micro_batch_sequences` sequences of `seq_len` tokens per data shard and micro-batch,
           `micro_batches` micro-batches per step; bf16 weights, fp32 grads, Adam (fp32 master + 2
           moments) sharded over each parameter's data-parallel replicas; full activation recomputation.
    serve: `sequences` concurrent requests over all data shards, each holding `seq_len` tokens of
           context; prefill in chunks of `prefill_chunk` tokens; routed experts in `expert_format`.
    """

    mode: str = "serve"
    seq_len: int = 131072
    sequences: int = 128
    micro_batch_sequences: int = 1
    micro_batches: int = 8
    prefill_chunk: int = 8192
    expert_format: str = "bf16"
    act_bytes: int = 2
    cache_bytes: int = 2  # MLA latent + rope key; index keys are FP8 + one fp32 scale per token

    def __post_init__(self) -> None:
        if self.mode not in ("train", "serve"):
            raise ValueError(f"mode: must be 'train' or 'serve', got {self.mode!r}")
        for name in ("seq_len", "sequences", "micro_batch_sequences", "micro_batches", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.expert_format not in ("bf16", "fp8", "mxfp4"):
            raise ValueError(f"expert_format: must be 'bf16', 'fp8' or 'mxfp4', got {self.expert_format!r}")


TRAIN_8K = Workload(mode="train", seq_len=8192, micro_batch_sequences=1, micro_batches=8)
SERVE_128K = Workload(mode="serve", seq_len=131072, sequences=128, expert_format="fp8")
