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
# # 10 · A real checkpoint
#
# Every earlier chapter ran on weights this package made itself. The closest public relative of the model,
# Kimi-Linear (KDA + MLA + MoE), is published in transformers' format (`model_type: kimi_linear`), and
# `LatentMoEForCausalLM.from_pretrained` reads that format directly (`latentmoe_lab.interop`,
# docs/design.md §17). This chapter:
#
# 1. builds a small Kimi-Linear with transformers' own classes and random weights, and saves it the way the
#    published checkpoints are saved;
# 2. loads it into our model: which switches turn our layers into theirs, and how the names map;
# 3. walks it through the alignment taps against transformers (chapter 07's report): the first divergent
#    layer must be none;
# 4. shows its routing statistics with chapter 01's plots;
# 5. writes it back in transformers' format and lets transformers read it;
# 6. loads the real Kimi-Linear-48B from a local path, with its routed experts left on disk, if you have it.
#
# Nothing is downloaded. Set `KIMI_LINEAR_PATH` to a local copy of moonshotai/Kimi-Linear-48B-A3B-Instruct to
# run the last cell.

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("LATENTMOE_SMOKE", "0") == "1"
KIMI_LINEAR_PATH = os.environ.get("KIMI_LINEAR_PATH", "/models/Kimi-Linear-48B-A3B-Instruct")
HIDDEN = 64 if SMOKE else 128
EXPERTS = 8 if SMOKE else 32
TOKENS = 48 if SMOKE else 256

# %%
import json
import math
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, KimiLinearConfig, KimiLinearForCausalLM

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.alignment.compare import compare
from latentmoe_lab.interop import kimi_linear
from latentmoe_lab.interop.export import export_transformers
from latentmoe_lab.interop.transformers_taps import TransformersCandidate
from latentmoe_lab.viz.alignment import alignment_figure
from latentmoe_lab.viz.model import expert_load_figure, load_imbalance_figure
from latentmoe_lab.viz.notebook import use_notebook_renderer

use_notebook_renderer()
torch.manual_seed(0)
workdir = Path(tempfile.mkdtemp(prefix="chapter10-"))

# %% [markdown]
# ## 1. A Kimi-Linear, as transformers saves it
#
# Six layers: KDA at 1-based layers 1, 2, 4, 5 and full (MLA) attention at 3 and 6, as the published config
# lists them (`linear_attn_config.kda_layers` / `full_attn_layers`, 1-based); the first layer's FFN is dense,
# the rest are MoE with a shared expert and group-limited sigmoid routing. transformers initialises weights at
# std 0.02, which makes every logit nearly equal; O(1) weights make the comparison below meaningful.

# %%
hf_config = KimiLinearConfig(
    vocab_size=512, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, moe_intermediate_size=HIDDEN // 2,
    num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
    qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, num_local_experts=EXPERTS, num_experts_per_tok=4,
    n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.446, first_k_dense_replace=1,
    linear_attn_config={"head_dim": 32, "num_heads": 4, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4, 5],
                        "full_attn_layers": [3, 6]},
    pad_token_id=None, bos_token_id=None, eos_token_id=None, max_position_embeddings=4096)
theirs = KimiLinearForCausalLM(hf_config).eval()
generator = torch.Generator().manual_seed(0)
with torch.no_grad():
    for name, tensor in [*theirs.named_parameters(), *theirs.named_buffers()]:
        if "A_log" in name or "dt_bias" in name:
            continue  # transformers' initialisation: the decay rates a model trains from
        if "e_score_correction_bias" in name:
            tensor.copy_(0.3 * torch.randn(tensor.shape, generator=generator))
        elif tensor.dim() == 1:
            tensor.copy_(1 + 0.2 * torch.randn(tensor.shape, generator=generator))
        else:
            scale = 1.0 if "embed" in name else 1 / math.sqrt(tensor.shape[-1])
            tensor.copy_(scale * torch.randn(tensor.shape, generator=generator))
checkpoint = workdir / "kimi-linear-small"
theirs.save_pretrained(checkpoint)
print(sorted(p.name for p in checkpoint.iterdir()))
with safe_open(checkpoint / "model.safetensors", "pt") as f:
    layer_one = [name for name in f.keys() if name.startswith("model.layers.1.")]
print(f"{len(layer_one)} tensors in layer 1, e.g.", layer_one[:3], layer_one[-3:])
print("its linear_attn_config:", json.loads((checkpoint / "config.json").read_text())["linear_attn_config"])

# %% [markdown]
# ## 2. Our model, with their parts switched off
#
# `from_pretrained` sees `model_type: kimi_linear` in config.json and builds the equivalent `ModelConfig`:
# no latent projection in the MoE, no output gate and no indexer on the MLA layers, the softplus KDA forget
# gate with rank-head_dim forget and output gates, MLA without a q LoRA, and the latent norms at transformers'
# eps. The weights go through one table per architecture; here are the rows of one KDA and one MoE layer.

# %%
ours = LatentMoEForCausalLM.from_pretrained(checkpoint)
c = ours.config
print("layer types:", c.layer_types, "| dense layers first:", c.first_dense_layers)
print("moe.latent_projection", c.moe.latent_projection, "| mla.output_gate", c.mla.output_gate,
      "| dsa.use_indexer", c.dsa.use_indexer, "| mla.q_lora_rank", c.mla.q_lora_rank,
      "| kda.gate_form", c.kda.gate_form)
for entry in kimi_linear.name_table(c):
    if entry.ours.startswith("layers.1.attn.") or entry.ours.startswith("layers.1.ffn.experts"):
        shown = entry.theirs if len(entry.theirs) <= 3 else (entry.theirs[0], "...", entry.theirs[-1])
        print(f"{entry.ours:28s} {entry.kind:12s} {shown}")

# %% [markdown]
# ## 3. Tap by tap against transformers
#
# `TransformersCandidate` hooks transformers' modules under our tap names (chapter 07), so the alignment
# report compares every layer's attention output, router logits, chosen experts, FFN output and residual
# stream. Both run in fp32; the errors are rounding, five orders of magnitude below what the default
# thresholds call a divergence.

# %%
ids = torch.randint(0, hf_config.vocab_size, (2, TOKENS), generator=torch.Generator().manual_seed(1))
report = compare(ours, TransformersCandidate(theirs, c), ids)
print(report.table())
print("first divergent tap:", "none" if report.first_divergence is None else report.first_divergence.name)
first = report.first_divergence
alignment_figure(report.as_dicts(), title="Our load of the checkpoint against transformers (fp32)",
                 first_divergence=None if first is None else first.name)

# %% [markdown]
# ## 4. Routing statistics
#
# The same forward leaves each MoE layer's expert counts (chapter 01): how many tokens each expert received,
# and the busiest expert against the mean. Random weights route fairly evenly; a trained checkpoint does not,
# which the correction bias is there to even out.

# %%
with torch.no_grad():
    ours(ids)
moe_layers = [i for i, block in enumerate(ours.layers) if block.is_moe]
load = [ours.layers[i].ffn.last_expert_counts.float().tolist() for i in moe_layers]
labels = [f"layer {i}" for i in moe_layers]
expert_load_figure(load, labels, title="Tokens per expert").show()
load_imbalance_figure([max(row) / (sum(row) / len(row)) for row in load], labels)

# %% [markdown]
# ## 5. Back to transformers' format
#
# `export_transformers` writes config.json and the safetensors (here in shards) in the published layout;
# transformers' own `AutoModelForCausalLM` reads it, and its logits equal ours. What kimi_linear cannot say
# (latent experts, the gated output gate, a vision tower, an MTP head) is refused before anything is written.

# %%
exported = export_transformers(ours, workdir / "exported", "kimi_linear", max_shard_size="1MB")
reread = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
with torch.no_grad():
    difference = (reread(ids).logits - ours(ids).logits).abs().max().item()
print(sorted(p.name for p in exported.iterdir())[:4], "...")
print(f"largest logit difference, transformers on the export vs ours: {difference:.2e}")

# %% [markdown]
# ## 6. The real Kimi-Linear-48B, if it is here
#
# 48B parameters in bf16 are about 98 GB. With the routed experts left in the files behind an 8 GB expert
# cache (`load_with_experts_on_disk`), everything else (attention, shared experts, embeddings: a few GB)
# is loaded, and each expert is read from the memory-mapped safetensors the first time a token routes to it.
# The checkpoint's own tokenizer.json encodes the prompt.

# %%
if Path(KIMI_LINEAR_PATH).is_dir():
    from latentmoe_lab.interop.offload import load_with_experts_on_disk
    from latentmoe_lab.tokenizer import load_tokenizer

    real, cache = load_with_experts_on_disk(LatentMoEForCausalLM, KIMI_LINEAR_PATH, cache_bytes=8 << 30,
                                            dtype=torch.bfloat16)
    tokenizer = load_tokenizer(KIMI_LINEAR_PATH, real.config.vocab_size)
    prompt = tokenizer.encode("The capital of France is")
    out = real.generate(prompt, max_new_tokens=8)
    print(tokenizer.decode(out[0, prompt.shape[1]:]), "| expert cache hit rate", round(cache.hit_rate, 3))
else:
    print(f"no checkpoint at {KIMI_LINEAR_PATH}: set KIMI_LINEAR_PATH to a local Kimi-Linear-48B to run this cell")
