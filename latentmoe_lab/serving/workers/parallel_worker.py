"""One rank of a parallel serving group: its PP stage and TP/EP shard, its own paged pools, a forward per step
(docs/design.md §10).

A long-lived process (parallel/launch.py runs functions to completion; a server needs ranks that wait for
the next step). parallel_runner.WorkerGroup starts pp * tp * ep of them; each

    joins     gloo over the TCPStore the engine process serves on 127.0.0.1 (GLOO_SOCKET_IFNAME=lo), then
              ProcessMesh gives every pp / tp / ep line its own group, all with the layout's timeout
    loads     the full weights from safetensors bytes and cuts its part: its stage's layers (with the
              embedding on the first stage, the final norm and LM head on the last, serving/workers/pipeline_stage.py),
              then the way parallel/sharded.py does: heads and FFN widths sliced (parallel/tensor.py),
              experts [r*E/ep, (r+1)*E/ep) behind the All-to-All dispatcher (parallel/expert.py), or with
              EPLB its P/ep expert slots behind the replica-choosing one (parallel/eplb/online.py); its
              config then carries heads / tp
    allocates PagedPools of its stage's plan (its layers, local heads): KDA state [rows, H/tp, d_k, d_v];
              the DSA latent and indexer keys are replicated, so the block pools are whole on every rank
              of a stage; it reports the bytes it allocated with "ready"
    loops     rank 0 takes a step from the engine's pipe and broadcasts it (a header object, then the
              ForwardBatch's index tensors as one flat int64 tensor, then the image features); every
              rank applies the step's KDA slot copies and EPLB switches (staging the next layers on a
              side thread, parallel/eplb/migration.py) and runs its part of the forward; the answer rank
              (the first of the last stage) sends back the logits with its forward and collective
              seconds (parallel/comm.py's timeline) and its resident memory, every other rank those
              figures alone. A step with a hidden_index (the MTP drafter's, docs/design.md §12) also
              gets those rows of the last hidden state from the answer rank: the last stage holds it,
              and after each layer's TP all-reduce it is the same on every rank of the stage.

Every rank sees the same tokens, so each EP rank routes all of them: its All-to-All rows duplicate the
other rank's, which costs compute but not correctness (each rank gets the complete expert sum).
While the engine is idle rank 0 broadcasts a heartbeat every HEARTBEAT_S, so that the ranks waiting in
the broadcast never reach the group timeout; a dead peer still surfaces within it. A rank that fails
reports ("collective" | "error", text) on its pipe and exits: the engine then restarts the whole group.
"""
from __future__ import annotations

import math
import os
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.parallel.comm import Comm, CollectiveError
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.eplb.load import moe_layers
from latentmoe_lab.parallel.eplb.migration import SlotMigrator
from latentmoe_lab.parallel.expert import ParallelMoE
from latentmoe_lab.parallel.mesh import ProcessMesh, coords_rank
from latentmoe_lab.parallel.sequence import SequenceLayout
from latentmoe_lab.parallel.shard_layers import shard_layers
from latentmoe_lab.parallel.tensor import local_config
from latentmoe_lab.serving.cache_tiers.offload_tier import OffloadedPools
from latentmoe_lab.serving.workers.pipeline_stage import ServingStage, StageForward, keep_stage

INDEX_FIELDS = ("input_ids", "positions", "query_start", "context_len", "state_slot", "block_table",
                "slot_mapping", "emit", "image_mask", "decode", "logits_index",
                "spec_slots", "hidden_index")  # speculative decoding: verify steps, the MTP drafter's rows
BOOL_FIELDS = ("emit", "image_mask", "decode")


# ------------------------------------------------------------------ the step on the wire
def pack_batch(batch: ForwardBatch, copies: list[tuple[int, int]]) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
    """ForwardBatch + the KDA slot copies to apply before it -> (header, flat int64 [n], features | None)."""
    parts = {name: getattr(batch, name) for name in INDEX_FIELDS if getattr(batch, name) is not None}
    features = batch.image_features
    header = {"kind": "step", "block_size": batch.block_size, "copies": list(copies),
              "shapes": {name: tuple(t.shape) for name, t in parts.items()},
              "features": None if features is None else (tuple(features.shape), str(features.dtype).split(".")[-1])}
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in parts.values()])
    return header, flat, features


def unpack_batch(header: dict, flat: torch.Tensor, features: torch.Tensor | None) -> ForwardBatch:
    fields, offset = {}, 0
    for name, shape in header["shapes"].items():
        size = math.prod(shape)
        value = flat[offset:offset + size].view(shape)
        fields[name] = value.bool() if name in BOOL_FIELDS else value
        offset += size
    return ForwardBatch(**fields, block_size=header["block_size"], image_features=features)


def busy_seconds(events) -> float:
    """Seconds covered by at least one of the CommEvents (their union: an async All-to-All counts until it
    is waited on, so the shared experts it overlaps count too, and a collective inside that span only once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted((e.start, e.end) for e in events if e.end is not None):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def resident_bytes() -> int:
    """This process's resident set size in bytes (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def answer_rank(pconfig: ParallelConfig) -> int:
    """The rank that sends the step's logits to the engine: the first of the last pipeline stage."""
    return coords_rank(pconfig, {"pp": pconfig.pp - 1})


def _wire(hidden: torch.Tensor | None):
    """The hidden rows [H, hidden] as a float32 array for the pipe (numpy has no bf16; widening is exact and
    the engine narrows them back to the model's dtype), None when the step asked for none."""
    return None if hidden is None else hidden.float().numpy()


def _flat_numel(header: dict) -> int:
    return sum(math.prod(shape) for shape in header["shapes"].values())


def broadcast_message(rank: int, message: tuple | None) -> tuple[dict, torch.Tensor | None, torch.Tensor | None]:
    """Rank 0's (header, flat, features) -> the same on every rank of the world group; header alone for
    "ping" and "stop". A failure is re-raised as CollectiveError naming the rank."""
    try:
        box = [message[0] if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        header = box[0]
        if header["kind"] != "step":
            return header, None, None
        flat = message[1] if rank == 0 else torch.empty(_flat_numel(header), dtype=torch.int64)
        dist.broadcast(flat, src=0)
        features = None
        if header["features"] is not None:
            shape, dtype = header["features"]
            features = message[2] if rank == 0 else torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(features, src=0)
        return header, flat, features
    except Exception as error:  # noqa: BLE001 - named and re-raised
        raise CollectiveError(f"rank {rank}: broadcast of the step failed (a peer died or timed out): "
                              f"{error}") from error


# ------------------------------------------------------------------ this rank's shard
def shard_for_serving(model: LatentMoEForCausalLM, comm: Comm, layers: range,
                      placement: torch.Tensor | None = None) -> LatentMoEForCausalLM:
    """Cut `model` (this process's own copy) in place to this rank's PP stage (`layers`) and TP/EP shard, as
    "loads" in the module docstring says; `model.expert_slots` maps each MoE layer position to its ExpertSlots
    (with `placement` [MoE layers, P]: this rank's P / ep slots)."""
    mesh = comm.mesh
    if mesh.pconfig.pp > 1:
        keep_stage(model, layers, mesh.is_first_stage, mesh.is_last_stage)
    # parallel/shard_layers.py, the loop parallelize runs too; every MoE behind its dispatcher (its routed pairs)
    model.expert_slots = shard_layers(zip(layers, model.layers), model.config, comm, SequenceLayout(), placement,
                                      moe_always=True)
    model.config = local_config(model.config, mesh.pconfig.tp)
    return model


def load_weights(config: ModelConfig, weights: bytes) -> LatentMoEForCausalLM:
    """The full model from safetensors bytes (parallel_runner.weights_bytes)."""
    from safetensors.torch import load

    state = load(weights)
    model = LatentMoEForCausalLM(config).to(next(iter(state.values())).dtype)
    model.load_state_dict(state, strict=True)
    return model.eval()


# ------------------------------------------------------------------ the process
def run_worker(rank: int, pconfig: ParallelConfig, store_port: int, config: ModelConfig,
               stages: list[ServingStage], weights: bytes, conn, heartbeat_s: float, threads: int,
               placement: torch.Tensor | None = None) -> None:
    """The body of one worker process (module level, so the forkserver can start it); placement: EPLB's
    initial [MoE layers, P] (None: one slot per expert)."""
    try:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own sockets on the loopback interface only
        torch.set_num_threads(threads)
        timeout = timedelta(seconds=pconfig.timeout_s)
        store = dist.TCPStore("127.0.0.1", store_port, pconfig.world_size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=pconfig.world_size, timeout=timeout)
        from latentmoe_lab.serving.planner import allocate_pools

        comm = Comm(ProcessMesh(pconfig))
        comm.timeline = []  # every collective of the forward, for this rank's collective seconds
        stage = stages[comm.mesh.index("pp")]
        model = load_weights(config, weights)
        model.mtp = None  # the MTP drafter runs in the engine's process, on the engine's copy of the head
        if pconfig.world_size > 1:  # a lone forward process (parallel.forward_process) keeps the whole model
            model = shard_for_serving(model, comm, stage.layers, placement)
        pools = allocate_pools(stage.plan.config, stage.plan)
        conn.send(("ready", os.getpid(), sum(pools.nbytes().values())))
        _serve(rank, StageForward(model, comm, stage.layers, config), pools, comm, conn, heartbeat_s)
    except BaseException as error:  # noqa: BLE001 - reported to the engine, then this process ends
        kind = "collective" if isinstance(error, CollectiveError) else "error"
        try:
            conn.send((kind, f"rank {rank}: {type(error).__name__}: {error}\n{traceback.format_exc()}"))
        except OSError:
            pass  # the engine is gone too
        os._exit(1)  # not a clean teardown: a peer may be dead, and destroy_process_group could wait on it
    dist.destroy_process_group()


def exchange_rows(pools, rank: int, header: dict) -> dict[str, tuple]:
    """Rows of one request (a prefill -> decode transfer, serving/disagg/) or of one prefix-cache block and
    snapshot row (the spill, serving/cache_tiers/spill_blocks.py), after the queued KDA slot copies (_serve):
    "read_rows" -> this rank's rows; "write_rows" -> this rank's share stored; -> {}. Rows travel as
    transport.pool_rows.rows_to_wire tuples."""
    from latentmoe_lab.serving.transport.pool_rows import (read_request_rows, rows_from_wire, rows_to_wire,
                                                        write_request_rows)

    positions = torch.tensor(header["positions"], dtype=torch.int64)
    if header["kind"] == "read_rows":
        return rows_to_wire(read_request_rows(pools, positions, header["slot"]))
    write_request_rows(pools, positions, header["slot"], rows_from_wire(header["shares"][rank]))
    return {}


def _serve(rank: int, forward: StageForward, pools, comm: Comm, conn, heartbeat_s: float) -> None:
    # EPLB: layers staged on a side thread with one step, switched at the next one's start (parallel/eplb/migration.py)
    migrator = SlotMigrator(getattr(forward.model, "expert_slots", {}))
    while True:
        message = None
        if rank == 0:
            try:
                message = conn.recv() if conn.poll(heartbeat_s) else ({"kind": "ping"},)
            except EOFError:  # the engine process ended without a word: take the group down with it
                message = ({"kind": "stop"},)
            if message[0]["kind"] == "step":
                message = (message[0], torch.from_numpy(message[1]),
                           None if message[2] is None else torch.from_numpy(message[2]))
        header, flat, features = broadcast_message(rank, message)
        if header["kind"] == "stop":
            migrator.close()
            return
        if header["kind"] == "ping":
            continue
        # the queued KDA slot copies first, in order: a snapshot copy must not read rows written after it, and a
        # row read must hold its queued snapshot
        for src, dst in header["copies"]:
            pools.copy_slot(src, dst)
        if header["kind"] in ("read_rows", "write_rows"):  # a transfer (serving/transport/) or the spill's rows
            conn.send(("rows", exchange_rows(pools, rank, header)))
            continue
        # before the forward, the same layers on every rank (the header is broadcast)
        moved = migrator.apply(header.get("eplb", {}))
        batch = unpack_batch(header, flat, features)
        start = time.perf_counter()
        output = forward(batch, pools)  # None on a pipeline stage before the last
        collective = busy_seconds(comm.timeline)
        comm.timeline.clear()
        # every rank's own seconds, for its rank="r" series, and its resident memory (a soak watches it)
        seconds = (time.perf_counter() - start, collective, resident_bytes())
        # routed tokens per logical expert of this stage's MoE layers [L_stage, E] (every EP rank routes every
        # token, so any rank's are the stage's), the bytes copied here for the layers this step switched, and the
        # (token, expert) pairs this rank's experts computed since the group started
        counts = [m.last_expert_counts for m in moe_layers(forward.model)]
        load = {"counts": (torch.stack(counts) if counts
                           else torch.zeros(0, forward.config.moe.num_experts, dtype=torch.int64)).numpy(),
                "moved": moved, "pairs": sum(int(m.dispatcher.stats.expert_pairs.sum())
                                             for m in forward.model.modules() if isinstance(m, ParallelMoE)),
                # memory.offload: this rank's host-tier counters since its pools were allocated (offload_tier.py)
                "offload": pools.stats() if isinstance(pools, OffloadedPools) else None}
        if rank == answer_rank(comm.mesh.pconfig):
            conn.send(("logits", output.logits.numpy(), output.finite.numpy(), seconds, load, _wire(output.hidden)))
        else:
            conn.send(("seconds", seconds, load))
