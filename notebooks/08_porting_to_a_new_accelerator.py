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
# # 08 · Porting to a new accelerator: the Day-0 path
#
# A team bringing this model up on new hardware walks one path: model analysis -> operator mapping ->
# graph optimisation -> accuracy alignment -> performance tuning -> stability validation. Earlier chapters
# cover analysis (04, 05), alignment (07) and serving (06). This one is the middle of the path, on the
# tiny model and then at full scale (docs/design.md §16):
#
# 1. the operator inventory: every op the model dispatches, per layer type, with FLOPs and bytes;
# 2. a simulated new device in strict mode: what is missing, and from which module;
# 3. registering the missing ops: the fused paths as `torch.ops.latentmoe` custom ops;
# 4. the device's numerics (bf16 inputs, fp32 accumulation) as an alignment candidate: which layer it hurts first;
# 5. a fusion pass on an exported block, and its launch count;
# 6. the full-scale inventory: where the FLOPs and the bytes of the 2.8T model go.

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("LATENTMOE_SMOKE", "0") == "1"
PROMPT_LEN = 37  # not a multiple of the KDA chunk: the ragged tail is part of every check
FULL_PREFILL_TOKENS = 1024 if SMOKE else 8192
FULL_DECODE_SEQS, FULL_DECODE_CONTEXT = 16, 65536 if SMOKE else 262144

# %%
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.alignment import compare
from latentmoe_lab.porting.custom_ops import OPS
from latentmoe_lab.porting.fusion import export_block, optimize
from latentmoe_lab.porting.inventory import op_kind, operator_inventory
from latentmoe_lab.porting.op_table import FULL_OP_TABLE, PROFILES
from latentmoe_lab.porting.report import by_layer_type, inventory_summary, top_table
from latentmoe_lab.porting.sim_device import SimDevice, SimDeviceCandidate, UnsupportedOperator
from latentmoe_lab.porting.swap import use_custom_ops
from latentmoe_lab.viz.notebook import use_notebook_renderer
from latentmoe_lab.viz.porting import inventory_figure

use_notebook_renderer()
torch.manual_seed(0)
config = ModelConfig.from_preset("tiny")
model = LatentMoEForCausalLM(config).eval()
ids = torch.randint(0, config.vocab_size, (2, PROMPT_LEN))

# %% [markdown]
# ## 1. The operator inventory
#
# The model is built on the meta device (shapes, no storage) and one forward runs under a
# `TorchDispatchMode` that records every ATen op: the module that called it, its shapes and dtypes, its
# FLOPs (torch.utils.flop_counter's formulas, ours for the custom ops) and the bytes it reads and writes.
# Ops are "custom work" when a vendor library does not have them: the KDA recurrence, top-k, index
# gather / scatter, grouped GEMM, the sort-based permutation.

# %%
tiny = operator_inventory(config, "prefill", tokens=PROMPT_LEN)
print(by_layer_type(tiny))
print()
print(top_table(tiny, "flops", 8))

# %% [markdown]
# ## 2. A new device, strict mode
#
# `SimDevice` is that device, simulated: every op goes through its op table and numerics profile. A
# first-generation part implements the standard ops, and none of the custom work. Strict mode stops at the
# first op it lacks and names the module that called it; report mode falls back to the CPU for each
# missing op and counts them, and the host round trips they cost.

# %%
custom_work = {name for name in FULL_OP_TABLE if op_kind(name) == "custom"}
vendor_table = FULL_OP_TABLE - custom_work
print(f"vendor op table: {len(vendor_table)} ops; custom work left out: {sorted(custom_work)}")
try:
    with torch.no_grad(), SimDevice("fp32", vendor_table, mode="strict", model=model):
        model(ids)
except UnsupportedOperator as error:
    print("strict:", error)

report_mode = SimDevice("fp32", vendor_table, mode="report", model=model)
with torch.no_grad(), report_mode:
    model(ids)
print(report_mode.coverage().summary())

# %% [markdown]
# ## 3. Register the missing ops
#
# The fused paths are `torch.library` custom ops (porting/custom_ops.py): routing gate + top-k, the dispatch
# plan, grouped GEMM and grouped SwiGLU, the KDA chunk and decode step, the indexer's top-k and sparse
# attention. Each has its reference twin as the CPU implementation, a fake for meta / export / compile, a
# backward where it trains, and the Triton kernels as its CUDA implementation. A vendor implements these
# nine ops instead of dozens of ATen ops each, and `use_custom_ops()` routes the model through them. What
# stays missing is the gather / scatter around the experts: the next ops to implement (or to fuse).

# %%
ported_table = vendor_table | {f"latentmoe.{name}" for name in OPS}
ported = SimDevice("fp32", ported_table, mode="report", model=model)
with torch.no_grad(), use_custom_ops(), ported:
    logits = model(ids).logits
with torch.no_grad():
    reference_logits = model(ids).logits
print(ported.coverage().summary())
print("logits equal to the CPU reference:", torch.equal(logits, reference_logits))

# %% [markdown]
# ## 4. The device's numerics, tap by tap
#
# The same device with its matmul numerics (inputs rounded to bf16, products accumulated in fp32) is an
# alignment candidate (docs/design.md §8). With a strict bound on the relative error, the first tap past it
# is where the device's arithmetic first shows; the figure shows how the error grows with depth.

# %%
print({name: (p.matmul_inputs, p.topk_max_k) for name, p in PROFILES.items()})
bf16 = compare(model, SimDeviceCandidate(model, "bf16-accum-fp32"), ids, thresholds={"rel_l2": 1e-3})
first = bf16.first_divergence
print(f"first divergence: {first.name if first else None}; rel L2 there "
      f"{first.rel_l2 if first else float('nan'):.2e}; logits KL {bf16.rows[-1].kl_mean:.2e}, top-1 agreement "
      f"{bf16.rows[-1].top1_agreement:.3f}")
bf16.figure()

# %% [markdown]
# ## 5. A fusion pass and its launch count
#
# One block (Gated DSA + LatentMoE) is exported with `torch.export`; fx passes then remove casts a value
# does not need, fuse the router's matmul into the routing op, the expert GEMM and its SwiGLU into
# `grouped_swiglu`, and chains of elementwise ops into one launch each. Every pass is checked against the
# unoptimised graph to 1e-6.

# %%
graph, inputs = export_block(model, layer=3, phase="prefill", tokens=PROMPT_LEN)
print(optimize(graph, inputs).table())

# %% [markdown]
# ## 6. The full-scale inventory
#
# The same inventory for k3-2.8t, still on the meta device: one block of each kind runs and counts once
# per layer of its kind (93 layers: 1 dense + KDA, 68 KDA + MoE, 24 Gated DSA + MoE). The dispatched FLOPs
# per token must equal the closed form (2 x active parameters + the LM head + the attention terms, within
# 2%). Prefill is compute: the expert GEMMs and the dense projections. Decode is bytes: every token of a
# step streams the weights of the experts it picks.

# %%
full = ModelConfig.from_preset("k3-2.8t")
prefill = operator_inventory(full, "prefill", tokens=FULL_PREFILL_TOKENS)
print(inventory_summary(prefill, full))
inventory_figure(prefill)

# %%
decode = operator_inventory(full, "decode", tokens=FULL_DECODE_SEQS, context=FULL_DECODE_CONTEXT)
print(inventory_summary(decode, full))
inventory_figure(decode)

# %% [markdown]
# ## What to take away
#
# - The inventory is the porting plan: nine custom ops carry the custom work, and the rest is standard.
# - Strict mode on a simulated device finds the missing ops and where they are called, before hardware.
# - A numerics profile is an alignment candidate: the first divergence names the layer to look at.
# - Fusion passes on exported graphs are checked for parity one by one; launch counts say what they buy.
