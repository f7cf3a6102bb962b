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
# 7. accelerate big-model placement and disk offload of cold experts;
# 8. the same layouts on torch's own engine (`latentmoe_lab.native`: DeviceMesh, DTensor tensor
#    parallelism, FSDP2, expert parallelism that trains, `torch.distributed.pipelining`): equal to one
#    process after training steps, what each parameter's DTensor placement means, and how such a run
#    launches on a cluster.
#
# Sections 1-7 use `latentmoe_lab.parallel`, attached to the single-device model from outside: the
# layers keep their math; wrappers only move tensors between ranks, with every collective written by
# hand. Section 8 drives the same layers with torch's distributed engine instead.

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("LATENTMOE_SMOKE", "0") == "1"
SEQ_LEN = 40 if SMOKE else 96          # prompt tokens (the DSA index top-k is 32: longer means truly sparse)
NEW_TOKENS = 3 if SMOKE else 8         # greedy tokens decoded by every layout
NPROC = 4                              # processes per launch (2 CPU cores here: keep it small)

# %%
import inspect

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
from latentmoe_lab.viz.notebook import explorer, use_notebook_renderer

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


choices = dict(ep=[1, 2, 4, 8, 16, 32, 64, 128], tp=[1, 2, 4, 8], pp=[1, 2, 4, 8], dp=[1, 2, 4], hardware=list(HARDWARE),
               mode=["train", "serve"], expert_format=["bf16", "fp8", "mxfp4"])
starting = inspect.signature(explore).parameters  # each control starts at explore's default
explorer(explore, **{name: ipywidgets.Dropdown(options=options, value=starting[name].default, description=name)
                     for name, options in choices.items()})

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

# %% [markdown]
# ## 8. The same layouts on torch's own engine
#
# `latentmoe_lab.native` (docs/design.md §11) runs these layouts through the pieces a cluster run in
# PyTorch is made of, and keeps `latentmoe_lab.parallel` (sections 1-7) as the readable twin it is
# checked against. The layers are the same classes in both; what differs is who moves the tensors:
#
# | | `parallel/` (sections 1-7) | `native/` |
# |---|---|---|
# | mesh | `ProcessMesh` (pp, dp, ep, cp, tp), one process group per line | `init_device_mesh` with named dims (pp, dp_shard, ep, tp), plus "data", the flattened dp_shard x ep: the ranks that hold different batch rows |
# | tensor parallelism | sharded layer copies, collectives written by hand | `parallelize_module` plans: `ColwiseParallel` / `RowwiseParallel` on the KDA and MLA projections, the dense FFN and the shared experts; `LocalParams`, a `ParallelStyle`, for the parameters a layer uses directly (A_log, dt_bias, the short conv, per-head norms, W_kvb) |
# | data parallelism | replicas (dp) | FSDP2 `fully_shard` on every block and the root over "data", the experts over dp_shard alone; a mixed-precision policy (`param_dtype`) |
# | expert parallelism | forward only; one row per (token, destination rank), routing weights sent along | an All-to-All inside an `autograd.Function` whose backward is the reverse All-to-All: one row per (token, expert) pair, the routing weights applied on the token's own rank |
# | pipeline | send / recv, GPipe and 1F1B written here (section 4) | `torch.distributed.pipelining` (GPipe, 1F1B) over a stage module that keeps the full model's parameter names |
# | training | PP x DP | every layout |
# | building | every rank builds the whole model, then keeps its part | meta device, plans, `fully_shard`, `to_empty`, then only this rank's slices read from the safetensors files (DCP's `HuggingFaceStorageReader`) |
# | context parallelism | cp | no cp dim (yet) |
#
# ### 8.1 Equal to one process, after training steps
#
# `check_layouts` writes one seeded checkpoint (`save_pretrained`), trains the plain single-device model
# on the whole global batch in this kernel (AdamW, gradient clipping at 1.0, the routing-bias update), and
# launches each layout as local gloo processes: every rank builds its share from the checkpoint, runs the
# first batch forward, takes the same steps on the same global batches, and gathers every parameter with
# `DTensor.full_tensor()`. The runs are in float64: Adam's first steps are close to sign(g), so in fp32 a
# gradient element near zero that differs by rounding alone could move a weight by a whole learning rate
# (1e-3); in fp64 a real mistake, such as a missing gradient reduction, still shows at about that size.

# %%
from latentmoe_lab.native import NATIVE_DIMS, NativeLayout
from latentmoe_lab.native.equivalence import EquivalenceSettings, check_layouts, compare_with_hand_written
from latentmoe_lab.native.placements import parameter_placements
from latentmoe_lab.parallel.config import ParallelConfig

native_layouts = [NativeLayout(tp=2)]  # each layout is one launch of fresh processes: smoke mode keeps one
if not SMOKE:
    native_layouts = [NativeLayout(dp_shard=2), NativeLayout(tp=2), NativeLayout(ep=2), NativeLayout(ep=2, tp=2),
                      NativeLayout(dp_shard=2, ep=2), NativeLayout(pp=2, tp=2)]
equivalence = EquivalenceSettings(steps=2 if SMOKE else 3)  # 2: the losses must show the weights moving
native_reports = check_layouts(native_layouts, equivalence)
print(f"{equivalence.steps} AdamW steps, batch {equivalence.batch} x {equivalence.seq_len} tokens, {equivalence.dtype}")
print(f"{'layout':<12}{'processes':>10}{'max |logit err|':>17}{'max |param err|':>17}{'params':>8}"
      f"{'max |loss err|':>16}   losses (layout)")
for layout, report in zip(native_layouts, native_reports):
    loss_error = max(abs(a - b) for a, b in zip(report.losses, report.reference_losses))
    print(f"{report.layout:<12}{layout.world_size:>10}{report.max_logit_error:>17.1e}{report.max_param_error:>17.1e}"
          f"{report.compared_params:>8}{loss_error:>16.1e}   " + ", ".join(f"{x:.6f}" for x in report.losses))
print(f"{'1 process':<12}{1:>10}{'':>58}   " + ", ".join(f"{x:.6f}" for x in native_reports[0].reference_losses))
assert all(r.max_logit_error <= 1e-5 and r.max_param_error <= 1e-5 for r in native_reports)
assert all(abs(a - b) <= 1e-5 for r in native_reports for a, b in zip(r.losses, r.reference_losses, strict=True))
assert native_reports[0].reference_losses[0] != native_reports[0].reference_losses[-1]  # training moved the weights

# %% [markdown]
# Every parameter of every layout ("params" counts the gathered tensors compared, over all ranks; a
# pipeline rank holds only its stage's) ends the steps within 1e-5 of the one-process run, and far closer
# in fact: what is left is rounding, from sums taken in another order. The logits come back in fp32 (the
# head's output is cast), so fp64-sized differences mostly round away there, and the losses (computed
# from those fp32 logits) differ by fp32 rounding where the batch is split over ranks and the per-rank
# means are averaged. Each layout moves its tensors differently: FSDP2 all-gathers each block's weights
# before its forward and reduce-scatters the gradients after its backward; TP2 splits heads and FFN
# widths and sums partial outputs; EP2 sends tokens to the rank holding their expert and the gradients
# back the same way; PP2 runs the blocks as two stages under a pipeline schedule.
#
# The native engine against the hand-written one, from one fp32 checkpoint: the logits of the same
# layout through `parallel/` and through `native/`.

# %%
pairs = {"TP2": (ParallelConfig(tp=2), NativeLayout(tp=2)), "EP2": (ParallelConfig(ep=2), NativeLayout(ep=2))}
differences = dict(zip(pairs, compare_with_hand_written(list(pairs.values()))))
for name, difference in differences.items():
    print(f"{name}: max |native logits - parallel/ logits| = {difference:.1e} (fp32)")
assert all(d <= 1e-5 for d in differences.values())

# %% [markdown]
# ### 8.2 Where each parameter lives: DTensor placements
#
# A parameter that a plan or FSDP2 touched is a `DTensor`: a global shape, a mesh (a sub-mesh of the
# named dims) and one *placement* per mesh dim saying how the global tensor maps onto that dim's ranks. The
# table lists each parameter kind once, with the blocks it occurs in, as rank 0 holds it, and the
# placement of its gradient after one forward and backward on a small batch (before any optimizer step).

# %%
placement_layouts = {"TP2": NativeLayout(tp=2)}
if not SMOKE:
    placement_layouts["FSDP2xTP2"] = NativeLayout(dp_shard=2, tp=2)


def placement_table(rows: dict) -> None:
    """One line per parameter kind: the block index (`layers.3.`, `vision.blocks.1.`) folded into `*` + a list."""
    kinds: dict[tuple, list] = {}
    for name, row in rows.items():
        parts = name.split(".")
        block = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        kind = name if block is None else ".".join(parts[:block] + ["*"] + parts[block + 1:])
        kinds.setdefault((kind, row), []).append("" if block is None else parts[block])
    print(f"{'parameter':<38}{'blocks':<9}{'placements':<45}{'mesh dims':<14}{'global':<13}{'local':<13}gradient")
    for (kind, row), blocks in kinds.items():
        print(f"{kind:<38}{','.join(b for b in blocks if b):<9}{row.placements:<45}{','.join(row.mesh_dims) or '-':<14}"
              f"{str(list(row.global_shape)):<13}{str(list(row.local_shape)):<13}{row.grad_placements}")


placements = {}
for name, layout in placement_layouts.items():
    placements[name] = parameter_placements(layout)
    print(f"\n{name} ({layout.world_size} processes), rank 0: {len(placements[name])} parameters")
    placement_table(placements[name])
    print("placements in use:", dict(Counter(row.placements for row in placements[name].values())))

# %% [markdown]
# What each placement means, for memory and for the gradient:
#
# - **`Shard(d)`**: the global tensor is cut along dim d into one piece per rank of that mesh dim (equal
#   pieces here); a rank stores only its piece, so its weight, gradient and AdamW states (created like the
#   parameter) take 1/n of the bytes. Column-parallel weights are `Shard(0)` (this rank's output
#   features: its heads), row-parallel ones `Shard(1)` (its input features); the gradient is this rank's
#   slice of the full gradient, with the same placement. The experts under EP are `Shard(0)` of the
#   stacked `[E, ...]` tensors over "ep": this rank's experts.
# - **`Replicate()`**: every rank of the mesh dim keeps the whole tensor: full memory on each. In TP2 these
#   are the parameters a layer uses inside its per-head computation: the KDA short conv (whose forward
#   takes this rank's q | k | v channels, `Sections` in `native/local_params.py`) and the per-head output
#   norm, and in Gated DSA the latent K/V norm (`REPLICATED_SUM`). Each rank uses the tensor for its own
#   heads only, so each rank's gradient is only part of the total.
# - **`Partial(sum)`**: a value that exists as per-rank addends; the true value is their sum over the mesh
#   dim. It is never a parameter's placement, but it is exactly the gradient of those `Replicate()`
#   parameters: `to_local(grad_placements=[Partial()])` in `LocalParams` labels it so. The sum is an
#   all-reduce over tp that DTensor runs when an operation needs the whole value (the gradient norm, the
#   AdamW update); under FSDP2 it is done inside FSDP2's gradient reduction, which redistributes the tp dim
#   to the parameter's `Replicate()` before its reduce-scatter over "data" (so in the FSDP2 x TP2 table the
#   gradients show the parameters' own placements). The hand-written twin of sections 1-3 needs no such
#   rule: it only runs the forward.
# - **`-`, a plain tensor** (TP2 alone, no FSDP2): a parameter outside every plan (embeddings, the norms
#   between blocks, low-rank down projections, the lightning indexer, the router, the latent projections,
#   the routed experts when ep = 1). Every tp rank computes it on the same tokens, so its gradients agree
#   without any communication; each rank keeps a whole copy.
# - **no gradient**: the lightning indexer of Gated DSA only picks positions (a top-k, through which no
#   gradient flows; it learns from its own warm-up loss, not from the language-model loss), and the vision
#   tower has no path to the loss on a text-only batch.
# - **`_StridedShard(dim=0, sf=2)`** (FSDP2 x TP2, on the mesh dims (data, tp)): FSDP2 shards dim 0 of the
#   parameter *as TP left it*, so a column-parallel weight is cut along dim 0 twice: first by tp into 2
#   contiguous halves, then each half by data. A plain `(Shard(0), Shard(0))` would mean the other order
#   (data first); `_StridedShard` with split factor sf = 2 (the tp size) records that the data dim splits
#   each of the tp pieces, so `full_tensor()` and the checkpoints put the rows back in the right place.
#   Memory: 1/(data x tp) of the tensor per rank. Row-parallel weights (`Shard(1)` over tp) have no such
#   clash: FSDP2's `Shard(0)` over data is a different dim. The `Replicate()` parameters of the TP regions
#   become `(Shard(0), Replicate())`, the parameters outside the plans `Shard(0)` over data alone, and the
#   experts `Shard(0)` over dp_shard (with ep > 1 they are already split over ep).
#
# ### 8.3 On a real cluster
#
# **What ran here**: gloo on CPU, 2 and 4 local processes sharing this machine's 2 cores, the tiny preset
# (0.30M parameters), float64 for the equivalence runs and float32 for the rest. Nothing in this chapter
# ran on NCCL or on a GPU, and no time or byte figure in it describes one.
#
# Where the groups of a cluster layout fall: `init_device_mesh` lays ranks out in row-major order over
# (pp, dp_shard, ep, tp), and torchrun numbers ranks node by node, so on 4 nodes of 8 GPUs, FSDP4 x EP4 x
# TP2 puts these groups around rank 0:

# %%
cluster = NativeLayout(dp_shard=4, ep=4, tp=2)
cluster.validate_for(full, world_size=32)  # the split divides the full model (experts, heads, widths)
GPUS_PER_NODE = 8
grid = torch.arange(cluster.world_size).view(*(getattr(cluster, d) for d in NATIVE_DIMS))


def group_of(rank: int, dims: tuple[str, ...]) -> list[int]:
    """The ranks that share every coordinate of `rank` except those along `dims`."""
    coords = (grid == rank).nonzero()[0].tolist()
    index = tuple(slice(None) if d in dims else c for d, c in zip(NATIVE_DIMS, coords))
    return grid[index].flatten().tolist()


carried = {("tp",): "TP collectives of activations, in every block",
           ("ep",): "the expert All-to-Alls, in every MoE layer",
           ("dp_shard",): "FSDP2 all-gather / reduce-scatter of the experts",
           ("dp_shard", "ep"): "'data': FSDP2 of every dense block and the root; loss and expert counts"}
for dims, what in carried.items():
    members = group_of(0, dims)
    nodes = sorted({r // GPUS_PER_NODE for r in members})
    print(f"{' x '.join(dims):<14}{len(members):>3} ranks {str(members):<66} nodes {nodes}: {what}")

# %% [markdown]
# TP and EP stay inside one node (NVLink); only FSDP2's gathers and reductions cross nodes. That is the
# point of the dim order: put the chattiest collectives innermost.
#
# **The command line** is the same on one machine and on a cluster. From a shell, `latentmoe-lab train
# --preset mini --fsdp 2 --ep 2 --out runs/native` starts the 4 local gloo processes itself (`--tp`, `--pp`,
# `--micro-batches`, `--schedule gpipe|1f1b` and `--param-dtype fp32|bf16` complete the layout;
# `latentmoe-lab train --help`). Started by a cluster launcher instead, with WORLD_SIZE already set, each
# process runs its own rank (`native/run.py`): accelerate's `PartialState` reads the RANK, WORLD_SIZE,
# LOCAL_RANK, MASTER_ADDR and MASTER_PORT that torchrun sets and picks NCCL when CUDA is there, the mesh is
# built on "cuda" when a GPU is visible, and the model, batches and bookkeeping tensors go to the rank's device:
#
# ```bash
# torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id RUN_ID \
#     -m latentmoe_lab train --preset mini --fsdp 4 --ep 4 --tp 2 --param-dtype bf16 --out runs/cluster
# ```
#
# Said honestly: that GPU path has never run. Everything in this section ran on CPU with gloo, 2-4 local
# processes, the tiny preset; nothing here was measured on NCCL.
#
# Settings that matter on NCCL (guidance; none was exercised here):
#
# | setting | what it does |
# |---|---|
# | `NCCL_SOCKET_IFNAME=<interface>` | the network interface NCCL bootstraps over (and uses for its socket transport); `GLOO_SOCKET_IFNAME` does the same for gloo groups. Pin it on hosts with several interfaces (docker bridges, management NICs). |
# | `NCCL_IB_HCA=<adapters>` | which InfiniBand / RoCE adapters NCCL may use; `NCCL_IB_GID_INDEX` selects the GID on RoCE; `NCCL_IB_DISABLE=1` turns InfiniBand off (NCCL falls back to sockets: a large slowdown to rule out, not a setting to keep). |
# | `NCCL_DEBUG=INFO` | prints, at start-up, the transport NCCL chose for each connection: the way to see whether the inter-node traffic really goes over InfiniBand. |
# | `TORCH_NCCL_ASYNC_ERROR_HANDLING` | what torch's watchdog does when a collective fails or times out: 0 nothing, 1 abort the communicator and end the process, 2 abort the communicator only, 3 end the process without aborting it (torch's default). Keep one that ends the process, so a dead peer stops the job instead of hanging it (the local launcher here does the same on gloo: a killed rank raises within the timeout). |
# | process-group timeout | how long a collective may wait before the watchdog acts: `init_distributed(timeout_s)` passes it to the default group. It must cover the slowest collective of the run (the first connections at scale, a checkpoint write), and no more, so a hang is reported promptly. |
# | `TORCH_NCCL_TRACE_BUFFER_SIZE` with `TORCH_NCCL_DUMP_ON_TIMEOUT=1` | the flight recorder: the last collectives of every rank, written out on a timeout, to find the rank that fell out of step (`TORCH_NCCL_DESYNC_DEBUG=1` helps name it). |
# | `CUDA_DEVICE_MAX_CONNECTIONS=1` | one hardware queue per GPU, so kernels start in the order they were issued; Megatron-LM asks for it so its TP communication is scheduled ahead of the compute that waits on it. `native/` relies on no such ordering; FSDP2 runs its all-gathers and reduce-scatters on streams of their own, so measure before setting it. |

# %% [markdown]
# ## 9. Expert-parallel load balancing
#
# With expert parallelism a step lasts as long as its busiest rank. `parallel/eplb/rebalance.py`'s
# `rebalance_experts` (docs/design.md §14) copies the hottest experts into redundant slots and packs the
# slots onto ranks so every rank carries about the same load. Below: the six imbalance workloads at K3
# scale (896 experts, top-16, EP64; the expert ids shuffled per layer), balancedness = mean / max tokens
# per rank before (expert e on rank e // 14) and after the balancer with 0, 64 and 128 redundant slots.

# %%
import plotly.graph_objects as go

from latentmoe_lab.parallel.eplb.load import ExpertLoadRecorder, balance_metrics, rank_loads
from latentmoe_lab.parallel.eplb.online import OnlineBalancer
from latentmoe_lab.parallel.eplb.plan import workload_loads
from latentmoe_lab.parallel.eplb.rebalance import default_placement, rebalance_experts
from latentmoe_lab.routing_workloads import WORKLOADS, make_workload

EPLB_LAYERS = 4 if SMOKE else 92  # MoE layers of the K3 table


def balancedness(weight, placement, ranks):
    phy2log, _, logcnt = placement
    return balance_metrics(rank_loads(weight, phy2log, logcnt, ranks))["balancedness"]


eplb_rows = {}
for name in WORKLOADS:
    weight = workload_loads(name, EPLB_LAYERS, 896, 16, num_tokens=4096)
    eplb_rows[name] = {"none": balancedness(weight, default_placement(EPLB_LAYERS, 896), 64)}
    for redundant in (0, 64, 128):
        placement = rebalance_experts(weight, 896 + redundant, 1, 8, 64)  # global policy, 8 nodes of 8
        eplb_rows[name][f"R={redundant}"] = balancedness(weight, placement, 64)
figure = go.Figure([go.Bar(name=variant, x=list(eplb_rows), y=[eplb_rows[w][variant] for w in eplb_rows])
                    for variant in ("none", "R=0", "R=64", "R=128")])
figure.update_layout(barmode="group", yaxis_title="balancedness (mean / max tokens per rank)", height=380,
                     title=f"K3 at EP64: {EPLB_LAYERS} MoE layers x 896 experts")
figure

# %% [markdown]
# One redundant slot per rank (R = 64) lifts every workload but one above 0.99: a single hot expert per
# layer gets its replicas, spread over the ranks. `same_topk` stays at 0.625: all tokens go to the same 16
# experts, the greedy replication gives each 5 replicas (80 equal slots), and 80 slots on 64 ranks put two
# on some rank. `rebalance_experts(..., refine=True)`, which the serving balancer uses, also tries replica
# counts packed onto the ranks (4 each here, one per rank, the spare slots to the next experts) and reaches
# 1.0 (docs/design.md §14). `benchmarks/RESULTS.md` has the planner's busiest-rank step time for each case.
#
# **Migration over time.** Serving rebalances online: an `ExpertLoadRecorder` keeps the routed tokens of
# the last `window_steps` steps, and every `rebalance_interval_steps` steps an `OnlineBalancer` computes a
# new placement and hands the workers `layers_per_step` layers at a time (the service never stops; the EP2
# and EP4 tests check that greedy tokens do not change). Here one expert is in every token's top-4 (64
# experts, EP8 + 8 redundant slots, 8 MoE layers), and which one it is moves by 16 ids every 40 steps.

# %%
layers, experts, ranks, steps = 8, 64, 8, (60 if SMOKE else 160)
one_hot = make_workload("one_hot_expert", 256, experts, 4).counts  # expert 0 in every token's top-4
recorder = ExpertLoadRecorder(layers, experts, window_steps=8)
balancer = OnlineBalancer(layers, experts, ranks, 8, num_groups=1, interval_steps=10, layers_per_step=2)
trace = []
for step in range(steps):
    counts = one_hot.roll(step // 40 * 16).repeat(layers, 1)  # [layers, experts]: the hot expert moves
    balancer.updates(recorder.window, step)
    phy2log, logcnt = balancer.slots()
    trace.append(balance_metrics(rank_loads(counts, phy2log, logcnt, ranks))["balancedness"])
    recorder.record(counts)
figure = go.Figure(go.Scatter(y=trace, mode="lines"))
figure.update_layout(xaxis_title="step", yaxis_title="balancedness this step", height=320,
                     title="online EPLB: the hotspot moves every 40 steps, 2 layers migrate per step")
figure

# %% [markdown]
# Each time the hot expert moves, balancedness drops until the next rebalance sees it in the window
# (at most 10 steps), then climbs back as the changed layers migrate, two per step.
