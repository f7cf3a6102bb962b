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
# # 05 · Profiling: where the time goes
#
# Chapters 01-04 built the pieces and checked their math. This one asks the serving question: for a
# prompt and a few decoded tokens, **which component costs what**, and how does that change with the
# prompt length? Three tools from `latentmoe_lab.profiling`:
#
# 1. `prefill_decode_profile`: wall time per component (embeddings, KDA, Gated DSA, LatentMoE, dense FFN,
#    head), measured with forward hooks on the top-level parts of each block, for prefill and for decode;
# 2. the same for growing prompts, to see which parts grow linearly and which do not;
# 3. `top_ops`: the heaviest PyTorch ops under `torch.profiler`.
#
# On a GPU the same calls work (the hooks synchronise), and `backend="auto"` picks the Triton kernels.

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("LATENTMOE_SMOKE", "0") == "1"
PRESET = "tiny" if SMOKE else "small"
PROMPT_LEN = 64 if SMOKE else 512
DECODE_STEPS = 4 if SMOKE else 32
SCALING_LENS = [16, 32, 64] if SMOKE else [128, 256, 512, 1024, 2048]

# %%
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.meta import format_count
from latentmoe_lab.profiling import COMPONENTS, prefill_decode_profile, top_ops
from latentmoe_lab.viz import profiling as viz
from latentmoe_lab.viz.notebook import use_notebook_renderer

use_notebook_renderer()  # figures also render in exported HTML and on GitHub
torch.manual_seed(0)
config = ModelConfig.from_preset(PRESET)
model = LatentMoEForCausalLM(config).eval()
print(f"{PRESET}: {format_count(sum(p.numel() for p in model.parameters()))} parameters, "
      f"layers {config.layer_types}, {torch.get_num_threads()} CPU threads")

# %% [markdown]
# ## 1. Prefill and decode, component by component
#
# Prefill pushes the whole prompt through each layer at once: big matmuls, the chunked KDA form, the
# indexer scoring every causal key. Decode runs one token per step: the recurrent KDA step against a
# constant-size state, the indexer over the cached keys, attention over the selected latent entries only.
# Decode is dominated by per-step overheads on a CPU; on a GPU by reading weights and cache.

# %%
model(torch.zeros(1, 8, dtype=torch.long))  # warm-up: first calls pay one-off allocation costs
profile = prefill_decode_profile(model, PROMPT_LEN, DECODE_STEPS)
for phase, times in profile.items():
    timed = sum(v for k, v in times.items() if k != "wall")
    parts = ", ".join(f"{k} {times[k] * 1e3:.1f} ms" for k in COMPONENTS if k in times)
    print(f"{phase:8s} wall {times['wall'] * 1e3:8.1f} ms (components {timed / times['wall']:.0%}): {parts}")
viz.phase_breakdown_figure(profile)

# %% [markdown]
# ## 2. How each component grows with the prompt
#
# KDA is linear in T (a constant-size state per head); the MoE and the dense FFN are linear in T too
# (each token runs top_k experts). Gated DSA keeps the attention itself at T x top-k once T exceeds
# top-k, but its lightning indexer still scores every causal key: that part is quadratic, only with
# a few cheap ReLU heads. On a log-log plot a slope of 1 is linear and 2 is quadratic.

# %%
scaling = {name: [] for name in COMPONENTS}
for length in SCALING_LENS:
    # best of three: the first call at a new length pays for fresh allocations
    runs = [prefill_decode_profile(model, length, decode_steps=0)["prefill"] for _ in range(3)]
    for name in COMPONENTS:
        scaling[name].append(min(run.get(name, 0.0) for run in runs))
scaling = {name: values for name, values in scaling.items() if any(values)}
for name, values in scaling.items():
    print(f"{name:10s} " + "  ".join(f"{v * 1e3:8.2f}" for v in values) + "  ms")
viz.scaling_figure(SCALING_LENS, scaling)

# %% [markdown]
# ## 3. The heaviest ops
#
# `torch.profiler` names the aten ops behind those components. On a CPU, matmuls (`addmm`, `bmm`,
# `mm`) should lead; large shares of copies, `cat` or indexing point at layout work worth fusing —
# which is what the Triton kernels in `kernels/latentmoe_kernels` do on a GPU.

# %%
prompt = torch.randint(0, config.vocab_size, (1, PROMPT_LEN))
with torch.no_grad():
    rows = top_ops(lambda: model(prompt))
for row in rows:
    print(f"{row['name']:32s} {row['calls']:6d} calls {row['self_cpu_ms']:9.2f} ms {row['share']:6.1%}")
viz.top_ops_figure(rows)

# %% [markdown]
# ## What to take away
#
# - Decode time per token is flat in the context for KDA layers (the state does not grow) and grows only
#   with the indexer scan for Gated DSA layers; chapter 02 measures this at 1k-64k tokens.
# - The MoE's share is set by top-k and the latent width, not by the number of experts: 896 experts cost
#   memory, not time per token.
# - To profile on a GPU, move the model to CUDA and add `torch.profiler.ProfilerActivity.CUDA` to a
#   profiler of your own; `prof.export_chrome_trace(path)` gives a timeline for Perfetto.
