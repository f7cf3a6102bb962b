"""Pipeline parallelism: contiguous layer stages, balanced by cost, and GPipe / 1F1B micro-batch schedules.

Stage balance. A layer's cost is its active parameters per token (routed experts scaled by
top_k / E), which is proportional to its forward FLOPs per token; the LM head adds hidden * vocab
to the last stage. `partition_layers` picks the contiguous split with the smallest most-expensive
stage (exact, by dynamic programming), so 93 layers over 4 stages need not divide evenly.

Schedules, as lists of ("F" | "B", micro_batch) actions per stage:
    GPipe  every forward, then every backward: activations of all m micro-batches are alive.
    1F1B   stage s runs pp - s - 1 warm-up forwards, then alternates one forward / one backward,
           then drains: at most pp - s micro-batches are alive, with the same bubble.
Activations go downstream and gradients upstream by point-to-point send/recv; sends are
non-blocking, so a stage only ever waits on a receive and the schedules cannot deadlock.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from latentmoe_lab.config import DSA, ModelConfig
from latentmoe_lab.layers.attn_res import stream_width

FORWARD, BACKWARD = "F", "B"


def activation_width(config: ModelConfig, layers_done: int) -> int:
    """Hidden-size vectors per token that a pipeline cut after `layers_done` layers sends: 1 (the residual
    stream), or with Block AttnRes the embedding, the finished blocks and the partial sum
    (layers/attn_res.stream_width: 9 at a cut after layer 93 of k3 with blocks of 12)."""
    block_size = config.attn_res_block_size
    return 1 if block_size is None else stream_width(layers_done, block_size)


def active_parameters(block, config: ModelConfig) -> int:
    """Parameters one token touches in a decoder block: routed experts scaled by top_k / E."""
    fraction = config.moe.top_k / config.moe.num_experts
    return round(sum(p.numel() * (fraction if ".experts." in f".{name}" else 1.0)
                     for name, p in block.named_parameters()))


@lru_cache(maxsize=16)
def _layer_costs(config_json: str) -> tuple[int, ...]:
    from accelerate import init_empty_weights

    from latentmoe_lab.model import DecoderBlock

    config = ModelConfig.from_json_text(config_json)
    by_kind: dict[tuple[str, bool], int] = {}
    for i in range(config.num_layers):
        kind = (config.layer_types[i], config.is_moe_layer(i))
        if kind not in by_kind:
            with init_empty_weights(include_buffers=True):
                by_kind[kind] = active_parameters(DecoderBlock(config, i), config)
    return tuple(by_kind[(config.layer_types[i], config.is_moe_layer(i))] for i in range(config.num_layers))


def layer_costs(config: ModelConfig, model=None) -> list[int]:
    """Active parameters per token of each decoder layer: counted on `model` when given (no meta
    build), else on one meta-device block per layer kind (no memory, even for k3-2.8t)."""
    if model is not None:
        return [active_parameters(block, config) for block in model.layers]
    return list(_layer_costs(config.to_json()))


def stage_costs(config: ModelConfig, stages: list[range]) -> list[int]:
    """Active parameters per token of each stage, the LM head counted on the last one."""
    costs = layer_costs(config)
    totals = [sum(costs[i] for i in stage) for stage in stages]
    totals[-1] += config.hidden_size * config.vocab_size
    return totals


def shared_selection_cuts(config: ModelConfig) -> list[bool]:
    """allowed[j] for j in [0, num_layers]: may a stage start at layer j? Not inside a group of DSA layers that
    share one indexer's selections (dsa.index_share_every > 1): they do not cross a stage boundary."""
    allowed = [True] * (config.num_layers + 1)
    for layer, kind in enumerate(config.layer_types):
        if kind == DSA:
            for j in range(config.index_source(layer) + 1, layer + 1):
                allowed[j] = False
    return allowed


def partition_layers(config: ModelConfig, pp: int, model=None) -> list[range]:
    """Contiguous layer ranges, one per stage, minimising the largest stage cost (see layer_costs); a stage
    never starts inside a group of index-sharing DSA layers (shared_selection_cuts)."""
    n = config.num_layers
    if isinstance(pp, bool) or not isinstance(pp, int) or not 1 <= pp <= n:
        raise ValueError(f"pp: must be an integer in [1, num_layers={n}], got {pp!r}")
    if pp == 1:
        return [range(n)]  # one stage holds every layer: no need to cost them (a meta-device model build)
    costs = layer_costs(config, model)
    costs[-1] += config.hidden_size * config.vocab_size
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: smallest max-stage cost putting layers [0, i) on s stages; cut[s][i]: where the last stage starts
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0
    allowed = shared_selection_cuts(config)
    for s in range(1, pp + 1):
        for i in range(s, n - (pp - s) + 1):
            for j in range(s - 1, i):
                if not allowed[j]:
                    continue
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    if best[pp][n] == inf:
        raise ValueError(f"pp: {pp} stages need a stage boundary inside a group of DSA layers sharing one "
                         f"indexer's selections (dsa.index_share_every {config.dsa.index_share_every}), and "
                         "selections do not cross stages; use fewer stages or a smaller dsa.index_share_every")
    bounds, end = [], n
    for s in range(pp, 0, -1):
        bounds.append(range(cut[s][end], end))
        end = cut[s][end]
    return bounds[::-1]


# ----------------------------------------------------------------------------- schedules
def gpipe_schedule(micro_batches: int, stages: int, stage: int) -> list[tuple[str, int]]:
    """All forwards, then all backwards (in the same order, so the last stage's grads flow first)."""
    _check_schedule_args(micro_batches, stages, stage)
    return [(FORWARD, m) for m in range(micro_batches)] + [(BACKWARD, m) for m in range(micro_batches)]


def one_f_one_b_schedule(micro_batches: int, stages: int, stage: int) -> list[tuple[str, int]]:
    """Warm-up forwards, then one forward / one backward in turn, then the remaining backwards."""
    _check_schedule_args(micro_batches, stages, stage)
    warmup = min(stages - stage - 1, micro_batches)
    actions = [(FORWARD, m) for m in range(warmup)]
    for i in range(micro_batches - warmup):
        actions += [(FORWARD, warmup + i), (BACKWARD, i)]
    actions += [(BACKWARD, m) for m in range(micro_batches - warmup, micro_batches)]
    return actions


SCHEDULE_FUNCTIONS = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def peak_live_micro_batches(actions: list[tuple[str, int]]) -> int:
    """Largest number of micro-batches whose activations are held at once under `actions`."""
    live = peak = 0
    for kind, _ in actions:
        live += 1 if kind == FORWARD else -1
        peak = max(peak, live)
    return peak


def simulate_schedule(schedule: str, micro_batches: int, stages: int, forward_time: float = 1.0,
                      backward_time: float = 2.0) -> list[dict]:
    """Timeline of a schedule with fixed per-action times: [{"stage", "kind", "micro_batch", "start", "end"}].

    F(s, m) starts once F(s-1, m) ended; B(s, m) once B(s+1, m) ended (and F(s, m) on the last
    stage); each stage runs its actions in schedule order. The bubble is the idle share.
    """
    if schedule not in SCHEDULE_FUNCTIONS:
        raise ValueError(f"schedule: must be one of {sorted(SCHEDULE_FUNCTIONS)}, got {schedule!r}")
    queues = [list(SCHEDULE_FUNCTIONS[schedule](micro_batches, stages, s)) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * stages
    events = []
    while any(queues):
        progressed = False
        for s, queue in enumerate(queues):
            while queue:
                kind, m = queue[0]
                need = (FORWARD, s - 1, m) if kind == FORWARD else (BACKWARD, s + 1, m)
                if kind == FORWARD and s == 0 or kind == BACKWARD and s == stages - 1:
                    need = (FORWARD, s, m) if kind == BACKWARD else None
                if need is not None and need not in done:
                    break
                start = max(clock[s], done.get(need, 0.0) if need else 0.0)
                end = start + (forward_time if kind == FORWARD else backward_time)
                done[(kind, s, m)] = clock[s] = end
                events.append({"stage": s, "kind": kind, "micro_batch": m, "start": start, "end": end})
                queue.pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule!r} deadlocks")  # cannot happen for the two schedules
    return events


def _check_schedule_args(micro_batches: int, stages: int, stage: int) -> None:
    if micro_batches < 1 or stages < 1 or not 0 <= stage < stages:
        raise ValueError(f"stage: need micro_batches >= 1, stages >= 1 and 0 <= stage < stages, "
                         f"got {micro_batches}, {stages}, {stage}")


# ----------------------------------------------------------------------------- training step
def train_step(sharded, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One forward + backward of the whole batch under the layout's schedule; gradients accumulate.

    input_ids, labels: [B, T] (the global batch; each rank takes its dp rows). The loss is the mean
    token cross-entropy of the global batch, so gradients equal a single-device backward of it.
    Runs pipeline x data parallel layouts; TP, EP and CP here run inference only (their
    collectives are not differentiable). Returns the loss (on every rank).
    """
    pconfig, mesh, comm = sharded.pconfig, sharded.comm.mesh, sharded.comm
    if pconfig.tp > 1 or pconfig.ep > 1 or pconfig.cp > 1:
        raise ValueError(f"layout: train_step supports pipeline x data parallel only, got {pconfig.name()} "
                         "(TP / EP / CP collectives here have no backward)")
    pconfig.validate_batch(input_ids.shape[0], input_ids.shape[1])
    ids, targets = sharded.local_rows(input_ids), sharded.local_rows(labels)
    micro_ids, micro_targets = ids.chunk(pconfig.micro_batches), targets.chunk(pconfig.micro_batches)
    stage, stages = mesh.index("pp"), pconfig.pp
    actions = SCHEDULE_FUNCTIONS[pconfig.schedule](pconfig.micro_batches, stages, stage)
    prev_rank = None if stage == 0 else mesh.peer("pp", stage - 1)
    next_rank = None if stage == stages - 1 else mesh.peer("pp", stage + 1)
    hidden_shape = sharded.activation_shape(micro_ids[0].shape[0], ids.shape[1])  # with AttnRes: the packed stream
    dtype = sharded.dtype
    inputs, outputs, pending = {}, {}, []
    loss_sum = torch.zeros((), dtype=torch.float32, device=mesh.device)
    for kind, m in actions:
        if kind == FORWARD:
            if prev_rank is None:
                x = micro_ids[m]
            else:
                x = comm.recv(hidden_shape, dtype, prev_rank, "pp.act").requires_grad_()
            inputs[m] = x
            out = sharded.run_stage(x)
            if next_rank is None:
                out = F.cross_entropy(out.flatten(0, 1), micro_targets[m].flatten()) / pconfig.micro_batches
                loss_sum += out.detach()
            else:
                pending.append(comm.send(out.detach(), next_rank, "pp.act"))
            outputs[m] = out
        else:
            out = outputs.pop(m)
            if next_rank is None:
                out.backward()
            else:
                out.backward(comm.recv(out.shape, out.dtype, next_rank, "pp.grad"))
            x = inputs.pop(m)
            if prev_rank is not None:
                pending.append(comm.send(x.grad, prev_rank, "pp.grad"))
    for p in pending:
        p.wait()
    comm.broadcast(loss_sum, stages - 1, "pp", "pp.loss")
    if pconfig.dp > 1:
        for param in sharded.parameters():
            if param.grad is not None:
                comm.all_reduce(param.grad, "dp", "dp.grads").div_(pconfig.dp)
        comm.all_reduce(loss_sum, "dp", "dp.loss").div_(pconfig.dp)
    return loss_sum
