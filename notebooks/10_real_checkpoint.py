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
# 6. does the same walk for the other public relative, DeepSeek-V3.2 (`model_type: deepseek_v32`), and shows
#    which earlier positions its lightning indexer picks for each query;
# 7. loads the real Kimi-Linear-48B from a local path, with its routed experts left on disk, if you have it.
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
from transformers import (AutoModelForCausalLM, DeepseekV32Config, DeepseekV32ForCausalLM, KimiLinearConfig,
                          KimiLinearForCausalLM)

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.alignment.compare import compare
from latentmoe_lab.interop import kimi_linear
from latentmoe_lab.interop.export import export_transformers
from latentmoe_lab.interop.transformers_taps import TransformersCandidate
from latentmoe_lab.viz.alignment import alignment_figure
from latentmoe_lab.viz.attention import topk_pattern_figure
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
# ## 6. DeepSeek-V3.2: the same walk, and what its indexer picks
#
# DeepSeek-V3.2 is the other public relative: every layer is MLA with RoPE and its own lightning indexer
# (DeepSeek Sparse Attention), a query LoRA, a dense first layer, then MoE with group-limited sigmoid routing.
# In our switches that is `layer_types` all `"dsa"` with the indexer on, no output gate, no latent projection
# and `mla.rope` (docs/design.md §17.9). A small random one again, saved by transformers, loaded by ours, and
# walked tap by tap: the first divergent layer must be none. transformers' eager attention is the path that
# applies the indexer's top-k as a mask, so it is the one compared.

# %%
ds_config = DeepseekV32Config(
    vocab_size=512, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, moe_intermediate_size=HIDDEN // 2,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
    qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=EXPERTS, num_experts_per_tok=2,
    n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
    index_topk=8, index_head_dim=32, index_n_heads=8, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
ds_config._attn_implementation = "eager"
ds_theirs = DeepseekV32ForCausalLM(ds_config).eval()
generator = torch.Generator().manual_seed(2)
with torch.no_grad():  # O(1) weights, as above: norms near 1, everything else at 0.15 scale
    for name, tensor in [*ds_theirs.named_parameters(), *ds_theirs.named_buffers()]:
        if not tensor.is_floating_point() or "inv_freq" in name:
            continue
        if name.endswith("norm.weight"):
            tensor.copy_(1 + 0.2 * torch.randn(tensor.shape, generator=generator))
        else:
            tensor.copy_(0.15 * torch.randn(tensor.shape, generator=generator))
ds_checkpoint = workdir / "deepseek-v32-small"
ds_theirs.save_pretrained(ds_checkpoint)
ds_ours = LatentMoEForCausalLM.from_pretrained(ds_checkpoint)
dc = ds_ours.config
print("layer types:", dc.layer_types, "| dsa.use_indexer", dc.dsa.use_indexer, "| mla.rope", dc.mla.rope,
      "| mla.output_gate", dc.mla.output_gate, "| indexer", dc.indexer)
ds_ids = torch.randint(0, ds_config.vocab_size, (2, TOKENS), generator=torch.Generator().manual_seed(3))
ds_report = compare(ds_ours, TransformersCandidate(ds_theirs, dc), ds_ids)
print(ds_report.table())
ds_first = ds_report.first_divergence
print("first divergent tap:", "none" if ds_first is None else ds_first.name)
alignment_figure(ds_report.as_dicts(), title="Our load of a deepseek_v32 checkpoint against transformers (fp32)",
                 first_divergence=None if ds_first is None else ds_first.name)

# %% [markdown]
# Each query $t$ attends only to the `index_topk` = 8 earlier positions with the highest index scores
# $I_{t,s} = \sum_j w_{t,j}\,\mathrm{ReLU}(q^I_{t,j}\cdot k^I_s)$ (chapter 02, §5); the first 8 queries see
# every key they can. Below, for layer 1 of the first sequence, the heatmap is our indexer's scores over the
# causal part (of the first 96 queries) and the dots the positions it selects, recomputed from the hidden
# states the layer received.
# transformers' indexer returns its top-k indices too; per query, the two sets of causal positions are compared
# (they may differ only where two scores tie exactly on the cut, docs/design.md §17.9).

# %%
LAYER = 1
seen: dict[str, torch.Tensor] = {}
ours_hook = ds_ours.layers[LAYER].attn.register_forward_pre_hook(lambda module, args: seen.update(x=args[0]))
theirs_hook = ds_theirs.model.layers[LAYER].self_attn.indexer.register_forward_hook(
    lambda module, args, output: seen.update(theirs=output))
with torch.no_grad():
    ds_ours(ds_ids[:1])
    ds_theirs(ds_ids[:1])
ours_hook.remove()
theirs_hook.remove()
attn, x = ds_ours.layers[LAYER].attn, seen["x"]
positions = torch.arange(x.shape[1])[None]
with torch.no_grad():
    c_q, *_, index_keys = attn.project(x, positions)  # the query latent and the (rotated) index keys
    index_scores = attn.indexer.scores(x, c_q, index_keys, positions)
    selected = attn.indexer.select(x, c_q, index_keys, offset=0, positions=positions)  # [1, T, topk], -1 pads
ours_sets = [{s for s in row if s >= 0} for row in selected[0].tolist()]
theirs_sets = [{s for s in row if s <= t} for t, row in enumerate(seen["theirs"][0].tolist())]  # causal part
agree = sum(a == b for a, b in zip(ours_sets, theirs_sets))
print(f"queries whose selection equals transformers': {agree} of {len(ours_sets)}")
for t in (3, TOKENS // 2, TOKENS - 1):
    print(f"query {t:3d} selects {sorted(ours_sets[t])}")
shown = min(TOKENS, 96)  # the first queries (and so every key they can see): a readable heatmap
topk_pattern_figure(index_scores[0, :shown, :shown], selected[0, :shown],
                    title=f"deepseek_v32 layer {LAYER}: index scores and the top-{dc.indexer.topk} each query keeps")

# %% [markdown]
# ## 7. The real Kimi-Linear-48B, if it is here
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
