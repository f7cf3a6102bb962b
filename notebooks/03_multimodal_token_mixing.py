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
# # 03 · Native multimodal token mixing
#
# "Native multimodal" means that image tokens live in **the same sequence** as text tokens and go through
# **the same attention layers and the same experts** (docs/design.md §1.5). There is no separate image model that
# hands a summary to the language model: a small ViT turns pixels into vectors of the text hidden size, and
# those vectors simply take the place of placeholder tokens.
#
# This chapter follows an image through the pipeline and looks at what it changes for the engineering:
#
# 1. patchify and merge: how many tokens an image becomes;
# 2. the interleaved sequence, padded and packed batches;
# 3. token counts and cache memory per image size at full scale;
# 4. a tiny training run: can the model answer questions whose answers are only in the pixels?
# 5. routing by modality: do image tokens and text tokens use the same experts?
# 6. chunked prefill when images sit inside a long prompt.

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("LATENTMOE_SMOKE", "0") == "1"
TRAIN_STEPS = 30 if SMOKE else 400
TRAIN_KINDS = ("colour", "shape")
EVAL_SIZE = 48 if SMOKE else 240

# %%
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab import multimodal as mm
from latentmoe_lab.meta import format_bytes
from latentmoe_lab.viz import multimodal as viz
from latentmoe_lab.viz.notebook import explorer, use_notebook_renderer

use_notebook_renderer()  # figures also render in exported HTML and on GitHub
# The tiny model's matrices are small: on a small shared CPU, extra threads cost more than they bring.
torch.set_num_threads(1)
torch.manual_seed(0)
config = ModelConfig.from_preset("tiny")
processor = mm.ImageTextProcessor(config)
vision = config.vision
print(f"tiny preset: patch {vision.patch_size}, {vision.merge_size}x{vision.merge_size} merge, "
      f"tower hidden {vision.hidden_size} -> text hidden {config.hidden_size}")

# %% [markdown]
# ## 1. Patchify and merge
#
# An image of H x W pixels is cut into p x p patches (p = 14). The vision tower works on the patches;
# its attention is bidirectional inside one image, with **2D rotary positions** (half of each head's dims
# rotate with the patch row, half with the column), so any image size works without interpolating a
# position table. Then a **2x2 patch merger** concatenates each window of 2x2 neighbouring patches into one
# vector, and a projector (LayerNorm + MLP) maps it to the text hidden size. One merged window = one token:
#
# $$\text{tokens} = \frac{H}{p} \cdot \frac{W}{p} \cdot \frac{1}{m^2}$$
#
# The processor first resizes each side to the nearest multiple of $p \cdot m = 28$ pixels. Patches are
# stored window by window, so the merger is a reshape and the tokens come out in raster order of windows
# (the numbers below).

# %%
sample = mm.make_sample("shape", size=112, generator=torch.Generator().manual_seed(1))
viz.patch_grid_figure(sample.image, vision.patch_size, vision.merge_size)

# %%
for side in (28, 56, 112, 224, 448):
    print(f"{side:>4} x {side:<4} -> {mm.tokens_for_image(side, side, vision.patch_size, vision.merge_size):>4} tokens")

# %% [markdown]
# ## 2. The interleaved sequence
#
# A text marks each image with `<image>`. The processor replaces every marker by
# `<image_start>`, one `<image>` placeholder per merged window, and `<image_end>`, and puts all patches of
# all images into one `pixel_values` tensor with per-image `image_grids`. Inside the model, the i-th
# placeholder's embedding is replaced by the i-th feature of the vision tower. From there on, every layer
# treats image and text tokens alike.

# %%
texts = ["<image>What colour is the shape?", "Two pictures: <image> and <image>, which is larger?",
         "Text only, no image at all."]
images = [[sample.image], [torch.rand(3, 56, 56), torch.rand(3, 28, 84)], []]
batch = processor(texts, images)
print(processor.decode(batch.input_ids[1, :batch.lengths[1]]))
print("image grids (patch rows, cols):", batch.image_grids.tolist(), "| pixel_values", tuple(batch.pixel_values.shape))


# %%
def token_kinds(ids):
    names = {vision.image_token_id: "image", vision.image_start_id: "image_start", vision.image_end_id: "image_end",
             processor.pad_token_id: "pad"}
    return [names.get(int(i), "text") for i in ids]


hover = [[processor.decode([int(i)]) for i in row] for row in batch.input_ids]
viz.sequence_layout_figure([token_kinds(row) for row in batch.input_ids], hover, [f"sample {i}" for i in range(3)],
                           title=f"Padded batch: {mm.padding_fraction(batch):.0%} of the positions are <pad>")

# %% [markdown]
# **Padded vs packed.** Images make sequence lengths very uneven: one sample with a large image can be
# ten times longer than a text-only one, and right-padding the batch to the longest wastes the
# difference. The packed (varlen) layout puts the samples back to back in one row and records the
# boundaries as `cu_seqlens = (0, l_0, l_0 + l_1, ...)`. Then the layers must not mix sequences:
#
# - Gated DSA: each query gets a first visible key (its own sequence's start); the indexer's top-k and
#   the attention ignore everything before it.
# - KDA: the forget gate at each sequence's first token is set to $g = -1000$, so
#   $S' = e^{g} S_{t-1} = 0$ exactly: the recurrent state of the previous sequence is erased. The short
#   causal convolution also stops at the boundary.
# - Norms, FFNs and the MoE work token by token and need nothing.
#
# The check: the packed, padded and one-by-one forwards give the same logits.

# %%
packed = mm.pack(batch)
packed_hover = [[processor.decode([int(i)]) for i in packed.input_ids[0]]]
viz.sequence_layout_figure([token_kinds(packed.input_ids[0])], packed_hover, ["packed"],
                           title=f"Packed: one row, cu_seqlens = {packed.cu_seqlens.tolist()}")

# %%
model = LatentMoEForCausalLM(config).eval()
with torch.no_grad():
    padded_logits = mm.unpad(model(**batch.model_inputs()).logits, batch.attention_mask)
    packed_logits = mm.unpack(model(**packed.model_inputs()).logits, packed.cu_seqlens)
    for i, (text, sample_images) in enumerate(zip(texts, images)):
        alone = model(**processor(text, sample_images).model_inputs()).logits[0]
        print(f"sample {i}: max |padded - alone| = {(padded_logits[i] - alone).abs().max():.1e}, "
              f"max |packed - alone| = {(packed_logits[i] - alone).abs().max():.1e}")

# %% [markdown]
# ## 3. Token counts and memory per image size, at full scale
#
# At full scale (`k3-2.8t`: patch 14, 2x2 merge) a 1024 x 1024 image becomes 37 x 37 = 1369 image tokens
# (+2 for start and end), each of which the text model then carries like a text token. What grows:
#
# - the **latent cache** of the 24 Gated DSA layers: per token and layer, 512 + 64 latent values (bf16)
#   and one 128-value index key (FP8 + a scale);
# - the **vision tower's** work, which runs on 4x more positions (before the merge) with attention
#   quadratic in the patches of one image.
#
# What does not grow: the KDA layers' recurrent state, fixed at heads x d_k x d_v fp32 per layer.

# %%
full = ModelConfig.from_preset("k3-2.8t")
costs = mm.image_cost_table(full, [224, 448, 672, 896, 1024, 1344, 2048])
print(f"{'image':>10} {'patches':>8} {'tokens':>7} {'cache':>10} {'tower GFLOP':>12}")
for c in costs:
    print(f"{c.height:>4} x {c.width:<4} {c.patches:>8} {c.sequence_tokens:>7} {format_bytes(c.cache_bytes):>10} "
          f"{c.tower_flops / 1e9:>12,.0f}")
print(f"cache per token: {format_bytes(mm.cache_bytes_per_token(full))}; KDA state (any length): "
      f"{format_bytes(mm.cost.kda_state_bytes(full))}")
viz.image_cost_figure(costs)

# %% [markdown]
# ## 4. A tiny training run: answers that live only in the pixels
#
# Synthetic data (`latentmoe_lab.multimodal.synthetic`): a coloured square, circle or triangle, or a
# coloured digit, drawn at a random place and size on grey noise. The question names only what is asked
# ("What colour is the shape?"); the one-word answer is in the pixels and nowhere else. Each step draws
# fresh samples, so nothing can be memorised.
#
# Two loss curves: all answer tokens (falls fast even for a blind model, since after the first letter the
# word is fixed), and the **first answer token**, the one that decides. A model that ignores the image
# cannot push the first-token loss below the chance level $\overline{\ln(\#\text{answers})}$, nor its
# accuracy above chance.
#
# The synthetic set also draws digits (`kinds=("digit",)`); the tiny preset (a 2-layer, 32-wide tower)
# does not learn to read them in a few hundred CPU steps, so this run asks about colours and shapes.

# %%
torch.manual_seed(0)
vqa_model = LatentMoEForCausalLM(config)
result = mm.train_vqa(vqa_model, processor, steps=TRAIN_STEPS, batch_size=16, lr=3e-3, kinds=TRAIN_KINDS,
                      image_size=56, eval_size=EVAL_SIZE)
print(result.summary())
viz.training_curve_figure(result)

# %% [markdown]
# A few held-out answers, generated greedily with `model.generate` from the image and the question:

# %%
held_out = mm.make_samples(6, TRAIN_KINDS, size=56, seed=123)
for s in held_out:
    prompt = processor(s.prompt, s.image)
    out = vqa_model.generate(**prompt.model_inputs(), max_new_tokens=len(s.answer) + 1)
    answer = processor.decode(out[0, prompt.input_ids.shape[1]:])
    drawn = s.shape or f"digit {s.digit}"
    print(f"{s.question:<26} model: {answer!r:<12} truth: {s.answer!r:<10} ({s.colour} {drawn})")

# %% [markdown]
# ## 5. Routing by modality
#
# Image and text tokens share every MoE layer, but nothing forces them to pick the same experts. If image
# tokens concentrate on a few experts, an image-heavy batch overloads the devices holding them (expert
# parallelism), and capacity planning has to know. Below: the trained model routes a mixed batch of
# held-out images and questions; each heatmap shows, per layer, the share of one modality's expert
# assignments that each expert takes. **Overlap** is $\sum_e \min(\text{text}_e, \text{image}_e)$: 1 means
# the same distribution, 0 disjoint experts.

# %%
probe = mm.make_samples(32, TRAIN_KINDS, size=56, seed=7)
probe_batch = processor([s.text for s in probe], [[s.image] for s in probe])
routing = mm.routing_by_modality(vqa_model.eval(), probe_batch)
print(routing.summary(min_fraction=0.02))
text_share, image_share = routing.fractions()
viz.modality_routing_figure(text_share, image_share, routing.layer_labels)

# %%
viz.modality_overlap_figure(routing.overlap(), routing.shared_experts(min_fraction=0.02), config.moe.num_experts,
                            routing.layer_labels,
                            title="Experts taking > 2% of both modalities' assignments, and the load overlap")

# %% [markdown]
# ## 6. Chunked prefill with images inside the prompt
#
# Long prompts are prefilled in chunks over the cache. Text can be cut anywhere. An image span can be cut
# too (the model does not care where a chunk ends), but the vision tower runs on whole images: the
# features of an image cut in two must be computed once and kept until its second half is prefilled.
# The simpler policy keeps every image span inside one chunk: a boundary inside a span moves back to the
# span's start. Costs of that policy:
#
# - chunks become uneven (a short chunk before each image);
# - a span longer than the chunk size forces one oversized chunk; at full scale a 1024 x 1024 image is
#   1371 tokens, a 2048 x 2048 one 5478, so the chunk size must cover the largest accepted image or
#   the scheduler must carry features across chunks;
# - the tower's work lands in the chunk that holds the image, a latency spike for that step.
#
# Either way the chunked prefill gives the logits of one forward, up to one effect of sparse attention:
# chunked and one-pass index scores differ in their last bits (different matmul shapes), which can flip a
# near-tie in the indexer's top-k at a few positions. With a top-k that covers every key the two agree to
# float precision.

# %%
long_images = [torch.rand(3, 56, 56), torch.rand(3, 112, 84), torch.rand(3, 28, 56)]
long_prompt = processor("A long interleaved document. <image> Some text between the pictures, a few words. "
                        "<image> More text. <image> And the end of it.", long_images)
ids = long_prompt.input_ids[0]
spans = mm.image_spans(ids, vision)
policies = {"cut anywhere": mm.prefill_chunks(ids, 24, vision, keep_images_whole=False),
            "keep images whole": mm.prefill_chunks(ids, 24, vision)}
viz.chunk_sizes_figure(policies, spans, title="Prefill chunks of at most 24 tokens")

# %%
@torch.no_grad()
def chunked_vs_one_pass(net):
    """Per-position max |logit difference| between the image-aware chunked prefill and one forward."""
    one_pass = net(**long_prompt.model_inputs()).logits
    cache, pieces = net.new_cache(), []
    for start, end in policies["keep images whole"]:
        pixel_values, grids = mm.select_images(long_prompt.pixel_values, long_prompt.image_grids,
                                               mm.images_in_chunk(spans, start, end))
        pieces.append(net(ids[None, start:end], pixel_values, cache, grids).logits)
    return (torch.cat(pieces, dim=1) - one_pass).abs().amax(-1)[0]


full_topk = LatentMoEForCausalLM(config.replace(indexer={**vars(config.indexer), "topk": len(ids)})).eval()
full_topk.load_state_dict(model.state_dict())
for name, net in (("top-32 of the tiny preset", model), ("top-k covering every key", full_topk)):
    diff = chunked_vs_one_pass(net)
    print(f"{name:<26}: max |diff| = {diff.max():.1e}; positions above 1e-4: {(diff > 1e-4).nonzero().flatten().tolist()}")

# %% [markdown]
# ## Explore: tokens and cache for any image size
#
# Move the sliders: the patch grid is drawn at the tiny preset's patch size; the numbers are for the
# full-scale model.

# %%
import ipywidgets


def explore(height=112, width=168):
    cost = mm.image_cost(full, height, width)
    image = mm.make_sample("shape", size=28).image
    patches, grid = mm.patchify(torch.nn.functional.interpolate(image[None], size=(height, width))[0],
                                vision.patch_size, vision.merge_size)
    shown = mm.unpatchify(patches, grid, vision.patch_size, vision.merge_size, vision.in_channels)
    return viz.patch_grid_figure(shown, vision.patch_size, vision.merge_size,
                                 title=f"{height}x{width}: {cost.image_tokens} image tokens at full scale, "
                                       f"{format_bytes(cost.cache_bytes)} of cache")


explorer(explore, height=ipywidgets.IntSlider(value=112, min=28, max=224, step=28, description="height"),
         width=ipywidgets.IntSlider(value=168, min=28, max=224, step=28, description="width"))

# %% [markdown]
# ## Try it with your own image
#
# ```python
# prompt = processor("<image>What colour is the shape?", "my_picture.png")  # a path, a PIL image or a tensor
# out = vqa_model.generate(**prompt.model_inputs(), max_new_tokens=8)
# print(processor.decode(out[0, prompt.input_ids.shape[1]:]))
# ```
#
# `vqa_model` from section 4 names a colour; a model with random weights answers noise.
