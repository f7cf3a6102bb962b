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
# # 01 · Routing and Stable LatentMoE
#
# A trillion-parameter MoE succeeds or fails at its router. **Load balance** decides whether devices idle
# while one of them works through a hot expert; the **latent size** decides how many bytes every token sends
# across the network. This chapter measures both on the layer the package builds (docs/design.md §1.2):
#
# 1. the router math on a toy batch: sigmoid scores, a bias that picks but never weighs, routed scaling;
# 2. top-k with group limits;
# 3. load heatmaps per layer and expert;
# 4. six imbalance workloads and what they cost;
# 5. a real training run: bias update vs auxiliary loss vs nothing, and K3's quantile rule vs the sign rule;
# 6. the latent trade-off alpha = d / l, with a slider;
# 7. what 896 experts with top-16 put on each device under expert parallelism.

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("LATENTMOE_SMOKE", "0") == "1"
HEATMAP_PRESET = "tiny" if SMOKE else "small"  # the random model of section 3
HEATMAP_TOKENS = 64 if SMOKE else 1024      # tokens it reads
WORKLOAD_TOKENS = 512 if SMOKE else 4096    # tokens per imbalance workload (section 4)
BALANCE_STEPS = 12 if SMOKE else 300        # training steps per balancing mode (section 5)
BALANCE_BATCH, BALANCE_SEQ = (4, 16) if SMOKE else (8, 64)

# %%
import ipywidgets
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.analysis import expert_parallel_ranks, iso_communication, latent_tradeoff, measure_workloads
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.meta import format_bytes, format_count
from latentmoe_lab.ops.balancing import bias_update, expert_counts, load_stats, quantile_bias
from latentmoe_lab.ops.routing import route_topk
from latentmoe_lab.training.balance import balance_config, compare_balancing, train_balancing
from latentmoe_lab.viz import expert_load_figure
from latentmoe_lab.viz import routing as viz
from latentmoe_lab.routing_workloads import WORKLOADS, make_workload
from latentmoe_lab.viz.notebook import explorer, use_notebook_renderer

use_notebook_renderer()  # figures also render in exported HTML and on GitHub
# The models here are small: on a small shared CPU, extra threads cost more than they bring.
torch.set_num_threads(1)
torch.manual_seed(0)
full = ModelConfig.from_preset("k3-2.8t")
print(f"full scale: {full.moe.num_experts} routed experts, top-{full.moe.top_k}, hidden {full.hidden_size}, "
      f"latent {full.moe.latent_size}, expert intermediate {full.moe.expert_intermediate_size}")

# %% [markdown]
# ## 1. Router math on a toy batch
#
# For a token $x$ the router computes one fp32 score per expert and keeps K of them:
#
# $$s = \sigma(W_r x), \qquad I = \operatorname{TopK}(s + b,\ K), \qquad
#   w_i = \frac{s_i}{\sum_{j \in I} s_j}\cdot \text{routed\_scaling}\quad (i \in I)$$
#
# Three things to notice:
# - **sigmoid, not softmax**: each score is independent of the others, so adding experts does not
#   shrink every score;
# - the **correction bias $b$** enters the *selection* only. It is the balancing knob of section 5, and
#   because it never touches $w$ it never touches a gradient;
# - after renormalisation the weights of a token **sum to the routed scaling** (1.0 at full scale).

# %%
logits = torch.randn(6, 8)  # 6 tokens, 8 experts
weights, indices = route_topk(logits, top_k=2)
scores = torch.sigmoid(logits)
for n in range(6):
    picks = ", ".join(f"e{e} (s={scores[n, e]:.2f}, w={w:.2f})" for e, w in zip(indices[n].tolist(), weights[n]))
    print(f"token {n}: {picks}   sum w = {weights[n].sum():.2f}")
viz.router_scores_figure(scores, indices)

# %% [markdown]
# A bias of +0.5 on expert 5 pulls it into more top-2 sets, but the weights stay ratios of the raw scores:
# the bias decides *who*, never *how much*. A routed scaling of 2.5 multiplies every weight.

# %%
bias = torch.zeros(8)
bias[5] = 0.5
biased_w, biased_i = route_topk(logits, top_k=2, bias=bias, scaling=2.5)
print("tokens on expert 5 without / with the bias:", int((indices == 5).sum()), "/", int((biased_i == 5).sum()))
raw = scores.gather(-1, biased_i)
print("weights == 2.5 * s / sum(s) over the picks:", torch.allclose(biased_w, 2.5 * raw / raw.sum(-1, keepdim=True)))
print("sum of weights per token:", [round(float(v), 3) for v in biased_w.sum(-1)])

# %% [markdown]
# ## 2. Top-k with group limits
#
# With `n_group > 1` (DeepSeek-V3 style) the experts form contiguous groups, e.g. one per node. A group
# scores the **sum of its two best biased scores**; only the `topk_group` best groups stay eligible and the
# others are filled with $-\infty$ before the top-k. This caps how many nodes one token talks to.
#
# Why $-\infty$ and not 0: biased scores can be negative (a strongly negative bias on an overloaded expert).
# Masking with 0 would make a dropped group *beat* a kept one. Below every bias is -2, so every biased score
# is negative, and still only the kept groups are picked.

# %%
n_group, topk_group, top_k = 4, 2, 4
token_logits = torch.randn(1, 16)
neg_bias = torch.full((16,), -2.0)
_, picked = route_topk(token_logits, top_k, bias=neg_bias, n_group=n_group, topk_group=topk_group)
choice = torch.sigmoid(token_logits[0]) + neg_bias
group_scores = choice.view(n_group, -1).topk(2, dim=-1).values.sum(-1)
kept = group_scores.topk(topk_group).indices
print("group scores:", [round(float(v), 2) for v in group_scores], "-> kept groups", sorted(kept.tolist()))
print("picked experts:", picked[0].tolist(), "-> their groups", sorted(set((picked[0] // 4).tolist())))
viz.group_limit_figure(choice, n_group, kept.tolist(), picked[0].tolist())

# %% [markdown]
# ## 3. Load heatmaps per layer and expert
#
# Every `LatentMoE` layer keeps `last_expert_counts` (tokens per expert) after a forward. Here a randomly
# initialised **small** preset (32 experts, top-4, 7 MoE layers; the tiny one in smoke mode) reads random
# tokens. `load_stats` turns
# one layer's counts into the numbers a serving engineer watches:
# - **max / mean** load: under expert parallelism the busiest rank sets the pace;
# - the **dropped fraction** a capacity factor of 1.25 would cause (rows beyond
#   `ceil(1.25 * N * K / E)` per expert);
# - the **load entropy**, 1.0 for a perfectly even spread.

# %%
heatmap_config = ModelConfig.from_preset(HEATMAP_PRESET)
random_model = LatentMoEForCausalLM(heatmap_config).eval()
with torch.no_grad():
    random_model(torch.randint(0, heatmap_config.vocab_size, (1, HEATMAP_TOKENS)))
moe_layers = {f"layer {i}": block.ffn for i, block in enumerate(random_model.layers)
              if isinstance(block.ffn, LatentMoE)}
for label, layer in moe_layers.items():
    s = load_stats(layer.last_expert_counts, capacity_factor=1.25)
    print(f"{label}: max/mean {s.max_over_mean:.2f}, dropped at cf 1.25 {s.dropped_fraction:.1%}, "
          f"load entropy {s.load_entropy:.3f}")
expert_load_figure([layer.last_expert_counts.tolist() for layer in moe_layers.values()], list(moe_layers),
                   title=f"Tokens per expert, random {HEATMAP_PRESET} model, {HEATMAP_TOKENS} tokens")

# %% [markdown]
# Random weights already route unevenly: the router sees a few directions of the hidden state more
# often than others. Training makes this worse (section 5) unless something pushes back.
#
# ## 4. Imbalance workloads
#
# `latentmoe_lab.routing_workloads` builds router logits that make `route_topk` pick exactly a designed expert set
# per token (the tests check it token by token). At E = 64, top-8:
#
# | workload | what it models |
# |---|---|
# | uniform | the ideal: every expert gets N K / E |
# | one_hot_expert | one expert in every token's top-k (a collapsed router) |
# | hot_group | half of each top-k inside one group of 8 (one hot node) |
# | dead_expert | one expert never chosen (wasted parameters) |
# | same_topk | every token to the same 8 experts (56 idle) |
# | rotating_hotspot | the hot expert moves over 4 phases of the batch (a topic shift) |
#
# For each we measure the load, max/mean, the dropped fraction at capacity factor 1.25, and the time of
# the layer's expert step (`LatentExperts` with a grouped matmul, latent 256, intermediate 256).

# %%
workloads = [make_workload(name, WORKLOAD_TOKENS, 64, 8) for name in WORKLOADS]
measured = measure_workloads(workloads, latent_size=256, intermediate_size=256, repeats=3)
print(f"{'workload':<18}{'max/mean':>9}{'min/mean':>9}{'dropped':>9}{'entropy':>9}{'expert ms':>11}{'padded/rows':>13}")
for m in measured:
    print(f"{m.name:<18}{m.stats.max_over_mean:>9.2f}{m.stats.min_over_mean:>9.2f}{m.stats.dropped_fraction:>9.1%}"
          f"{m.stats.load_entropy:>9.3f}{m.expert_seconds * 1e3:>11.1f}{m.padded_rows / m.rows:>13.2f}")
rotating = next(m for m in measured if m.name == "rotating_hotspot")
print("rotating hotspot, max/mean per phase:", [round(v, 2) for v in rotating.phase_max_over_mean],
      f"vs {rotating.stats.max_over_mean:.2f} over the whole batch")
viz.workload_load_figure({m.name: m.stats.counts.tolist() for m in measured})

# %%
viz.workload_summary_figure([m.name for m in measured], [m.stats.max_over_mean for m in measured],
                            [m.expert_seconds * 1e3 for m in measured], [m.padded_rows / m.rows for m in measured])

# %% [markdown]
# What to read off:
# - On one device the grouped matmul does the same FLOPs whatever the load, so the expert time stays
#   near the uniform one while max/mean goes up to 8 (the rest is noise from a shared machine).
# - The cost of imbalance shows up **elsewhere**: under expert parallelism the step waits for the busiest
#   rank (max/mean, up to E/K = 8 here); a padded batched matmul or a fixed capacity buffer computes
#   E x max rows (padded/rows); and a capacity factor drops tokens outright.
# - The rotating hotspot looks mild over the whole batch but is as hot as `one_hot_expert` inside each
#   phase: a balancer that reacts once per step has to chase it.
#
# ## 5. Balancing: bias update vs auxiliary loss vs nothing
#
# Two ways to push back against collapse (docs/design.md §1.2):
#
# - **auxiliary-loss-free bias update**, after every step: $b_i \leftarrow b_i + u\,\operatorname{sign}(\bar c - c_i)$.
#   It changes which experts are picked, never the loss, so the language-model gradient is untouched;
# - **sequence-wise auxiliary loss** $L = \alpha \sum_i f_i P_i$ with $f_i = \frac{E}{K T}\,\#\{t: i \in I_t\}$
#   and $P_i$ the mean normalised score. It balances through the gradient, which also pulls the router away
#   from what the language loss wants.
#
# The run trains the **tiny** preset (8 experts, top-2, group limits off so that nothing caps the
# imbalance) on synthetic, Zipf-skewed tokens, three times from the same weights on the same batches.
# The bias rate is raised from the full-scale 1e-3 to 1e-2: this run has a few hundred steps, not hundreds
# of thousands, and the bias must be able to cross the score gaps a collapsed router builds.

# %%
balance = balance_config("tiny", aux_loss_alpha=0.01, bias_update_rate=1e-2)
runs = compare_balancing(config=balance, steps=BALANCE_STEPS, batch=BALANCE_BATCH, seq_len=BALANCE_SEQ,
                         tail=max(BALANCE_STEPS // 10, 1))
window = max(BALANCE_STEPS // 10, 1)
for mode, run in runs.items():
    curve = run.mean_max_over_mean
    print(f"{mode:>5}: max/mean first {window} steps {curve[:window].mean():.2f}, last {window} steps "
          f"{curve[-window:].mean():.2f}; loss {run.loss[:window].mean():.2f} -> {run.loss[-window:].mean():.2f}")
viz.balancing_figure({mode: run.mean_max_over_mean.tolist() for mode, run in runs.items()},
                     {mode: run.loss.tolist() for mode, run in runs.items()})

# %%
mode = "none"
expert_load_figure(runs[mode].final_counts.tolist(), runs[mode].layer_labels,
                   title=f"Tokens per expert over the last steps, mode '{mode}'")

# %%
mode = "bias"
expert_load_figure(runs[mode].final_counts.tolist(), runs[mode].layer_labels,
                   title=f"Tokens per expert over the last steps, mode '{mode}'")

# %% [markdown]
# Without balancing the routers collapse within a few dozen steps: max/mean approaches E/K = 4, nearly
# every token goes to the same two experts of a layer. The bias update walks it back towards 1 without adding a loss term; the
# auxiliary loss balances too, through the router's gradient. At full scale the bias method is preferred
# because its balancing pressure does not compete with the language loss; on this toy task the losses
# of the three runs stay close.
#
# ## 5b. K3's quantile rule against the sign rule
#
# The published K3 moves the bias differently (docs/design.md §18). After a step, each expert's bias is
# set, not nudged: to minus the $(1 - K/E)$-quantile of that expert's sigmoid scores over the batch, then
# all biases are mean-centred:
# $b_i \leftarrow \overline{Q} - Q_{1-K/E}(s_{:,i})$. An expert's biased score then clears one common
# threshold on exactly its balanced share $K/E$ of the tokens. The sign rule moves every bias by the same
# $u$ per step, however far off the load is; the quantile rule jumps to the balancing value at once.
#
# First on the six imbalance workloads: one update from the batch's own scores, then route the same
# batch again (`ops.balancing.quantile_bias`; `bias_update` for the sign step at the full-scale rate).

# %%
rule_loads = {"no bias": [], "one sign step (u = 1e-3)": [], "one quantile update": []}
for workload in workloads:
    k = workload.expected.shape[1]
    _, chosen = route_topk(workload.logits, k)
    counts = expert_counts(chosen, workload.num_experts)
    biases = {"no bias": None,
              "one sign step (u = 1e-3)": bias_update(torch.zeros(workload.num_experts), counts, 1e-3),
              "one quantile update": quantile_bias(torch.sigmoid(workload.logits), k)}
    for rule, bias in biases.items():
        _, rerouted = route_topk(workload.logits, k, bias=bias)
        rule_loads[rule].append(load_stats(expert_counts(rerouted, workload.num_experts)).max_over_mean)
for rule, values in rule_loads.items():
    print(f"{rule:<26}", "  ".join(f"{name} {v:.2f}" for name, v in zip(WORKLOADS, values)))
viz.bias_rule_figure(list(WORKLOADS), rule_loads)

# %% [markdown]
# Then in training, from the same weights on the same batches as section 5: mode "bias" with the sign
# rule (the run above) and with the quantile rule (`moe.bias_update: quantile`).

# %%
quantile_config = balance_config("tiny", aux_loss_alpha=0.01, bias_update_rate=1e-2, bias_update="quantile")
quantile_run = train_balancing("bias", config=quantile_config, steps=BALANCE_STEPS, batch=BALANCE_BATCH,
                               seq_len=BALANCE_SEQ, tail=max(BALANCE_STEPS // 10, 1))
rule_runs = {"none": runs["none"], "bias, sign rule": runs["bias"], "bias, quantile rule": quantile_run}
for rule, run in rule_runs.items():
    curve = run.mean_max_over_mean
    print(f"{rule:>20}: max/mean last {window} steps {curve[-window:].mean():.2f}, "
          f"loss last {window} steps {run.loss[-window:].mean():.2f}")
viz.balancing_figure({rule: run.mean_max_over_mean.tolist() for rule, run in rule_runs.items()},
                     {rule: run.loss.tolist() for rule, run in rule_runs.items()},
                     title="Sign rule vs quantile rule (mean over MoE layers)")

# %% [markdown]
# On the workloads one quantile update brings every one of them close to max/mean 1, where one sign step
# moves nothing (a step of u cannot cross a score gap of ~0.7). In training the quantile rule needs no
# rate and pulls the load down in fewer steps than the sign rule, which needs about gap / u steps. Its
# bias follows the batch, so a small batch makes it noisy: each update is a quantile estimated from the
# batch's N = 512 tokens here, and late in this run it can hover a little above the sign rule. At scale
# the batch holds millions of tokens. Under data parallelism each rank computes its quantiles and the
# biases are averaged (training/lm.py), which keeps one bias on every rank.

# %% [markdown]
# ## 6. Latent trade-off: alpha = d / l
#
# The token travels to its experts in the latent size $l$, not the hidden size $d$. With
# $\alpha = d / l$ the expert weights and the all-to-all payload both shrink by $\alpha$. Stable LatentMoE
# spends that budget on **alpha-times more experts and alpha-times larger top-k** at the same communication:

# %%
rule = iso_communication(full)
print(f"iso-communication: top-{rule['latent_top_k']} x latent {rule['latent_size']} = {rule['latent_product']}"
      f"  ==  top-{rule['base_top_k']} x hidden {rule['hidden_size']} = {rule['base_product']}")
iso = latent_tradeoff(full, alphas=(1, 2, 4, 8), weight_format="fp8", payload_bits=16)
fixed = latent_tradeoff(full, alphas=(1, 2, 4, 8), iso_communication=False, weight_format="fp8", payload_bits=16)
for title, points in (("iso-communication (E and K grow with alpha)", iso), ("fixed E=896, K=16", fixed)):
    print(f"\n{title}")
    print(f"{'alpha':>5}{'latent':>8}{'E':>6}{'K':>4}{'bytes/expert':>14}{'layer experts':>15}{'payload/token':>15}"
          f"{'expert FLOPs/token':>20}")
    for p in points:
        print(f"{p.alpha:>5}{p.latent_size:>8}{p.num_experts:>6}{p.top_k:>4}{format_bytes(p.expert_bytes):>14}"
              f"{format_bytes(p.routed_expert_bytes):>15}{format_bytes(p.payload_bytes_per_token):>15}"
              f"{format_count(p.expert_flops_per_token):>20}")

# %% [markdown]
# Read the iso-communication table: payload, FLOPs and total expert bytes per layer stay where they are,
# while each expert gets alpha-times smaller and there are alpha-times more of them to choose from (more
# combinations per token). What alpha buys is quality per byte; what it costs is a W_down / W_up pair
# ($4 d l$ FLOPs per token) and smaller, less efficient expert matmuls. In JupyterLab, move the slider above
# the figure (an exported page shows the full model's alpha = 2). Bars are relative to alpha = 1; the log
# axis makes "unchanged" a bar of height 1.

# %%
def explore_alpha(alpha=2, same_communication=True):
    points = iso if same_communication else fixed
    label = "iso-communication" if same_communication else "fixed E, K"
    return viz.latent_tradeoff_figure(points, selected_alpha=alpha, title=f"alpha = {alpha} ({label})")

# %%
explorer(explore_alpha, alpha=ipywidgets.SelectionSlider(options=[1, 2, 4, 8], description="alpha",
                                                         value=full.hidden_size // full.moe.latent_size),
         same_communication=ipywidgets.Checkbox(value=True, description="same communication"))

# %% [markdown]
# ## 7. 896 experts, top-16, under expert parallelism
#
# Expert parallelism (EP) places E / EP experts on each rank. Each rank routes its own tokens and sends
# every (token, expert) pair to the rank that holds the expert, in the latent size. Per MoE layer, with
# 4096 tokens per rank, bf16 payload, fp8 expert weights and uniform routing:
# - each rank's experts process T x K = 65,536 rows whatever EP is; more ranks means fewer, busier experts;
# - a token's 16 experts land on fewer distinct ranks than 16 when EP is small (they collide), so a
#   dispatch that sends a token **once per rank** instead of once per expert saves bytes at EP = 8;
# - the weights per rank shrink with EP, which is the point of EP.

# %%
ranks = expert_parallel_ranks(full, ep_sizes=(8, 64, 128), tokens_per_rank=4096, weight_format="fp8",
                              payload_bits=16)
print(f"{'EP':>4}{'experts/rank':>14}{'rows/rank':>11}{'rows/expert':>13}{'ranks/token':>13}"
      f"{'send/expert copy':>18}{'send/rank copy':>16}{'weights/rank':>14}")
for r in ranks:
    print(f"{r.ep:>4}{r.experts_per_rank:>14}{r.rows_per_rank:>11,}{r.rows_per_expert:>13,.0f}{r.ranks_per_token:>13.2f}"
          f"{format_bytes(r.send_bytes_per_copy):>18}{format_bytes(r.send_bytes_per_rank_dedup):>16}"
          f"{format_bytes(r.expert_weight_bytes):>14}")
viz.ep_ranks_figure(ranks)

# %% [markdown]
# At EP = 128 each rank holds 7 experts per layer (231 MB in fp8) and receives 65,536 rows per layer per
# 4096-token micro-batch, about 9,400 rows per expert: big enough matmuls to run well, and a hot expert
# (section 4) would multiply one rank's share by up to max/mean. That is why the bias update runs at
# every step in training and why serving watches `last_expert_counts`.
