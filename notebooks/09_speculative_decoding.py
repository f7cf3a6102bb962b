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
# # 09 · Speculative decoding on a hybrid model
#
# A decode step reads every weight and the whole cache to produce one token per sequence. Speculative
# decoding guesses K tokens cheaply and lets the target check all of them in one forward: K + 1 query
# tokens per sequence, so a step can emit up to K + 1 tokens. On a hybrid model the hard part is the
# recurrent state: after a rejected guess the KDA state and conv tail are wrong. This chapter follows
# `latentmoe_lab.serving.spec` (docs/design.md §12):
#
# 1. two drafters: prompt lookup (n-gram) and the model's own multi-token-prediction (MTP) head;
# 2. acceptance per draft position on Python code;
# 3. the slot picture of one verify step: K + 1 KDA slots, the slot of the last accepted token kept, no copy;
# 4. exactness: greedy tokens with and without speculation, and the prefix cache after many rejections;
# 5. tokens/s with and without.
#
# The trained mini model with an MTP head (`make model-mtp`, checkpoints/mini-stdlib-mtp) is used when it
# exists; otherwise a random-weight model stands in, whose drafts are rarely right (acceptance near 0).

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("LATENTMOE_SMOKE", "0") == "1"
CHECKPOINT = "../checkpoints/mini-stdlib-mtp"
K = 3
NUM_PROMPTS = 2 if SMOKE else 8
PROMPT_BYTES = 48 if SMOKE else 384
NEW_TOKENS = 6 if SMOKE else 96

# %%
import time
from pathlib import Path

import plotly.graph_objects as go
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.spec import ngram_proposal
from latentmoe_lab.training.corpus import is_held_out, source_files, stdlib_root
from latentmoe_lab.viz.notebook import use_notebook_renderer

use_notebook_renderer()
torch.manual_seed(0)
if Path(CHECKPOINT).is_dir() and not SMOKE:
    model = LatentMoEForCausalLM.from_pretrained(CHECKPOINT).float().eval()
    print(f"trained model from {CHECKPOINT}: mtp_depth {model.config.mtp_depth}")
else:
    model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny").replace(mtp_depth=1, vision=None)).eval()
    print("random-weight tiny model with an MTP head (train one with `make model-mtp`)")

root, prompts = stdlib_root(), []
for path in source_files(root):  # the training corpus's held-out files (its split is by path alone)
    relative = path.relative_to(root).as_posix()
    if is_held_out(relative, 0.02) and len(prompts) < NUM_PROMPTS:
        text = f"# file: {relative}\n" + path.read_bytes().decode("utf-8", errors="replace")
        prompts.append(list(text.encode("utf-8")[:PROMPT_BYTES]))
print(f"{len(prompts)} held-out code prompts of {PROMPT_BYTES} bytes")


def service(method=None, k=K, batch=1, prefix=False):
    spec = None if method is None else {"method": method, "num_speculative_tokens": k}
    return ServiceConfig.from_dict({"model": {"max_model_len": PROMPT_BYTES + NEW_TOKENS + 16},
                                    "memory": {"cache_bytes": 32 << 20, "block_size": 16, "max_num_seqs": batch,
                                               "prefix_cache": {"enabled": prefix, "snapshot_slots": 64}},
                                    "scheduler": {"prefill_chunk_size": 512}, "speculative": spec})


# %% [markdown]
# ## 1. Two drafters
#
# **n-gram (prompt lookup)**: the longest suffix of the request's tokens (prompt_lookup_max down to
# prompt_lookup_min long) that occurred earlier proposes the tokens that followed it. Code repeats itself
# (names, `self.`, indentation), so it costs nothing and is often right. **MTP**: the head trained beside the
# model (depth k reads the hidden state and the next token's embedding, one decoder block, the shared LM
# head) proposes greedy drafts from the target's last hidden states.

# %%
tokens = list(b"    def close(self):\n        self.file.close()\n    def flush(self):\n        self.")
draft = ngram_proposal(tokens, K, 1, 4)
print("context ends with", repr(bytes(tokens[-12:]).decode()), "-> n-gram drafts", repr(bytes(draft).decode()))

# %% [markdown]
# ## 2. Acceptance per draft position
#
# Greedy requests over the held-out prompts; the engine counts drafts verified and accepted per position
# (Engine.stats(), and /metrics under vLLM's `spec_decode_*` names). Position i is accepted only if every
# position before it was, so the rate falls with i. The mean accepted length is the tokens a verify step
# emits: accepted drafts + 1.

# %%
runs = {}
for method in ["ngram", "mtp"]:
    engine = Engine(model, service(method))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False)
    runs[method] = (engine.stats(), [o.token_ids for o in outputs])
    stats = runs[method][0]
    print(f"{method:>5}: {stats['spec_draft_tokens']} drafts, {stats['spec_accepted_tokens']} accepted, "
          f"mean accepted length {stats['spec_mean_accepted_length']:.2f}")
figure = go.Figure([go.Bar(name=method, x=[f"draft {i + 1}" for i in range(K)],
                           y=runs[method][0]["spec_acceptance_rate_per_position"]) for method in runs])
figure.update_layout(title="acceptance rate per draft position", yaxis_title="accepted / verified",
                     barmode="group", height=320)
figure

# %% [markdown]
# ## 3. The slot picture of one verify step
#
# With K = 3 a sequence holds K + 1 = 4 KDA slots: its slot and 3 spares. A verify step feeds x0 (its newest
# token) and d1 d2 d3; KDA runs them one recurrent step at a time and writes the state and conv tail after
# token t into verify slot t. If j drafts are accepted the state after x0 d1 .. dj sits in verify slot j:
# that slot becomes the sequence's slot. No state is copied back, whatever j. DSA rows of rejected drafts
# stay in their blocks past the sequence length, where nothing reads them, and are overwritten later.
#
# Below, one request steps through the engine with a drafter that knows the greedy continuation and
# spoils its last guess, so every step accepts K - 1 drafts.

# %%
from latentmoe_lab.serving.spec.drafters import Drafter


class KnowsTheAnswer(Drafter):
    name = "oracle"

    def __init__(self, full):
        self.full = full

    def propose(self, request_id, draft_input, k):
        good = self.full[len(draft_input.tokens):len(draft_input.tokens) + k]
        return good[:-1] + [(good[-1] + 1) % 256] if len(good) > 1 else good


prompt = prompts[0][:48]
full = model.generate(torch.tensor([prompt]), 16)[0].tolist()
engine = Engine(model, service("ngram"))
engine.speculator.drafter = KnowsTheAnswer(full)
request = engine.add_request(prompt, SamplingParams(max_tokens=12))
seq = engine.sequence(request)
rows = []
while engine.has_unfinished():
    slot, spares, drafts = seq.slot, list(seq.spare_slots), len(seq.draft_ids)
    verify_slots = [slot] + spares[:drafts]  # where the state after x0, d1, .. goes (spec/slots.start_verify)
    outputs = engine.step()
    emitted = outputs[0].new_token_ids if outputs else []
    if drafts:
        accepted = len(emitted) - 1
        rows.append(f"slot {slot}, spares {spares}: verify x0 + {drafts} drafts into slots {verify_slots}; "
                    f"{accepted} accepted -> keep slot {verify_slots[accepted]} "
                    f"(now slot {seq.slot}, spares {seq.spare_slots})")
print("\n".join(rows))

# %% [markdown]
# ## 4. Exact, and no poisoned prefix cache
#
# Greedy speculation changes nothing but the speed: every method's tokens equal the plain engine's. A
# prefix-cache snapshot is only taken at an accepted boundary, from the spec slot of the token exactly at
# the block edge; requests that extend the speculated ones hit those blocks and still get the logits of a
# fresh engine (tests/test_spec_engine.py checks it after runs full of rejections).

# %%
plain = Engine(model, service()).generate(prompts, SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False)
for method, (_, tokens) in runs.items():
    print(f"{method}: greedy tokens equal the plain engine's: {tokens == [o.token_ids for o in plain]}")
cached = Engine(model, service("ngram", prefix=True))
first = cached.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False)
extended = [p + o.token_ids + list(b"\n") for p, o in zip(prompts, first)]
params = SamplingParams(max_tokens=4, logprobs=0)
hit = cached.generate(extended, params, use_tqdm=False)
fresh = Engine(model, service()).generate(extended, params, use_tqdm=False)
gap = max(abs(a.logprob - b.logprob) for h, f in zip(hit, fresh) for a, b in zip(h.logprobs, f.logprobs))
print(f"prefix-hit tokens {cached.stats()['prefix_hit_tokens']}; largest logprob gap to a fresh engine {gap:.1e}")

# %% [markdown]
# ## 5. Tokens per second with and without
#
# One request at a time (batch 1), greedy, the same prompts. A verify step costs a little more than a decode
# step (K + 1 tokens through every layer, K more logits rows, the drafter), so speculation pays when the mean
# accepted length is well above 1. benchmarks/bench_spec.py measures the full grid (batch 1 and 8, 1 and 2
# threads; benchmarks/RESULTS.md).

# %%
speeds = {}
for method in [None, "ngram", "mtp"]:
    engine = Engine(model, service(method))
    start = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False)
    speeds[method or "off"] = sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)
for name, speed in speeds.items():
    print(f"{name:>5}: {speed:7.1f} tokens/s  ({speed / speeds['off']:.2f}x)")
