"""The byte model: what each rank's collectives move in one prefill forward, tag by tag.

It mirrors the runtime's messages (comm.py counting convention) from shapes alone, except for
the expert All-to-All, whose rows depend on routing: give `routing` ({MoE layer: indices
[B*T, K]} of the same batch) for an exact count, or leave it None for the expectation under
uniform routing, where a token hits a given other rank with probability
    p = 1 - C(E - E/R, K) / C(E, K)          (none of its K experts among that rank's E/R)

Tags: tp.attn / tp.dense / tp.moe_routed / tp.moe_shared (TP sums), sp.gather (sequence-parallel
all-gathers), ep.counts / ep.tokens / ep.meta / ep.combine (expert All-to-All), cp.kda_conv /
cp.kda_state (KDA hand-off), cp.dsa_latent / cp.dsa_rope / cp.dsa_index (DSA gathers), pp.act.
"""
from __future__ import annotations

from collections import Counter
from math import comb

import torch

from latentmoe_lab.config import KDA, ModelConfig
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.mesh import coords_rank, data_shard, rank_coords
from latentmoe_lab.parallel.pipeline import activation_width, partition_layers

META_BYTES_PER_SLOT = 8  # int32 local expert id + fp32 routing weight, per top-k slot of a sent row
COUNT_BYTES = 8  # one int64 row count per destination


def hit_probability(num_experts: int, top_k: int, ep: int) -> float:
    """P(a token has at least one of its top_k experts on a given one of ep equal expert shards)."""
    per_rank = num_experts // ep
    return 1.0 - comb(num_experts - per_rank, top_k) / comb(num_experts, top_k)


def a2a_rows(routing: torch.Tensor, pconfig: ParallelConfig, config: ModelConfig, batch: int, seq_len: int,
             rank: int) -> tuple[int, int]:
    """(rows `rank` sends to other ep members, rows it receives from them) for one MoE layer.

    routing: [batch*seq_len, K] expert ids of the global batch, tokens in (b t) order.
    """
    ep, per_rank = pconfig.ep, config.moe.num_experts // pconfig.ep
    coords = rank_coords(pconfig, rank)
    rows_per_shard, local_len = batch // pconfig.data_shards, seq_len // pconfig.cp
    by_token = routing.reshape(batch, seq_len, -1)

    def hits(member: int) -> torch.Tensor:
        """[tokens, ep] bool: which ep members the tokens of ep member `member` are sent to."""
        shard = data_shard(pconfig, coords_rank(pconfig, {**coords, "ep": member}))
        tokens = by_token[shard * rows_per_shard:(shard + 1) * rows_per_shard,
                          coords["cp"] * local_len:(coords["cp"] + 1) * local_len].reshape(-1, by_token.shape[-1])
        mask = torch.zeros(tokens.shape[0], ep, dtype=torch.bool)
        return mask.scatter_(1, tokens // per_rank, True)

    me = coords["ep"]
    mine = hits(me)
    rows_out = int(mine.sum()) - int(mine[:, me].sum())
    rows_in = sum(int(hits(j)[:, me].sum()) for j in range(ep) if j != me)
    return rows_out, rows_in


def forward_traffic(config: ModelConfig, pconfig: ParallelConfig, batch: int, seq_len: int,
                    routing: dict[int, torch.Tensor] | None = None, act_bytes: int = 2,
                    stages: list[range] | None = None) -> list[Counter]:
    """Per rank: Counter {tag: bytes} of one no-cache prefill forward of [batch, seq_len] tokens.

    Exact (ints) with `routing`; the expert All-to-All rows are expectations (floats) without.
    act_bytes: bytes per activation element (4 for fp32 runs, 2 for bf16). stages: the pipeline
    split (default `partition_layers(config, pp)`).
    """
    pconfig.validate_for(config)
    pconfig.validate_batch(batch, seq_len)
    ep, tp, cp, micro = pconfig.ep, pconfig.tp, pconfig.cp, pconfig.micro_batches
    d, latent, top_k = config.hidden_size, config.moe.latent_size, config.moe.top_k
    rows_mb = batch // pconfig.data_shards // micro
    local_len = seq_len // cp
    sequence_parallel = pconfig.sequence_parallel and tp > 1 and local_len % tp == 0
    stages = stages or partition_layers(config, pconfig.pp)
    kda, mla = config.kda, config.mla
    conv_bytes = (2 * kda.head_dim_k + kda.head_dim_v) * kda.num_heads // tp * (kda.conv_kernel - 1) * act_bytes
    state_bytes = kda.num_heads // tp * kda.head_dim_k * kda.head_dim_v * max(4, act_bytes)  # fp32, fp64 in fp64 runs
    tokens_mb = rows_mb * local_len
    shard_bytes = tokens_mb // tp * d * act_bytes  # one sequence-parallel shard of the residual stream
    full_bytes = tokens_mb * d * act_bytes

    def tp_region(counter: Counter, tag: str) -> None:
        if sequence_parallel:  # all-gather the input, reduce-scatter (as all_to_all) the output
            counter["sp.gather"] += micro * (tp - 1) * shard_bytes
            counter[tag] += micro * (tp - 1) * shard_bytes
        else:
            counter[tag] += micro * full_bytes

    per_rank = []
    for rank in range(pconfig.world_size):
        coords, counter = rank_coords(pconfig, rank), Counter()
        stage = stages[coords["pp"]]
        for i in stage:
            if tp > 1:
                tp_region(counter, "tp.attn")
            if cp > 1 and config.layer_types[i] == KDA:
                if coords["cp"] < cp - 1:
                    counter["cp.kda_conv"] += micro * rows_mb * conv_bytes
                    counter["cp.kda_state"] += micro * rows_mb * state_bytes
            elif cp > 1:
                for name, width in (("latent", mla.kv_lora_rank), ("rope", mla.qk_rope_head_dim),
                                    ("index", config.indexer.head_dim)):
                    counter[f"cp.dsa_{name}"] += micro * (cp - 1) * tokens_mb * width * act_bytes
            if not config.is_moe_layer(i):
                if tp > 1:
                    tp_region(counter, "tp.dense")
                continue
            if ep == 1 and tp == 1:
                continue
            if sequence_parallel:
                counter["sp.gather"] += micro * (tp - 1) * shard_bytes
            if ep > 1:
                if routing is None:
                    rows_out = rows_in = micro * tokens_mb * (ep - 1) * hit_probability(
                        config.moe.num_experts, top_k, ep)
                else:
                    rows_out, rows_in = a2a_rows(routing[i], pconfig, config, batch, seq_len, rank)
                counter["ep.counts"] += micro * (ep - 1) * COUNT_BYTES
                counter["ep.tokens"] += rows_out * latent * act_bytes
                counter["ep.meta"] += rows_out * top_k * META_BYTES_PER_SLOT
                counter["ep.combine"] += rows_in * latent * act_bytes
            if tp > 1:
                counter["tp.moe_routed"] += micro * tokens_mb * latent * 4  # fp32 expert sum
                if config.moe.num_shared_experts:
                    counter["tp.moe_shared"] += micro * full_bytes
        if coords["pp"] < pconfig.pp - 1:
            # with Block AttnRes the stage sends its whole stream: blocks + partial sum, not one vector
            counter["pp.act"] += micro * (shard_bytes if sequence_parallel else full_bytes) * activation_width(
                config, stage.stop)
        elif sequence_parallel:
            counter["sp.gather"] += micro * (tp - 1) * shard_bytes
        per_rank.append(Counter({tag: n for tag, n in counter.items() if n}))
    return per_rank


def moe_a2a_bytes(config: ModelConfig, ep: int, tokens: float, act_bytes: float = 2.0) -> dict[str, float]:
    """Expected bytes one rank sends per MoE layer (dispatch + combine) for `tokens` local tokens.

    Four designs: per (token, expert) pair or grouped per (token, rank); hidden width d or latent l.
    "grouped_latent" is what AllToAllDispatcher sends (plus its small count and meta messages).
    """
    if ep == 1:
        return dict.fromkeys(("pairs_hidden", "grouped_hidden", "pairs_latent", "grouped_latent"), 0.0)
    moe = config.moe
    pairs_out = tokens * moe.top_k * (ep - 1) / ep  # pairs whose expert lives on another rank
    rows_out = tokens * (ep - 1) * hit_probability(moe.num_experts, moe.top_k, ep)
    both_ways = 2 * act_bytes
    return {"pairs_hidden": pairs_out * config.hidden_size * both_ways,
            "grouped_hidden": rows_out * config.hidden_size * both_ways,
            "pairs_latent": pairs_out * moe.latent_size * both_ways,
            "grouped_latent": rows_out * moe.latent_size * both_ways}
