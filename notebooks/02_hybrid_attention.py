# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · Hybrid attention: Kimi Delta Attention and Gated DSA
#
# Of the model's 93 layers, 69 mix tokens with **KDA**, a linear attention whose memory is a fixed-size
# matrix, and 24 with **Gated DSA**, softmax attention over the 2048 positions a cheap *lightning indexer*
# picks (docs/design.md §1.3, §1.4). This chapter opens both up on the layers the package builds:
#
# 1. the KDA recurrence step by step on a toy example;
# 2. the chunked form computes the same thing as the recurrence;
# 3. what the forget gates look like;
# 4. state size against KV-cache size as the context grows;
# 5. the lightning indexer, its top-k pattern, and a short warm-up that teaches it dense attention;
# 6. sparse against dense attention cost;
# 7. why 3 KDA layers for every Gated DSA layer, in compute and memory per token from 4k to 1M tokens;
# 8. an explorer over context length and ratio;
# 9. Block Attention Residuals: what each sublayer reads from, over depth, after a short training run.

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("LATENTMOE_SMOKE", "0") == "1"
EQUALITY_TOKENS = 77 if SMOKE else 1000  # section 2: deliberately not a multiple of the chunk
INDEXER_STEPS = 20 if SMOKE else 300  # section 5: warm-up steps on the tiny config
DECODE_PRESET = "tiny" if SMOKE else "small"  # section 6: the layer timed live
DECODE_CONTEXTS = [64, 256] if SMOKE else [1024, 4096, 16384]
DECODE_STEPS = 3 if SMOKE else 20
ATTNRES_STEPS = 4 if SMOKE else 300  # section 9: training steps of the small AttnRes model

# %%
import math
import statistics
import time

import ipywidgets
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.analysis.attention_cost import dsa_cost, gqa_cache_bytes, hybrid_cost, kda_cost, ratio_table
from latentmoe_lab.analysis.depth_mix import attn_res_depth_weights
from latentmoe_lab.cache import DSALayerCache
from latentmoe_lab.layers.dsa import GatedDSA
from latentmoe_lab.layers.kda import KimiDeltaAttention
from latentmoe_lab.meta import format_bytes
from latentmoe_lab.ops.kda import kda_chunked, kda_recurrent
from latentmoe_lab.ops.norms import l2_norm
from latentmoe_lab.ops.sparse_attention import select_topk
from latentmoe_lab.training.corpus import load_corpus, pack
from latentmoe_lab.training.indexer import (indexer_scores_and_target, peaked_layer, synthetic_hidden_states,
                                            topk_recall, train_indexer)
from latentmoe_lab.viz import attention as viz
from latentmoe_lab.viz.notebook import explorer, use_notebook_renderer

use_notebook_renderer()  # figures also render in exported HTML and on GitHub
torch.set_num_threads(1)  # small layers on a small shared CPU: extra threads cost more than they bring
torch.manual_seed(0)
full = ModelConfig.from_preset("k3-2.8t")
print(f"full scale: {full.num_kda_layers} KDA + {full.num_dsa_layers} Gated DSA layers; KDA {full.kda.num_heads} "
      f"heads x {full.kda.head_dim_k}; MLA {full.mla.num_heads} heads, latent {full.mla.kv_lora_rank} + rope "
      f"{full.mla.qk_rope_head_dim}; indexer {full.indexer.num_heads} heads x {full.indexer.head_dim}, "
      f"top-{full.indexer.topk}")

# %% [markdown]
# ## 1. The KDA recurrence, one token at a time
#
# Per head KDA keeps a matrix $S \in \mathbb{R}^{d_k \times d_v}$ (fp32) and for every token does
#
# $$S' = \operatorname{diag}(e^{g_t})\, S_{t-1}, \qquad
#   S_t = S' + \beta_t\, k_t \big(v_t - S'^\top k_t\big)^\top, \qquad o_t = S_t^\top (\text{scale}\cdot q_t)$$
#
# - $e^{g_t}$ is a **per-channel forget gate**: each row of $S$ (one key channel) fades at its own rate.
# - $v_t - S'^\top k_t$ is the **delta rule**: the state first predicts what it holds under key $k_t$ and
#   writes only the error. With $\beta_t = 1$ and a unit key, reading $k_t$ right after returns exactly $v_t$.
#
# A toy head with $d_k = d_v = 4$: the keys are the axis vectors, so every write lands in one row.

# %%
toy_keys = torch.eye(4)[[0, 1, 0, 2, 3, 0]]  # key channel 0 is written three times
toy_values = torch.arange(1.0, 25.0).view(6, 4) / 10
toy_g = torch.full((6, 4), -0.1)
toy_g[3, 0] = -1000.0  # token 3 wipes channel 0 completely
toy_beta = torch.tensor([1.0, 1.0, 0.5, 1.0, 1.0, 1.0])

state, states = torch.zeros(1, 1, 4, 4), []
for t in range(6):
    _, state = kda_recurrent(toy_keys[None, t:t + 1, None], toy_keys[None, t:t + 1, None],
                             toy_values[None, t:t + 1, None], toy_g[None, t:t + 1, None], toy_beta[None, t:t + 1, None],
                             initial_state=state, output_final_state=True)
    states.append(state[0, 0])
    read_back = state[0, 0].T @ toy_keys[t]
    print(f"t={t}: write key e{int(toy_keys[t].argmax())}, beta={toy_beta[t]:.1f}  ->  S^T k = "
          f"{[round(x, 3) for x in read_back.tolist()]}  (v = {[round(x, 3) for x in toy_values[t].tolist()]})")

viz.kda_state_steps_figure(torch.stack(states), labels=[f"token {t}" for t in range(6)])

# %% [markdown]
# What to look at: with $\beta = 1$ the read-back equals $v_t$ exactly (token 0, 1, 3, 4, 5); with
# $\beta = 0.5$ (token 2) it moves only halfway from the old content of row 0 towards the new value. The
# slider shows every row fading by $e^{-0.1}$ per token, and row 0 wiped by the $g = -1000$ of token 3 until
# token 5 writes into it again.
#
# ## 2. The chunked form computes the same thing
#
# Token by token is exact but sequential. `kda_chunked` splits the sequence into chunks of $C = 64$ and
# does all the work inside a chunk with matrix products (the WY / UT transform, docs/design.md §1.3). Only the
# hand-off of $S$ from one chunk to the next is a loop. Inside a chunk the pairwise decays
# $e^{\Gamma_i - \Gamma_j}$ ($\Gamma$ = cumulative $g$) are never formed for all $C \times C$ pairs:
#
# - every decay is a **product** of per-token factors $e^{g_t}$, never $e^{x}$ of a positive $x$: products keep
#   fp32's relative precision however deep the decay, and a $g = -1000$ reset gives an exact 0;
# - a chunk's pairs $(i, j)$ factor through its start: $e^{\Gamma_i - \Gamma_j} = e^{\Gamma_i - \Gamma_0} \cdot e^{\Gamma_0 - \Gamma_j}$,
#   so **one matrix product** scores every pair; the key side grows by up to $1 / e^{\Gamma_C}$, so this is done
#   only where no channel decays by more than $10^{20}$ inside the chunk;
# - a chunk that decays more (a hard reset) is **halved**: pairs across the midpoint $m$ factor through
#   $m$ with both sides $\le 1$, and each half is treated the same way, down to blocks of 8 tokens that take
#   every pair's decay directly; mild gates cost one product per chunk, a reset a few halvings around it;
# - chunks run in groups of about 2k tokens, so memory stays flat however long the sequence.
#
# Below: a ragged length, an initial state, resets in two heads, and every chunk size the tests use.

# %%
gen = torch.Generator().manual_seed(1)
B, T, H, K, V = 2, EQUALITY_TOKENS, 3, 32, 32
q = torch.randn(B, T, H, K, generator=gen)
k = l2_norm(torch.randn(B, T, H, K, generator=gen))
v = torch.randn(B, T, H, V, generator=gen)
g = -0.5 * torch.rand(B, T, H, K, generator=gen)
g[:, T // 3, 0] = -1000.0
g[:, T // 2, 1, :K // 2] = -1000.0
beta = torch.rand(B, T, H, generator=gen)
initial = torch.randn(B, H, K, V, generator=gen)

reference, reference_state = kda_recurrent(q, k, v, g, beta, initial_state=initial, output_final_state=True)
for chunk in (8, 16, 48, 64):
    out, final = kda_chunked(q, k, v, g, beta, initial_state=initial, output_final_state=True, chunk_size=chunk)
    print(f"chunk {chunk:>3}: max |o diff| = {(out - reference).abs().max():.1e}, "
          f"max |S diff| = {(final - reference_state).abs().max():.1e}")
viz.chunked_vs_recurrent_figure(reference, kda_chunked(q, k, v, g, beta, initial_state=initial)[0])

# %% [markdown]
# All differences are at the level of fp32 rounding (~1e-6). On 2 CPU cores, `benchmarks/bench_kda.py`
# measures the chunked form against the recurrence from T = 512 to 16384 (B=1, H=4, d=64); the table with
# the speedups and the distance to the FLOP lower bound $6Td^2 + 3TCd + TC^2$ per head is in
# `benchmarks/RESULTS.md`.
#
# ## 3. The forget gates
#
# The gate is low rank, $x \to 128 \to H d_k$ at full scale, and comes in two forms (docs/design.md §1.3):
#
# - **lower bound**: $g = -5\,\sigma(e^{A}(f(x) + b))$, so $e^{g} \in [e^{-5}, 1]$: no channel forgets
#   faster than a factor 0.0067 per token;
# - **softplus**: $g = -e^{A}\,\mathrm{softplus}(f(x) + b)$, unbounded below.
#
# A randomly initialised layer (tiny config, larger inputs to spread the gates) gives $e^{g}$ per token and
# key channel of head 0:

# %%
tiny = ModelConfig.from_preset("tiny")
x_gate = 3.0 * torch.randn(1, 24, tiny.hidden_size)
decays = {}
for form in ("lower_bound", "softplus"):
    torch.manual_seed(0)
    layer = KimiDeltaAttention(tiny.replace(kda={**tiny.to_dict()["kda"], "gate_form": form}))
    with torch.no_grad():
        decays[form] = layer.forget_gate(x_gate)[0, :, 0].exp()
    print(f"{form:>12}: exp(g) in [{decays[form].min():.4f}, {decays[form].max():.4f}]")
viz.decay_gates_figure(decays)

# %% [markdown]
# Each head starts with its own rate $e^{A} \in [1, 16]$ and the bias spreads the channels, so some rows of
# the state keep their content for hundreds of tokens and others for a handful: the state mixes long and
# short memories.
#
# ## 4. State size against KV-cache size
#
# A KDA layer keeps $H \cdot d_k \cdot d_v$ fp32 numbers (plus a 3-token conv tail), whatever the context.
# A Gated DSA layer keeps per token the MLA latent and rope key (576 bf16 values) and an FP8 index key with a
# scale. For comparison: a plain GQA cache (80 layers, 8 KV heads of 128, 1 byte), docs/design.md §1.6.

# %%
contexts = [2 ** p for p in range(10, 21)]  # 1k .. 1M
per_layer = {
    "KDA state (one layer)": [kda_cost(full, s).state_bytes for s in contexts],
    "Gated DSA cache (one layer)": [dsa_cost(full, s).state_bytes for s in contexts],
    "GQA KV cache (one layer, 8 x 128, 1 byte)": [gqa_cache_bytes(1, 8, 128, s, 1) for s in contexts],
}
print(f"KDA state per layer: {format_bytes(kda_cost(full, 1).state_bytes)}; Gated DSA cache per layer at 1M: "
      f"{format_bytes(dsa_cost(full, 2 ** 20).state_bytes)}; GQA 80 layers at 1M tokens: "
      f"{gqa_cache_bytes(80, 8, 128, 1_000_000, 1) / 1e9:.1f} GB")
crossover = next(s for s in contexts if dsa_cost(full, s).state_bytes > kda_cost(full, s).state_bytes)
print(f"a Gated DSA layer's cache outgrows a KDA state between {crossover // 2:,} and {crossover:,} tokens")
viz.cost_curves_figure(contexts, per_layer, "bytes", "What one layer keeps for a sequence")

# %% [markdown]
# The KDA line is flat: at 1M tokens its 6.5 MB per layer is what it was at 1k. That is the whole point of
# linear attention, and also its limit: a fixed-size state cannot hold every token exactly. The Gated DSA
# layers keep everything (1.3 KB per token per layer) and can look any of it up.
#
# ## 5. The lightning indexer and its top-k
#
# For query $t$ the indexer scores every earlier key with a few cheap ReLU heads,
# $I_{t,s} = \sum_j w_{t,j}\,\mathrm{ReLU}(q^I_{t,j}\cdot k^I_s)$, and attention then runs over the top-k
# positions only. Below, a tiny Gated DSA layer whose attention is made peaky (its query projection scaled
# by 6, a stand-in for a trained model) on inputs with repeated content. The heatmap shows the index scores
# of the causal part, the dots the 32 positions each query keeps.

# %%
layer = peaked_layer(tiny)
x_idx = synthetic_hidden_states(tiny.hidden_size, 1, 96, generator=torch.Generator().manual_seed(2))
with torch.no_grad():
    scores, dense_mass = indexer_scores_and_target(layer, x_idx)
k_top = tiny.indexer.topk
print(f"before training: top-{k_top} recall of the dense attention mass = "
      f"{topk_recall(scores, dense_mass, k_top):.3f}")
viz.topk_pattern_figure(scores[0], select_topk(scores, k_top)[0], title="Index scores and top-k, untrained indexer")

# %% [markdown]
# Recall is the share of the (head-summed, L1-normalised) dense attention mass that lands inside the
# indexer's top-k, over queries that see more than k keys. An untrained indexer keeps about what a random
# pick would. The warm-up minimises $\mathrm{KL}(p_t \,\|\, \mathrm{softmax}(I_t))$ with $p_t$ the dense
# attention mass, on detached inputs, so only the indexer learns (`latentmoe_lab.training.indexer`).

# %%
history = train_indexer(layer, steps=INDEXER_STEPS, seq_len=128, log_every=max(1, INDEXER_STEPS // 10))
with torch.no_grad():
    scores, dense_mass = indexer_scores_and_target(layer, x_idx)
print(f"after {INDEXER_STEPS} steps: recall = {topk_recall(scores, dense_mass, k_top):.3f}")
viz.recall_curve_figure(history.steps, history.recall, history.loss)

# %%
viz.topk_pattern_figure(scores[0], select_topk(scores, k_top)[0], title="Index scores and top-k after the warm-up")

# %% [markdown]
# ## 6. Sparse against dense attention cost
#
# Per generated token, a Gated DSA layer pays the indexer over all $S$ keys ($2 H_I d_I S$ FLOPs: 16K per key
# at full scale) plus attention over at most 2048 of them; dense MLA pays attention over all $S$
# ($2H(2r+p)S$: 209K per key). The sparse layer wins beyond a few thousand tokens, by about 12x per token
# at 1M.

# %%
sparse_flops = [dsa_cost(full, s).flops for s in contexts]
dense_flops = [dsa_cost(full, s, sparse=False).flops for s in contexts]
print("context  sparse/dense FLOPs per token")
for s, sparse, dense in zip(contexts, sparse_flops, dense_flops):
    print(f"{s:>8,}  {sparse / dense:.3f}")
viz.cost_curves_figure(contexts, {"Gated DSA (sparse)": sparse_flops, "dense MLA": dense_flops}, "FLOPs / token",
                       "One full-scale attention layer, one generated token")

# %% [markdown]
# The same comparison measured live: one decode step of a Gated DSA layer after a prefill of $S$ tokens,
# sparse (top-k gather from the cached latent) against the same layer with `dense=True`, alternating step by
# step. `benchmarks/bench_dsa.py` runs this at 4k to 32k with top-2048, prefill memory included.

# %%
decode_config = ModelConfig.from_preset(DECODE_PRESET)
torch.manual_seed(0)
dsa_layer = GatedDSA(decode_config)
timings = {"sparse step (ms)": [], "dense step (ms)": []}
with torch.no_grad():
    for context in DECODE_CONTEXTS:
        sparse_cache = DSALayerCache()
        dsa_layer(torch.randn(1, context, decode_config.hidden_size), cache=sparse_cache)
        dense_cache = DSALayerCache(sparse_cache.latent.clone(), sparse_cache.k_rope.clone(),
                                    sparse_cache.index_keys.clone())
        steps = {"sparse step (ms)": [], "dense step (ms)": []}
        for _ in range(DECODE_STEPS):
            token = torch.randn(1, 1, decode_config.hidden_size)
            for name, cache, dense in (("sparse step (ms)", sparse_cache, False),
                                       ("dense step (ms)", dense_cache, True)):
                start = time.perf_counter()
                dsa_layer(token, cache=cache, dense=dense)
                steps[name].append(1e3 * (time.perf_counter() - start))
        for name in timings:
            timings[name].append(statistics.median(steps[name]))
        print(f"S = {context:>6}: sparse {timings['sparse step (ms)'][-1]:.2f} ms, "
              f"dense {timings['dense step (ms)'][-1]:.2f} ms (top-{decode_config.indexer.topk})")
viz.cost_curves_figure(DECODE_CONTEXTS, timings, "ms per step", f"Decode step, {DECODE_PRESET} layer (measured here)")

# %% [markdown]
# On a CPU the crossover sits later than the FLOP count suggests: the sparse path gathers k rows per query
# and runs small matrix products, where dense attention streams the cache through one large product. The
# small layers here also have few heads, while the indexer costs the same per key whatever the head count.
#
# ## 7. Why 3 : 1
#
# Put the pieces together for the full-scale model: 93 token mixers, Gated DSA at every $(r+1)$-th layer and
# the last, KDA elsewhere, for one generated token at context $S$ (MoE cost is the same in every variant and
# left out). Dashed: every layer dense MLA.

# %%
ratios = [0, 1, 3, 7, math.inf]
long_contexts = [2 ** p for p in range(12, 21)]  # 4k .. 1M
rows = ratio_table(full, long_contexts, ratios)
viz.hybrid_ratio_figure(rows)

# %%
print(f"{'context':>9} {'ratio':>8} {'DSA layers':>10} {'GFLOP/token':>12} {'cache GB':>9} {'vs dense FLOPs':>15}")
for row in rows:
    if row["context"] in (4096, 131072, 2 ** 20):
        name = "all KDA" if row["kda_per_dsa"] == math.inf else f"{row['kda_per_dsa']}:1"
        print(f"{row['context']:>9,} {name:>8} {row['dsa_layers']:>10} {row['flops'] / 1e9:>12.1f} "
              f"{row['state_bytes'] / 1e9:>9.2f} {row['flops'] / row['dense_flops']:>14.3f}x")

# %% [markdown]
# What the numbers say:
#
# - **At 4k every variant costs about the same**: projections dominate and a DSA layer's cache is small.
# - **At 1M the DSA layers are the whole bill**: each costs its indexer pass over a million keys, and its
#   cache. Going from 1:1 to 3:1 nearly halves both (47 to 24 DSA layers); 3:1 to 7:1 nearly halves them again.
# - **All KDA is the cheapest by far, and flat**, but then no layer can retrieve an exact token from far back:
#   the model only has 69 fixed-size states.
#
# Compute and memory alone would push the ratio up without end; the reason to stop is model quality, which
# this notebook cannot measure. Public reports on Kimi Linear chose 3:1 after comparing ratios on quality
# and throughput. At 3:1 the full model's token mixers keep 33 GB for a 1M-token sequence (every layer dense
# MLA: 112 GB) and spend 2.4% of the dense FLOPs per generated token.
#
# ## 8. Explorer: context length and ratio

# %%
def explore(context_log2: int = 20, kda_per_dsa: str = "3"):
    ratio = math.inf if kda_per_dsa == "all KDA" else int(kda_per_dsa)
    return viz.hybrid_breakdown_figure(hybrid_cost(full, 2 ** context_log2, ratio))


explorer(explore, context_log2=ipywidgets.IntSlider(value=20, min=12, max=20, description="log2 S"),
         kda_per_dsa=ipywidgets.Dropdown(options=["0", "1", "2", "3", "5", "7", "15", "all KDA"], value="3",
                                         description="KDA : DSA"))

# %% [markdown]
# ## 9. Block Attention Residuals: reading over depth
#
# The published K3 replaces the residual sum (docs/design.md §18, arXiv 2603.15031). Layers are grouped in
# blocks of N (12 in K3); inside a block the sublayer outputs add up into a *partial sum*, and before the
# attention and before the MLP of every layer the input is a softmax mix over the **candidates**: the
# embedding, every finished block, and the current partial sum,
# $h = \sum_i \operatorname{softmax}_i(q \cdot \operatorname{RMSNorm}(v_i))\, v_i$, with one learned
# query $q$ per sublayer (zero at the start: a plain mean). One more mix feeds the final norm. Every
# candidate is a vector of the token itself, so the mix never looks at other positions: decode, chunked
# prefill and the serving engine need nothing new in their caches.
#
# Below, an 8-layer version of the tiny preset with blocks of 2 layers trains for a few minutes on the
# standard library's source bytes; the heatmap shows, for each sublayer, the mean weight it puts on each
# candidate over held-out tokens.

# %%
attn_res_config = ModelConfig.from_preset("tiny").replace(num_layers=8, layer_types=None, attn_res_block_size=2,
                                                          vision=None, name="tiny-attnres")
torch.manual_seed(0)
attn_res_model = LatentMoEForCausalLM(attn_res_config)
corpus = load_corpus(verbose=False)
train_rows, held_rows = pack(corpus.train, 65).long(), pack(corpus.held_out, 65).long()
optimizer = torch.optim.AdamW(attn_res_model.parameters(), lr=3e-3)
started = time.perf_counter()
for step in range(ATTNRES_STEPS):
    rows = train_rows[torch.randint(0, len(train_rows), (8,), generator=torch.Generator().manual_seed(step))]
    out = attn_res_model(rows[:, :-1], labels=rows[:, :-1])
    optimizer.zero_grad(set_to_none=True)
    (out.loss + out.aux_loss).backward()
    optimizer.step()
    for block in attn_res_model.layers:
        if block.is_moe:
            block.ffn.update_bias(block.ffn.last_expert_counts)
attn_res_model.eval()
with torch.no_grad():
    held_loss = attn_res_model(held_rows[:16, :-1], labels=held_rows[:16, :-1]).loss
print(f"{ATTNRES_STEPS} steps in {time.perf_counter() - started:.0f} s; held-out loss {float(held_loss):.3f} "
      f"nats/byte ({float(held_loss) / math.log(2):.3f} bits/byte)")
depth = attn_res_depth_weights(attn_res_model, held_rows[:16, :-1])
viz.depth_weights_figure(depth.weights, depth.sublayers, depth.sources)

# %% [markdown]
# How to read it: row "layer j attention" is the input of layer j's attention, a distribution over the
# candidates that exist at that depth (blank cells do not exist yet; right after a block boundary the
# partial sum is empty, so it is no candidate). An untrained model puts equal weight on each candidate;
# after training the rows differ from sublayer to sublayer, which is the point of a learned, per-sublayer
# query: a sublayer can skip the plain running sum and read an earlier block, or the embedding, directly.
# What the pattern looks like depends on the run: a few minutes on one CPU thread is a sketch, not K3.
