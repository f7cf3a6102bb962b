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
# # 06 · Long-context serving: paged hybrid cache, continuous batching, prefix caching
#
# `model.generate` serves one batch of equal-length prompts over a contiguous cache. A server holds many
# requests of every length at once, adds and drops them every step, and must never run out of memory in
# the middle of one. This chapter follows `latentmoe_lab.serving` (docs/design.md §6) on a real run:
#
# 1. the paged cache: DSA blocks, one block table per sequence, and KDA slots;
# 2. chunked prefill: peak memory as the chunk size changes;
# 3. what grows with context (DSA blocks) and what does not (the KDA state);
# 4. one engine run whose steps mix prefills and decodes, as a timeline;
# 5. preemption when blocks run out, prefix hits that skip recomputation, and logits that are bit for bit
#    independent of the batch;
# 6. the full-scale table: one 1M-token sequence in bf16 and fp8 against the public GQA example;
# 7. why the indexer cache must be counted;
# 8. a host tier for the DSA rows (top-k swapped into device hot buffers) and the 1M-token decode roofline.
#
# The engine runs the tiny preset here (every step is a real model forward on a CPU); the full-scale
# numbers come from the planner, which allocates nothing.

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("LATENTMOE_SMOKE", "0") == "1"
PRESET = "tiny"
NUM_REQUESTS = 6 if SMOKE else 24
PROMPT_RANGE = (8, 64) if SMOKE else (16, 400)
NEW_TOKENS = 4 if SMOKE else 24
LONG_PROMPT = 512 if SMOKE else 4000
CHUNK_SIZES = [64, 256] if SMOKE else [64, 256, 1024, 4000]
SHARED_PREFIX = 64 if SMOKE else 1024

# %%
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.analysis.memory import PeakMemory
from latentmoe_lab.meta import format_bytes
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.invariance import recorded_logits
from latentmoe_lab.serving.service_plan import per_sequence_bytes, per_sequence_text, service_plan_text
from latentmoe_lab.serving.bench_workload import run_workload, synthetic_workload
from latentmoe_lab.viz import serving as viz
from latentmoe_lab.viz.notebook import use_notebook_renderer

use_notebook_renderer()
torch.manual_seed(0)
config = ModelConfig.from_preset(PRESET)
model = LatentMoEForCausalLM(config).eval()


def service(max_model_len=4096, chunk=256, prefix=False, cache_bytes=8_000_000, max_num_seqs=8, block=16,
            chunked=True):
    return ServiceConfig.from_dict({
        "model": {"max_model_len": max_model_len},
        "memory": {"cache_bytes": cache_bytes, "block_size": block, "max_num_seqs": max_num_seqs,
                   "prefix_cache": {"enabled": prefix}},
        "scheduler": {"prefill_chunk_size": chunk, "chunked_prefill": chunked, "max_batch_size": 64}})


print(config.layer_types)

# %% [markdown]
# ## 1. The paged cache on a real run
#
# The planner turns `memory.cache_bytes` into blocks and slots. One block id names the same token range
# in every DSA layer's pools (latent + rope, index keys), so each sequence has a single block table. Each
# running sequence owns one KDA slot: the fp32 state and conv tail of every KDA layer. Below: three prompts
# admitted, a few steps run, then the engine's own bookkeeping.

# %%
engine = Engine(model, service(chunk=48))
print(engine.plan.table())
for length in (5, 40, 70):
    engine.add_request(list(range(1, length + 1)), SamplingParams(max_tokens=8))
for _ in range(3):
    engine.step()
for seq in engine.scheduler.running:
    print(f"request {seq.request_id}: {seq.num_tokens} tokens, {seq.num_computed} in the pools, "
          f"slot {seq.slot}, block table {seq.block_table}")
print(engine.stats())
while engine.has_unfinished():
    engine.step()
print("after the last request:", {k: engine.stats()[k] for k in ("blocks_used", "slots_used")})

# %% [markdown]
# ## 2. Chunked prefill: peak memory against chunk size
#
# A long prompt prefilled in chunks keeps only one chunk's activations alive at a time; the KDA state and
# conv tail wait in the slot between chunks and the DSA keys in the blocks. The DSA layers read the pool
# block-wise (`ops/paged_sparse.py`: the indexer scores one range of blocks at a time with a running top-k, and
# attention gathers only the selected rows), so no chunk holds the whole context's keys or scores: the peak
# follows the chunk size, not the context before it (benchmarks/RESULTS.md: 7.23 MiB beyond the cache after
# 64k and after 128k tokens). `PeakMemory` counts the tensor storage allocated during the steps, beyond the
# pools that were allocated before.

# %%
peaks = {}
prompt = torch.randint(0, 256, (LONG_PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
for chunk in CHUNK_SIZES:
    engine = Engine(model, service(chunk=chunk, max_num_seqs=1))
    engine.add_request(prompt, SamplingParams(max_tokens=1))
    with PeakMemory() as memory:
        while engine.has_unfinished():
            engine.step()
    peaks[chunk] = memory.peak_bytes
    print(f"chunk {chunk:>5}: {engine.stats()['steps']:>3} steps, peak {format_bytes(memory.peak_bytes)} beyond "
          f"the {format_bytes(engine.plan.total_bytes)} pools")

# %% [markdown]
# ## 3. What grows with context
#
# Per sequence, the DSA blocks grow with every token; the KDA slot is the same size at 10 tokens and at a
# million. With 3 KDA layers for every DSA layer, most layers carry a constant-size state.

# %%
import plotly.graph_objects as go

plan = Engine(model, service()).plan
lengths = [2 ** k for k in range(4, 13)]
fig = go.Figure([
    go.Scatter(x=lengths, y=[-(-n // plan.block_size) * plan.block_bytes for n in lengths], name="DSA blocks"),
    go.Scatter(x=lengths, y=[plan.slot_bytes] * len(lengths), name="KDA slot (state + conv)"),
])
fig.update_layout(title=f"Cache bytes of one sequence ({PRESET})", xaxis_type="log", yaxis_type="log",
                  xaxis_title="tokens", yaxis_title="bytes")
fig

# %% [markdown]
# ## 4. One run, prefills and decodes in the same steps
#
# Poisson arrivals of mixed-length prompts (a quarter with an image). Each step spends a token budget:
# first one token for every running sequence that is decoding, then prefill chunks. There is no prefill
# phase and no decode phase.

# %%
engine = Engine(model, service(chunk=128, prefix=True))
requests = synthetic_workload(NUM_REQUESTS, rate=8.0, min_prompt=PROMPT_RANGE[0], max_prompt=PROMPT_RANGE[1],
                              max_tokens=NEW_TOKENS, image_fraction=0.25, vocab_size=config.vocab_size, seed=0)
outputs = run_workload(engine, requests)
mixed = [s for s in engine.log.steps if s.prefill_tokens and s.decode_tokens]
print(f"{len(engine.log.steps)} steps, {len(mixed)} of them mixed prefill and decode tokens")
viz.timeline_figure(engine.log.steps, engine.block_manager.num_blocks)

# %%
from latentmoe_lab.serving.metrics import format_table, summarize

print(format_table(summarize([o.metrics for o in outputs])))
viz.latency_histograms([o.metrics for o in outputs])

# %% [markdown]
# ## 5. Preemption and prefix hits
#
# With too few blocks, the newest running sequence gives back its blocks and slot and is recomputed later
# (prompt + the tokens it already generated). With prefix caching, a full block is named by a hash chain of
# its tokens (and image contents); a hit also needs a KDA snapshot at the same length, taken at
# block-aligned chunk ends. The greedy outputs are the same in every case.

# %%
prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (40, 60, 80, 100, 120, 140)]
params = SamplingParams(max_tokens=16)
roomy = Engine(model, service(max_model_len=256, chunk=256))
seventeen_blocks = plan.pool_rows * plan.slot_bytes + 17 * plan.block_bytes  # one 256-token sequence + 1
tight = Engine(model, service(max_model_len=256, chunk=256, cache_bytes=seventeen_blocks))
reference = [o.token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
squeezed = [o.token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
print(f"{tight.plan.num_blocks} blocks: {tight.stats()['preemptions']} preemptions, outputs equal: "
      f"{squeezed == reference}")

shared = torch.randint(0, 256, (SHARED_PREFIX,), generator=torch.Generator().manual_seed(7)).tolist()
family = [shared + [i, i + 1, i + 2] for i in range(8)]
for prefix in (False, True):
    engine = Engine(model, service(chunk=256, prefix=prefix))
    engine.generate(family[:1], params, use_tqdm=False)
    rest = engine.generate(family[1:], params, use_tqdm=False)
    stats = engine.stats()
    print(f"prefix caching {'on ' if prefix else 'off'}: {stats['prefill_tokens']:>6} prefill tokens computed, "
          f"{stats['prefix_hit_tokens']:>6} taken from the cache, mean TTFT of the 7 followers "
          f"{sum(o.metrics.ttft for o in rest) / len(rest) * 1e3:.0f} ms")

# %% [markdown]
# ### Bit for bit
#
# Equal greedy outputs are one thing; equal logits are another. In fp32 a request's logits move by an ulp
# or so with its company: the KDA chunked form sums in an order set by where each chunk starts, and the
# CPU's matrix products round a row by the shape of the whole batch (a product of 1, 2 or 3 rows takes
# another kernel than one of 16). A random model's nearly flat logits turn such an ulp into another greedy
# token now and then. `scheduler.batch_invariant` removes all three causes (docs/design.md §6.5): chunks
# end on the model's chunk grid, every product is padded to at least 16 rows and columns, and the
# activations are forms whose bits do not depend on an element's place in the tensor. Below, one prompt is
# served alone and then last in a busy batch at a smaller budget; what changes in the logits it samples from?

# %%
def sampled_logits(engine, prompts, params):
    """{(prompt index, position): the logits row a token was sampled from}, serving prompts together."""
    with recorded_logits(engine) as rows:
        outputs = engine.generate(prompts, params, use_tqdm=False)
    index_of = {o.request_id: i for i, o in enumerate(outputs)}
    return {(index_of[rid], pos): row for (rid, pos), row in rows.items()}


def invariant_service(chunk, invariant):
    cfg = service(chunk=chunk, block=64)
    cfg.scheduler.batch_invariant = invariant
    return cfg


crowd = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
         for n in (300, 2, 130, 77, 190, 12)]
target = prompts[-1]
for invariant in (False, True):
    alone = sampled_logits(Engine(model, invariant_service(512, invariant)), [target], params)
    busy = sampled_logits(Engine(model, invariant_service(128, invariant)), crowd + [target], params)
    worst = max(float((busy[(len(crowd), pos)] - row).abs().max()) for (_, pos), row in alone.items())
    print(f"batch_invariant {str(invariant):5}: largest |logit change| over {len(alone)} sampled rows = {worst:.2e}")

# %% [markdown]
# ## 6. The full-scale table: one 1M-token sequence
#
# k3-2.8t has 24 Gated DSA layers and 69 KDA layers. Per DSA layer and token the cache holds the MLA
# latent (512) and rope key (64), plus the indexer key (128), with a 4-byte scale per row in fp8. The KDA
# state is 96 heads x 128 x 128 fp32 per layer, whatever the length. The public GQA example (80 layers,
# 8 KV heads x 128, 1 byte) needs 163.8 GB for the same million tokens.

# %%
full = ModelConfig.from_preset("k3-2.8t")
print(per_sequence_text(full, 1_000_000))

# %% [markdown]
# And the per-device plan of the public service example (TP 8 x EP 8 x PP 2, FP8): weights from the meta
# device, caches from the planner. Nothing is allocated.

# %%
example = ServiceConfig.from_dict({
    "model": {"name": "large-moe-model", "max_model_len": 1000000, "dtype": "fp8"},
    "parallel": {"tensor_parallel_size": 8, "expert_parallel_size": 8, "pipeline_parallel_size": 2},
    "memory": {"kv_cache_dtype": "fp8", "gpu_memory_utilization": 0.92, "enable_paged_attention": True,
               "max_num_seqs": 64},
    "scheduler": {"max_batch_size": 256, "chunked_prefill": True, "prefill_chunk_size": 8192}})
print(service_plan_text(example, full))

# %% [markdown]
# ## 7. Why the indexer cache must be counted
#
# The lightning indexer keeps its own key per token and DSA layer, next to the MLA latent. A planner that
# sized blocks from the latent alone would hand out more blocks than fit: below, the bytes the indexer adds
# per token, and how far a "latent-only" plan of a 90 GB budget overruns it once the index keys are written.

# %%
fp8 = per_sequence_bytes(full, 1, "fp8")
latent_only, with_index = fp8["dsa_latent"], fp8["dsa_latent"] + fp8["dsa_index"]
budget = 90e9
tokens_planned = budget // latent_only
print(f"per token, all DSA layers: latent {latent_only} B, + indexer {fp8['dsa_index']} B "
      f"(+{fp8['dsa_index'] / latent_only:.0%})")
print(f"latent-only plan of {format_bytes(budget)}: {tokens_planned:,.0f} tokens, which really need "
      f"{format_bytes(tokens_planned * with_index)}: {format_bytes(tokens_planned * with_index - budget)} over")

# %% [markdown]
# ## 8. A host tier for the DSA rows, and the 1M-token decode roofline
#
# A decode step of a DSA layer scores every index key but attends over only its top-k latent rows. With
# `memory.offload` (docs/design.md §15.1) the latent rows live in host memory and each running sequence
# keeps `hot_rows_per_layer` of them on the device: the top-k selection is swapped in before attention,
# rows already hot are not moved. Below, one engine with the tier and one without serve the same prompts;
# the tokens must agree, and the device keeps only the index keys, the hot buffers and the KDA slots.

# %%
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.hardware import HARDWARE
from latentmoe_lab.parallel.planner import EXAMPLE_LAYOUTS
from latentmoe_lab.parallel.roofline import decode_roofline, decode_roofline_text
from latentmoe_lab.serving.cache_tiers.offload_plan import request_tier_text

HOT_ROWS = 2 * config.indexer.topk


def offload_service(hot_rows=HOT_ROWS):
    plain = service(max_model_len=LONG_PROMPT + 64, cache_bytes=4_000_000, max_num_seqs=2)
    return ServiceConfig.from_dict(plain.to_dict() | {"memory": plain.to_dict()["memory"] | {
        "offload": {"host_cache_bytes": 4_000_000, "hot_rows_per_layer": hot_rows}}})


tier_prompts = [torch.randint(0, config.vocab_size, (n,)).tolist() for n in (LONG_PROMPT, 40)]
tier_params = SamplingParams(max_tokens=NEW_TOKENS)
plain_tokens = [o.token_ids for o in Engine(model, service(max_model_len=LONG_PROMPT + 64, max_num_seqs=2))
                .generate(tier_prompts, tier_params, use_tqdm=False)]
tiered = Engine(model, offload_service())
tier_tokens = [o.token_ids for o in tiered.generate(tier_prompts, tier_params, use_tqdm=False)]
print("same tokens with and without the host tier:", tier_tokens == plain_tokens)
print(tiered.plan.table())
print({kind: format_bytes(value) for kind, value in tiered.runner.pools.nbytes().items()})
print(tiered.runner.pools.stats())

# %% [markdown]
# Bytes moved per decode step against the context length: one request at a time, 16 decode steps each,
# the rows swapped into the hot buffer per step after the first (which fills it). A selection that moves
# little from one token to the next moves few rows; the top-k line is the worst case (every row new).

# %%
contexts = [128, 512] if SMOKE else [256, 1024, 2048, 4000]
moved_per_step = {}
for context in contexts:
    engine = Engine(model, offload_service())
    engine.add_request(torch.randint(0, config.vocab_size, (context,)).tolist(), SamplingParams(max_tokens=17))
    engine.step()
    while engine.scheduler.num_unfinished and engine.runner.pools.stats()["rows_moved"] == 0:
        engine.step()  # the prompt's chunks, up to the first decode (it fills the hot buffer)
    counts = []
    while engine.scheduler.num_unfinished:
        before = engine.runner.pools.stats()["rows_moved"]
        engine.step()
        counts.append(engine.runner.pools.stats()["rows_moved"] - before)
    moved_per_step[context] = sum(counts) / max(1, len(counts))
row_bytes = tiered.runner.pools.layers[config.layer_types.index("dsa")].hot.row_bytes
topk_rows = config.num_dsa_layers * config.indexer.topk
for context, rows in moved_per_step.items():
    print(f"context {context:>5}: {rows:5.1f} of {topk_rows} top-k rows moved per decode step "
          f"({rows * row_bytes:,.0f} bytes)")

import plotly.graph_objects as go

figure = go.Figure([go.Scatter(x=list(moved_per_step), y=[r * row_bytes for r in moved_per_step.values()],
                               mode="lines+markers", name="moved into hot buffers"),
                    go.Scatter(x=list(moved_per_step), y=[topk_rows * row_bytes] * len(moved_per_step),
                               mode="lines", name="every top-k row (no reuse)", line={"dash": "dot"})])
figure.update_layout(title="Host -> device bytes per decode step (tiny preset)", xaxis_title="context tokens",
                     yaxis_title="bytes per step", height=380)
figure.show()

# %% [markdown]
# At full scale: one 1M-token request's bytes on each tier (fp8, hot buffers of 2 x top-k rows), then the
# decode roofline of one token at 1M on H200 for the serving layout of the write-ups, with and without the
# host tier (the swap priced at PCIe Gen5 x16 for every top-k row: the upper bound), and with index sharing.
# The indexer's scan of every key is the cost that grows with the context; the top-k rows are 1% of it.

# %%
print(request_tier_text(full, 1_000_000))
h200 = HARDWARE["H200-141GB"]
serving_layout = next(p for name, (p, _) in EXAMPLE_LAYOUTS.items() if "serving" in name)
for swap, shared in ((None, 1), (1.0, 1), (None, 2)):
    print(decode_roofline_text(full.replace(dsa={"index_share_every": shared}), serving_layout, h200,
                               2 ** 20, swap_fraction=swap))

# %%
layouts = {name.split(" (")[0]: p for name, (p, _) in EXAMPLE_LAYOUTS.items()}
parts = {name: decode_roofline(full, p, h200, 2 ** 20) for name, p in layouts.items()}
figure = go.Figure([go.Bar(name=part, x=list(parts), y=[rows[part]["seconds"] * 1e3 for rows in parts.values()])
                    for part in next(iter(parts.values())) if part != "total"
                    and any(rows[part]["layers"] for rows in parts.values())])
figure.update_layout(barmode="stack", title="One decode token at 1M context, k3-2.8t on H200: ms by part",
                     yaxis_title="ms per token (one sequence)", height=420)
figure.show()
