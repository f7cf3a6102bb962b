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
# # 04 · Parallel layouts: expert, tensor, pipeline and context parallelism
#
# A 2.78T-parameter model does not fit on one device: its routed experts alone are 2.72T parameters.
# The write-ups spread it over a device mesh with five dimensions, and name the expert All-to-All as
# the bottleneck. This chapter runs those layouts **for real** on the tiny preset, as 2-4 CPU processes
# on gloo, then plans them at full scale:
#
# 1. the mesh: which rank holds which layers, heads and experts;
# 2. real multi-process runs launched from here with accelerate's `notebook_launcher`: logits and greedy
#    tokens equal to one process;
# 3. token traffic between ranks, and the bytes every collective moved against the planner's prediction;
# 4. pipeline schedules (GPipe, 1F1B) and stage balance;
# 5. the full-scale planner: EP64 x TP8 x PP4 = 2048, TP8 x PP4 x EP8 x DP2 = 512, and the serving
#    layout TP8 x EP8 x PP2: memory per device, traffic, roofline step time, and which fit;
# 6. an explorer over layouts and hardware;
# 7. accelerate big-model placement and disk offload of cold experts.
#
# Everything is attached to the single-device model from outside (`latentmoe_lab.parallel`): the
# layers keep their math; wrappers only move tensors between ranks.

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("LATENTMOE_SMOKE", "0") == "1"
SEQ_LEN = 40 if SMOKE else 96          # prompt tokens (the DSA index top-k is 32: longer means truly sparse)
NEW_TOKENS = 3 if SMOKE else 8         # greedy tokens decoded by every layout
NPROC = 4                              # processes per launch (2 CPU cores here: keep it small)

# %%
import ipywidgets
import torch
from collections import Counter

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.meta import format_bytes
from latentmoe_lab.parallel import (HARDWARE, ParallelConfig, RunSettings, Workload, plan_examples, plan_layout,
                                    plan_table, run_layouts)
from latentmoe_lab.parallel.mesh import world_layout
from latentmoe_lab.parallel.offload import dispatch_with_offload, full_scale_device_map, offload_experts
from latentmoe_lab.parallel.pipeline import partition_layers, simulate_schedule, stage_costs
from latentmoe_lab.viz import parallel as viz
from latentmoe_lab.viz.notebook import use_notebook_renderer

use_notebook_renderer()  # figures also render in exported HTML and on GitHub
torch.set_num_threads(1)
tiny = ModelConfig.from_preset("tiny")
full = ModelConfig.from_preset("k3-2.8t")
print(f"tiny: {tiny.num_layers} layers, {tiny.moe.num_experts} experts top-{tiny.moe.top_k}, "
      f"{tiny.kda.num_heads} KDA / {tiny.mla.num_heads} MLA heads")

# %% [markdown]
# ## 1. The mesh
#
# `rank = (((pp * DP + dp) * EP + ep) * CP + cp) * TP + tp`: tensor parallelism is innermost, so a TP
# group sits on one node's NVLink, and EP groups stride across nodes. Each dimension of size > 1 gets
# one process group per line of the mesh, every one with the layout's timeout.
#
# Between MoE layers an EP rank is one more batch shard: it runs attention on its own rows, then sends
# its tokens to the ranks holding their experts. So the batch splits over dp * ep shards.

# %%
layout = ParallelConfig(ep=2, tp=2)
for rank, coords in enumerate(world_layout(layout)):
    print(f"rank {rank}: " + "  ".join(f"{d}={v}" for d, v in coords.items()))

# %% [markdown]
# ## 2. Real runs, launched from this notebook
#
# `run_layouts` starts `NPROC` processes (gloo on CPU; the same worker runs under `torchrun` or
# `accelerate launch` on GPUs, see the README). From a script it uses accelerate's `notebook_launcher`;
# inside this kernel it *spawns* them through torch's elastic launcher instead, because a forked copy of
# a kernel's own threads can hang. Each worker joins
# with `PartialState(cpu=True)`, rebuilds the same seeded tiny model, and for each layout:
# parallelizes it, runs a prefill and greedy decoding, and compares with the single-process model.
# All layouts of one launch share the 4 processes: EP=2 runs as EP2 x DP2, and so on.

# %%
layouts = {
    "EP4": ParallelConfig(ep=4),
    "EP2xTP2": ParallelConfig(ep=2, tp=2),
    "PP2xEP2": ParallelConfig(pp=2, ep=2),
    "TP2xCP2+SP": ParallelConfig(tp=2, cp=2, sequence_parallel=True),
}
if not SMOKE:
    layouts |= {"PP2xDP2 (2 micro-batches)": ParallelConfig(pp=2, dp=2, micro_batches=2),
                "CP2xDP2": ParallelConfig(cp=2, dp=2),
                "EP2xTP2 (no overlap)": ParallelConfig(ep=2, tp=2, overlap=False)}
reports = dict(zip(layouts, run_layouts(list(layouts.values()),
                                        RunSettings(batch=4, seq_len=SEQ_LEN, new_tokens=NEW_TOKENS))))
print(f"{'layout':<28}{'max |logit error|':>18}{'tokens equal':>14}{'bytes = planner':>17}")
for name, report in reports.items():
    print(f"{name:<28}{report.max_abs_logit_error:>18.2e}{str(report.tokens_match):>14}{str(report.bytes_match):>17}")
assert all(r.max_abs_logit_error <= 1e-5 and r.tokens_match and r.bytes_match for r in reports.values())

# %% [markdown]
# Errors are float rounding (partial sums added in another order), far below 1e-5, and every greedy
# token agrees. The token check is tie-aware: where a layout picks another token, it reads the
# single-process model's logit margin between the two, and accepts the difference only as a near-tie
# (margin <= `RunSettings.tie_margin`, 1e-4); at thousands of tokens, near-ties in the indexer's top-k
# make such flips happen even in one process when only the batch size changes. Who held what: in EP2 x TP2 each rank keeps half of the experts at half of their
# intermediate width (and half of the heads); in PP2 x EP2 each pipeline stage keeps a contiguous block of
# layers, balanced by active parameters per token.

# %%
for name in ("EP2xTP2", "PP2xEP2"):
    viz.holdings_figure(reports[name].ranks, tiny.num_layers, tiny.moe.num_experts,
                        title=f"{name}: layers and experts per rank").show()

# %% [markdown]
# ## 3. Token traffic and bytes against the planner
#
# The dispatcher sends **one row per (token, destination rank)**: a token bound for two experts on the same
# rank travels once, in the latent size (32 here, 3584 at full scale instead of 7168). Its K local expert ids
# and routing weights ride along as a small int32 message, so the receiver returns one weighted sum per row.
# The token All-to-All is started asynchronously and the shared experts run while it is in flight.

# %%
ep4 = reports["EP4"]
viz.traffic_matrix_figure(ep4.sent_to, title="EP4 prefill: All-to-All bytes from rank to rank").show()
layer = sorted(ep4.ranks[0]["load"])[0]
for r in ep4.ranks:
    stats = r["load"][layer]
    print(f"rank {r['rank']} layer {layer}: rows sent per rank {stats['rows_to']} for (token, expert) pairs "
          f"{stats['pairs_to']}; pairs per local expert {stats['expert_pairs']}")

# %% [markdown]
# Every collective goes through `Comm`, which counts the bytes each rank puts on the wire per tag. The
# planner's byte model (`parallel/traffic.py`) predicts the same numbers from shapes alone, plus the routing
# of the single-process model for the expert All-to-All rows (the only data-dependent part). They are
# equal **exactly**, rank by rank and tag by tag:

# %%
for name in ("EP2xTP2", "TP2xCP2+SP"):
    report = reports[name]
    measured, planned = Counter(), Counter()
    for m, p in zip(report.measured, report.planned):
        measured.update(m)
        planned.update(p)
    assert report.measured == report.planned
    viz.measured_vs_planned_figure(measured, planned, title=f"{name}: bytes per collective (all ranks)").show()

# %% [markdown]
# ## 4. Pipeline schedules and stage balance
#
# GPipe runs every forward, then every backward; 1F1B interleaves them after a warm-up. Both leave the same
# bubble, (pp - 1) / (m + pp - 1) of the time, but 1F1B keeps at most pp micro-batches of activations
# alive instead of m. `train_step` runs both with send/recv (tested: gradients equal one device's).

# %%
for schedule in ("gpipe", "1f1b"):
    events = simulate_schedule(schedule, micro_batches=6, stages=4)
    span = max(e["end"] for e in events)
    bubble = 1 - sum(e["end"] - e["start"] for e in events) / (4 * span)
    viz.pipeline_schedule_figure(events, title=f"{schedule}: 4 stages, 6 micro-batches, bubble {bubble:.0%}").show()

# %%
stages = partition_layers(full, 4)
print("k3-2.8t over 4 stages:", [f"layers {s.start}-{s.stop - 1}" for s in stages])
viz.stage_balance_figure(stage_costs(full, stages), title="k3-2.8t PP4: active parameters per token per stage").show()
pp_run = reports["PP2xEP2"]
print("measured stage seconds (tiny PP2xEP2, prefill + decode):",
      {tuple(r["layers"]): round(r["stage_seconds"], 3) for r in pp_run.ranks})

# %% [markdown]
# ## 5. The full-scale planner
#
# Inputs: the config, a layout, a hardware description and a workload. Per device it counts the weights
# of this rank's slice (built on the meta device at the local width), gradients and Adam states when
# training, KDA states and the DSA latent + index-key cache when serving, and activations; then the bytes
# of each collective and a roofline step time. The three write-up layouts on two GPU generations:

# %%
plans = {hw: plan_examples(full, HARDWARE[hw]) for hw in ("H100-80GB", "H200-141GB")}
for hw, hw_plans in plans.items():
    print(hw)
    print(plan_table(hw_plans))
    for plan in hw_plans:
        print(f"  {plan.name}: {plan.reason}")
    print()

# %% [markdown]
# - **EP64 x TP8 x PP4 = 2048** (training, 8k sequences) fits even on 80 GB: each device holds 14 experts
#   per layer at 1/8 of their width (about 1.3B expert parameters), and the Adam states of the dense parts
#   are sharded over the 64 EP ranks that replicate them.
# - **TP8 x PP4 x EP8 x DP2 = 512** does not fit for Adam training: a device keeps 1/256 of the experts
#   (10.6B parameters) with fp32 gradients and states shared by only dp = 2 replicas; it needs ZeRO-3 /
#   FSDP-style sharding of weights and gradients, or lower-precision states.
# - **TP8 x EP8 x PP2 = 128** (serving 128 requests of 128k tokens, FP8 experts) needs about 79 GB: just
#   over an H100's usable 72 GB, comfortably inside an H200.

# %%
h100 = plans["H100-80GB"]
names = [p.name.split(" ")[0] for p in h100]
viz.memory_figure(names, [p.memory.as_dict() for p in h100], HARDWARE["H100-80GB"].usable_bytes,
                  title="Memory per device on H100-80GB (fullest stage)").show()
viz.a2a_variants_figure(names, [p.traffic for p in h100]).show()
viz.step_time_figure(names, [p.times for p in h100], phase="prefill").show()
viz.step_time_figure(names, [p.times for p in h100], phase="decode").show()

# %% [markdown]
# Grouping per destination rank matters little at EP64 (16 experts over 64 ranks rarely share one), a lot
# at EP8; the latent size halves every variant. At EP64 a token's rows reach about 14 other ranks, almost
# all over the NIC, which is why the All-to-All dominates the training step and why overlapping it matters.
#
# ## 6. Explore layouts
#
# Any layout that divides the model: the planner refuses the others with the rule they break.

# %%
def explore(ep=64, tp=8, pp=4, dp=1, hardware="H100-80GB", mode="train", expert_format="fp8"):
    try:
        pconfig = ParallelConfig(ep=ep, tp=tp, pp=pp, dp=dp, micro_batches=8)
        workload = Workload(mode=mode, seq_len=8192 if mode == "train" else 131072, expert_format=expert_format)
        plan = plan_layout(full, pconfig, HARDWARE[hardware], workload)
    except ValueError as error:
        print(f"refused: {error}")
        return None
    print(f"{pconfig.name()} = {pconfig.world_size} devices: {plan.reason}")
    print(f"prefill {plan.times['prefill']['sequential']:.2f} s ({plan.times['prefill']['overlapped']:.2f} s "
          f"overlapped), decode {plan.times['decode']['sequential'] * 1e3:.1f} ms per token")
    return viz.memory_figure([pconfig.name()], [plan.memory.as_dict()], HARDWARE[hardware].usable_bytes)


ipywidgets.interactive(explore, ep=[1, 2, 4, 8, 16, 32, 64, 128], tp=[1, 2, 4, 8], pp=[1, 2, 4, 8], dp=[1, 2, 4],
                       hardware=list(HARDWARE), mode=["train", "serve"], expert_format=["bf16", "fp8", "mxfp4"])

# %% [markdown]
# ## 7. accelerate big-model placement and cold-expert offload
#
# Without enough devices, accelerate can still place the model: `infer_auto_device_map` on the meta-device
# build fills the GPUs block by block, then CPU memory, then disk. For one 8 x H200 node:

# %%
max_memory = {i: 141 * 10**9 for i in range(8)} | {"cpu": 2 * 10**12, "disk": 10**14}
device_map = full_scale_device_map(full, max_memory)
print(Counter(str(v) for v in device_map.values()))

# %% [markdown]
# On the tiny model the same machinery runs for real: the two most used experts of each layer stay
# resident, the others live in one file each on disk behind an LRU cache, and two blocks are offloaded to
# disk whole. The logits do not move.

# %%
import tempfile

torch.manual_seed(0)
model = LatentMoEForCausalLM(tiny).eval()
ids = torch.randint(0, tiny.vocab_size, (2, 24))
with torch.no_grad():
    reference = model(ids).logits
folder = tempfile.mkdtemp()
offloaded = offload_experts(model, f"{folder}/experts", hot=2, capacity=4, policy="lru", calibration=ids[:, :8])
blocks = {"embed_tokens": "cpu", "layers.0": "cpu", "layers.1": "cpu", "layers.2": "disk", "layers.3": "disk",
          "norm": "cpu", "lm_head": "cpu", "vision": "cpu"}
model = dispatch_with_offload(model, blocks, f"{folder}/blocks")
with torch.no_grad():
    error = (model(ids).logits - reference).abs().max().item()
generated = model.generate(ids, max_new_tokens=NEW_TOKENS)
print(f"max |logits - resident| = {error:.1e}")
for layer_idx, experts in offloaded.items():
    print(f"layer {layer_idx}: hot experts {experts.hot}, cache {experts.cache.stats()}, "
          f"read from disk {format_bytes(experts.bytes_read)}")
