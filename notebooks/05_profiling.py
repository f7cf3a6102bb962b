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
# prompt length? Then: what does a trace show, do ranks really hide their communication, what does
# `torch.compile` buy, and where would the time go on the serving cluster?
#
# 1. `prefill_decode_profile`: wall time per component (embeddings, KDA, Gated DSA, LatentMoE, dense FFN,
#    head), measured with forward hooks on the top-level parts of each block, for prefill and for decode;
# 2. the same for growing prompts, to see which parts grow linearly and which do not;
# 3. `top_ops`: the heaviest PyTorch ops under `torch.profiler`;
# 4. `trace(fn, path)`: a chrome trace of one prefill and one decode step, to open in a browser, and its
#    summary by `record_function` label (`attn.kda`, `moe.experts`, ...);
# 5. `parallel.timeline.record_timelines`: compute and communication per rank of an EP2 forward, and how
#    much of the token All-to-All runs under the shared experts;
# 6. eager against `torch.compile` for the decode step and chunked KDA;
# 7. the planner's roofline (`parallel.planner`) for the serving layout TP8 x EP8 x PP2 on real GPUs.
#
# On a GPU the same calls work (the hooks synchronise, `trace` adds CUDA activity), and `backend="auto"`
# picks the Triton kernels. The package map is docs/design.md §2 (the profiling and parallel rows).

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("LATENTMOE_SMOKE", "0") == "1"
PRESET = "tiny" if SMOKE else "small"
PROMPT_LEN = 64 if SMOKE else 512
DECODE_STEPS = 4 if SMOKE else 32
SCALING_LENS = [16, 32, 64] if SMOKE else [128, 256, 512, 1024, 2048]
TRACE_LEN = 32 if SMOKE else 256  # prompt tokens of the traced prefill (and of the cache before the decode step)
TIMELINE_LAYOUTS = [dict(ep=2)] if SMOKE else [dict(ep=2), dict(ep=2, tp=2)]  # ParallelConfig arguments
COMPILE = not SMOKE  # inductor's first compiles take minutes on a loaded 2-core machine: smoke skips them

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
# ## 4. A trace to open
#
# `latentmoe_lab.profiling.trace(fn, path)` calls `fn` once to warm up, then once under `torch.profiler`,
# and writes the profiler's chrome trace. The callables come from `profiling/steps.py`: `prefill_step`
# (a fresh cache, the whole prompt in one forward) and `decode_step` (the prompt prefilled once, then one
# token per call). Every layer opens a `record_function` span around each step (`attn.kda`,
# `attn.dsa.indexer`, `attn.dsa.attend`, `moe.route`, `moe.dispatch`, `moe.experts`, `moe.combine`,
# `moe.shared`; `profiling/labels.py`), so the trace shows the model's structure above the aten ops.
# `validate_chrome_trace` checks the Trace Event Format fields that chrome://tracing reads, and
# `trace_summary` reads the file back: the heaviest ops and the exclusive time of each label.

# %%
import tempfile
from pathlib import Path

from latentmoe_lab.profiling import load_chrome_trace, trace
from latentmoe_lab.profiling.summary import trace_summary, write_trace_summary
from latentmoe_lab.profiling.steps import decode_step, prefill_step

# smoke runs (the tests) write to a temporary folder; a full run keeps its traces next to this notebook
# (notebooks/reports/profile; printed relative to it, so the saved output names no folder of this machine)
trace_dir = Path(tempfile.mkdtemp(prefix="latentmoe-05-")) if SMOKE else Path("reports/profile")
steps = {"prefill": prefill_step(model, 1, TRACE_LEN), "decode": decode_step(model, 1, TRACE_LEN)}
summaries = {}
for phase, step in steps.items():
    path = trace(step, trace_dir / f"{PRESET}-{phase}.trace.json")
    recorded = load_chrome_trace(path)  # parses the file and runs validate_chrome_trace on it
    summaries[phase] = trace_summary(recorded, row_limit=8)
    html = write_trace_summary(path, path.with_suffix("").with_suffix(".html"), f"{PRESET} {phase}")
    print(f"{phase}: {path if not SMOKE else path.name} ({path.stat().st_size / 2 ** 20:.1f} MiB, {len(recorded['traceEvents'])} events, "
          f"valid); HTML summary {html.name}")
print("\nopen a trace in chrome://tracing (Load) or https://ui.perfetto.dev (Open trace file)")

# %%
for phase, summary in summaries.items():
    wall = summary["wall_s"]
    labels = sorted(summary["components"].items(), key=lambda item: item[1], reverse=True)
    labelled = sum(seconds for _, seconds in labels)
    print(f"{phase} ({TRACE_LEN}-token prompt): recorded call {wall * 1e3:.1f} ms, "
          f"labelled spans {labelled / wall:.0%} of it")
    print("  by label (exclusive):  " + ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in labels))
    print("  top ops (exclusive):   " + ", ".join(f"{name} {seconds * 1e3:.1f} ms"
                                                 for name, seconds in summary["top_ops"][:6]))

# %% [markdown]
# Exclusive time means nested labels are subtracted: `moe` is the MoE layer outside its route, dispatch,
# experts, combine and shared steps (the latent down/up projections and the latent norm), `attn.dsa` the
# DSA layer outside its indexer and attention. What no label covers is the embeddings, the norms, the
# dense FFN of the first layer and the LM head. Under the profiler every op pays a fixed recording cost,
# which inflates the many small ops (views, `mul`, `copy_`) next to the matmuls, most on the tiny model of
# a smoke run; the shares of section 1 (hooks, no profiler) are the better account of time, the trace the
# better account of order. `latentmoe-lab profile --mode prefill|decode|train|engine` writes the same
# trace and HTML summary from the command line.
#
# ## 5. Compute and communication per rank
#
# `parallel.timeline.record_timelines(ParallelConfig(ep=2))` launches two local processes (gloo), runs one
# sharded forward of the tiny model after a warm-up, and records on one clock every collective (start,
# end when it was waited on, bytes) and the compute spans of attention, routed experts and shared experts.
# The EP dispatcher starts the token All-to-All (`ep.tokens`) asynchronously and runs the shared experts
# while it is in flight (docs/design.md §1.2 for the layer, §2 parallel row for the layouts);
# `all_to_all_overlap` is the share of that All-to-All's time that lies under shared-expert compute.

# %%
from latentmoe_lab.parallel import ParallelConfig
from latentmoe_lab.parallel.timeline import all_to_all_overlap, record_timelines

timelines = {}
for layout in TIMELINE_LAYOUTS:
    pconfig = ParallelConfig(**layout)
    timelines[pconfig.name()] = intervals = record_timelines(pconfig)
    print(f"{pconfig.name()} ({pconfig.world_size} processes): {len(intervals)} intervals, "
          f"token All-to-All under shared experts: {all_to_all_overlap(intervals):.0%} over all ranks")
    for rank in sorted({i.rank for i in intervals}):
        mine = [i for i in intervals if i.rank == rank]
        tokens = [i for i in mine if i.name.endswith(" ep.tokens")]
        shared = [i for i in mine if i.name == "moe.shared"]
        comm = [i for i in mine if i.kind == "comm"]
        print(f"  rank {rank}: ep.tokens {sum(i.end - i.start for i in tokens) * 1e3:6.2f} ms "
              f"({sum(i.nbytes for i in tokens) / 1024:.1f} KiB), shared experts "
              f"{sum(i.end - i.start for i in shared) * 1e3:6.2f} ms, all collectives "
              f"{sum(i.end - i.start for i in comm) * 1e3:6.2f} ms, overlap {all_to_all_overlap(mine):.0%}")

# %%
for name, intervals in timelines.items():
    viz.timeline_figure(intervals, title=f"{name}: compute and communication per rank (one forward)").show()

# %% [markdown]
# How far to trust that overlap figure (`parallel/timeline.py`): the All-to-All's interval runs from the
# call to the moment `wait()` returns, and the shared experts run inside it, so the fraction is real as
# wall time on the timeline. Whether the bytes actually move while the shared experts compute is up to
# gloo's worker thread and the free cores: here 2 (or 4) ranks share 2 CPU cores with each other and
# with that thread, so the wall time saved is smaller than the fraction suggests. On the tiny model the
# fraction is small anyway: its shared experts take about a millisecond, while an exchange of a few KiB
# takes several, spent waiting for the other rank and in gloo's fixed costs rather than moving bytes.
# The account for real hardware is the planner's time model (section 7: its `shared_overlap` schedule
# hides the dispatch behind the shared experts, as this dispatcher does).
#
# ## 6. Eager against torch.compile
#
# `latentmoe_lab.compiled.compile_decode(model)` routes the single-token forward of every KDA layer and
# every MoE / dense FFN layer through `torch.compile` (DSA layers, whose caches grow every step, and the
# routed experts' grouped matmul stay eager); `ops.kda_compiled.kda_chunked_compiled` compiles each
# chunk group of chunked KDA (docs/design.md §1.3) so inductor can fuse the elementwise passes around
# the small matmuls (the intra-chunk scores stay eager between two graphs). Both keep their eager twin,
# and the outputs must agree to 1e-5 (tests/test_compiled.py checks that in the test suite). A full run
# compiles both with inductor (C++ kernels on a CPU), reports the first call, which includes the compile,
# and then the median of 5 interleaved calls. Smoke mode (the tests) skips both: on this shared 2-core
# machine inductor's first compile of the tiny decode step took 1.5 to 4 minutes, and even dynamo's graph
# capture alone (the `"eager"` backend) takes 7-15 s per function; the recorded figures follow below.

# %%
import copy
import logging
import statistics
import time

from latentmoe_lab.compiled import compile_decode
from latentmoe_lab.ops.kda import kda_chunked
from latentmoe_lab.ops.kda_compiled import kda_chunked_compiled

# dynamo logs each graph break; the one that matters is named in the text below
torch._logging.set_logs(dynamo=logging.ERROR)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def compare_decode(backend: str, batch: int = 4, prompt_len: int = 16, steps: int = 5) -> None:
    """Tiny model: eager and compile_decode'd copies decode the same tokens from equal caches, interleaved."""
    torch.manual_seed(0)
    tiny = LatentMoEForCausalLM(ModelConfig.from_preset("tiny")).eval()
    versions = {"eager": tiny, "compiled": compile_decode(copy.deepcopy(tiny), backend=backend)}
    ids = torch.randint(0, tiny.config.vocab_size, (batch, prompt_len))
    caches = {name: m.new_cache() for name, m in versions.items()}
    step_ms = {name: [] for name in versions}
    with torch.no_grad():
        token = versions["eager"](ids, cache=caches["eager"]).logits[:, -1:].argmax(-1)
        versions["compiled"](ids, cache=caches["compiled"])  # prefill: multi-token calls run eager in both
        compile_s, first = timed(lambda: versions["compiled"](token, cache=caches["compiled"]).logits)
        reference = versions["eager"](token, cache=caches["eager"]).logits
        torch.testing.assert_close(first, reference, rtol=1e-5, atol=1e-5)
        worst, token = (first - reference).abs().max().item(), reference[:, -1:].argmax(-1)
        for _ in range(steps):  # interleaved, so that load on a shared machine hits both alike
            logits = {}
            for name, m in versions.items():
                seconds, logits[name] = timed(lambda: m(token, cache=caches[name]).logits)
                step_ms[name].append(seconds * 1e3)
            torch.testing.assert_close(logits["compiled"], logits["eager"], rtol=1e-5, atol=1e-5)
            worst = max(worst, (logits["compiled"] - logits["eager"]).abs().max().item())
            token = logits["eager"][:, -1:].argmax(-1)
    eager_ms, compiled_ms = (statistics.median(step_ms[n]) for n in versions)
    print(f"decode step, tiny, B={batch}, backend {backend!r}: first compiled step {compile_s:.1f} s; then eager "
          f"{eager_ms:.2f} ms, compiled {compiled_ms:.2f} ms per step ({eager_ms / compiled_ms:.2f}x); "
          f"max |logit difference| {worst:.1e} (<= 1e-5)")


def compare_kda(backend: str, seq_len: int = 1024, heads: int = 4, dim: int = 64, chunk: int = 64) -> None:
    """Chunked KDA, eager op against its compiled twin on one input with realistic gates (the bench_decode sizes)."""
    gen = torch.Generator().manual_seed(0)
    q, v = (torch.randn(1, seq_len, heads, dim, generator=gen) for _ in range(2))
    k = torch.nn.functional.normalize(torch.randn(1, seq_len, heads, dim, generator=gen), dim=-1)
    g = -5 * torch.sigmoid(torch.randn(1, seq_len, heads, dim, generator=gen))  # some channels decay fast
    beta = torch.sigmoid(torch.randn(1, seq_len, heads, generator=gen))
    runs = {"eager": lambda: kda_chunked(q, k, v, g, beta, output_final_state=True, chunk_size=chunk),
            "compiled": lambda: kda_chunked_compiled(q, k, v, g, beta, output_final_state=True, chunk_size=chunk,
                                                     compile_backend=backend)}
    compile_s, _ = timed(runs["compiled"])
    call_ms, worst = {name: [] for name in runs}, 0.0
    for _ in range(5):  # interleaved
        outs = {}
        for name, fn in runs.items():
            seconds, outs[name] = timed(fn)
            call_ms[name].append(seconds * 1e3)
        for got, want in zip(outs["compiled"], outs["eager"]):  # output and final state
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            worst = max(worst, (got - want).abs().max().item())
    eager_ms, compiled_ms = (statistics.median(call_ms[n]) for n in runs)
    print(f"chunked KDA T={seq_len} H={heads} d={dim} C={chunk}, backend {backend!r}: first call {compile_s:.1f} s; "
          f"then eager {eager_ms:.2f} ms, compiled {compiled_ms:.2f} ms ({eager_ms / compiled_ms:.2f}x); "
          f"max |difference| (output and state) {worst:.1e} (<= 1e-5)")


if not COMPILE:
    print("smoke mode: nothing compiled here (see the recorded figures below and tests/test_compiled.py)")

# %%
if COMPILE:  # one cell each: a first inductor compile can take minutes, and each cell has its own time limit
    compare_decode("inductor")

# %%
if COMPILE:
    compare_kda("inductor")

# %% [markdown]
# The recorded benchmark (`benchmarks/bench_decode.py`, inductor, one thread, the sizes of the targets:
# the small preset at B = 4 and chunked KDA at T = 1024, 4 heads, d = 64, chunk 64, against the FLOP lower
# bound at the best 1024^3 matmul rate measured in the same process) is read from
# `benchmarks/bench_decode.json`; `benchmarks/bench_kda.json` has the eager op's ratio at two threads.

# %%
import json

bench = json.loads(Path("../benchmarks/bench_decode.json").read_text())
decode_row, kda_row = bench["decode"], bench["kda"]
print(f"bench_decode.json ({bench['machine']['threads']} thread, torch {bench['machine']['torch']}):")
print(f"  decode {decode_row['preset']} B={decode_row['batch']} after {decode_row['prompt_len']} tokens: eager "
      f"{decode_row['eager_ms']:.1f} ms, compiled {decode_row['compiled_ms']:.1f} ms per step "
      f"({decode_row['speedup']:.2f}x); first compiled step {decode_row['first_compiled_step_s']:.0f} s")
print(f"  chunked KDA T={kda_row['T']}: eager {kda_row['eager_ms']:.1f} ms ({kda_row['eager_over_bound']:.1f}x the "
      f"FLOP bound), compiled {kda_row['compiled_ms']:.1f} ms ({kda_row['compiled_over_bound']:.1f}x); "
      f"first compiled call {kda_row['first_compiled_call_s']:.0f} s")
kda_bench = json.loads(Path("../benchmarks/bench_kda.json").read_text())
row_1024 = next(r for r in kda_bench["rows"] if r["T"] == 1024)
print(f"bench_kda.json ({kda_bench['machine']['threads']} threads): eager chunked KDA T=1024 "
      f"{row_1024['chunked_ms']:.1f} ms = {row_1024['chunked_over_bound']:.1f}x the FLOP bound")

# %% [markdown]
# Where the compiled decode step loses its graphs: the routed experts and the DSA layers run eager by
# design, and dynamo breaks the MoE graph once more at the routing's index check
# (`ops/routing.py check_expert_indices` reads `int(indices.min())`, a `Tensor.item()`), so each MoE layer
# runs as several small graphs with eager code between them. In chunked KDA the intra-chunk scores run
# eager between the two compiled parts of every chunk group. The compile itself costs seconds (idle
# machine, bench_decode.json) to minutes (this shared one) per new shape.
#
# ## 7. Where the time would go on the serving layout
#
# On the cluster the question changes: the public serving layout TP8 x EP8 x PP2 = 128 devices serves 128
# requests of 128k tokens with FP8 experts (docs/design.md §1.1 for the model, §6 for serving). The planner
# (`parallel/planner.py`, roofline in `parallel/roofline.py`; chapter 04 section 5 for memory and traffic)
# estimates each layer as max(FLOPs / peak, bytes / HBM bandwidth) plus its collectives (TP all-reduce
# over NVLink, the expert All-to-All partly over the NIC, one pipeline hand-off per stage), under three
# schedules: sequential, `shared_overlap` (the token dispatch hidden behind the shared experts, as in
# section 5) and `overlapped` (every transfer hidden, the bound micro-batch interleaving reaches).

# %%
from latentmoe_lab.parallel import EXAMPLE_LAYOUTS, HARDWARE, plan_layout
from latentmoe_lab.viz import parallel as viz_parallel

full = ModelConfig.from_preset("k3-2.8t")
SERVING = "TP8xEP8xPP2 = 128 (serving)"
serve_layout, serve_workload = EXAMPLE_LAYOUTS[SERVING]
serving = {hw: plan_layout(full, serve_layout, HARDWARE[hw], serve_workload, SERVING) for hw in HARDWARE}
for hw, plan in serving.items():
    prefill, decode = plan.times["prefill"], plan.times["decode"]
    print(f"{hw:11s} {'fits' if plan.fits else 'does NOT fit'}; prefill chunk {prefill['sequential']:6.2f} s "
          f"(compute {prefill['compute']:5.2f} s, comm {prefill['comm']:5.2f} s, shared overlap "
          f"{prefill['shared_overlap']:5.2f} s, all overlapped {prefill['overlapped']:5.2f} s); decode "
          f"{decode['sequential'] * 1e3:5.1f} ms per step (compute {decode['compute'] * 1e3:4.1f}, comm "
          f"{decode['comm'] * 1e3:4.1f}) = {decode['tokens_per_s']:,.0f} tokens/s")
viz_parallel.step_time_figure(list(serving), [p.times for p in serving.values()], phase="prefill",
                              title=f"{SERVING}: roofline prefill step").show()
viz_parallel.step_time_figure(list(serving), [p.times for p in serving.values()], phase="decode",
                              title=f"{SERVING}: roofline decode step").show()

# %% [markdown]
# Read the table by what changes between GPUs. H100 and H200 have the same bf16 peak and differ only in
# memory and HBM bandwidth: their prefill times are equal, so prefill compute is FLOP-bound, and their
# decode compute differs by exactly the bandwidth ratio (4.8 / 3.35), so decode is byte-bound (expert
# weights and the 128k-token DSA caches read every step). The layout needs about 79 GB per device: it does
# not fit an H100's 72 GB usable, and fits an H200. Communication is the larger part of a prefill chunk
# (TP8 takes a node's 8 GPUs, so every EP8 peer is on another node and the expert All-to-All crosses the
# NIC); hiding the token dispatch behind the shared experts, which section 5 watched on two CPU ranks,
# saves only a little of it, while overlapping every transfer with compute (micro-batch interleaving)
# would bring the step down to its communication time.

# %% [markdown]
# By component: `roofline.stage_layer_times` gives every layer's compute and communication in one pass of
# its pipeline stage (the numbers `roofline.step_times` sums), so grouping them splits the step by layer
# kind; the check below asserts that the sums add back up to the planner's own compute time. Within a
# layer the roofline takes the max of FLOP time and byte time, so attention and experts do not split further.

# %%
from latentmoe_lab.parallel.roofline import stage_layer_times

hw = HARDWARE["H200-141GB"]
plan = serving["H200-141GB"]
by_phase = stage_layer_times(full, serve_layout, hw, serve_workload, plan.stages, plan.params_by_stage)
for phase, stage_layers in by_phase.items():
    stage_compute = []
    for s, layers in enumerate(stage_layers):
        kinds = {}
        for layer, times in layers.items():
            kind = f"{full.layer_types[layer]} + {'moe' if full.is_moe_layer(layer) else 'dense ffn'}"
            totals = kinds.setdefault(kind, {"layers": 0, "compute": 0.0, "comm": 0.0})
            totals["layers"] += 1
            totals["compute"] += times["compute"]
            totals["comm"] += times["comm"]
        stage_compute.append((sum(t["compute"] for t in kinds.values()), s, kinds))
    compute, slowest, kinds = max(stage_compute)
    planned = plan.times[phase]["compute"] / serve_layout.pp  # step_times: (1 micro-batch + pp - 1) x slowest
    assert abs(compute - planned) <= 1e-9 * planned, (phase, compute, planned)
    print(f"{phase}: slowest stage {slowest} (layers {plan.stages[slowest].start}-{plan.stages[slowest].stop - 1}), "
          f"compute {compute * 1e3:.1f} ms per stage pass = the planner's")
    for kind, t in sorted(kinds.items(), key=lambda item: -item[1]["compute"]):
        print(f"  {kind:16s} {t['layers']:3d} layers: compute {t['compute'] * 1e3:9.2f} ms "
              f"({t['compute'] / compute:4.0%}), comm {t['comm'] * 1e3:9.2f} ms")

# %% [markdown]
# ## What to take away
#
# - Decode time per token is flat in the context for KDA layers (the state does not grow) and grows only
#   with the indexer scan for Gated DSA layers; chapter 02 measures this at 1k-64k tokens.
# - The MoE's share is set by top-k and the latent width, not by the number of experts: 896 experts cost
#   memory, not time per token.
# - A trace is one call away: `trace(prefill_step(model, 1, T), path)` (or `latentmoe-lab profile`) writes a
#   file that chrome://tracing and ui.perfetto.dev open, with the model's `record_function` labels above the
#   aten ops; `trace_summary` turns it back into time per label. On a GPU the same call records CUDA kernels.
# - The EP dispatcher really starts the token All-to-All before the shared experts and waits for it after
#   them: the per-rank timeline shows the shared experts inside the exchange. On gloo with 2 cores the
#   measured fraction is small (the tiny model's shared experts are short) and still overstates the saving;
#   the planner, not this CPU, says what the overlap is worth on a cluster.
# - `torch.compile` keeps the outputs to 1e-5 of eager, but on this CPU it buys little for its compile
#   time: the recorded small-preset decode step is about 1.1x eager, compiled chunked KDA is no closer to
#   its FLOP bound than eager (bench_decode.json, above), and the tiny decode step compiled in a full run of
#   this chapter is no faster than eager. The graph breaks and eager islands named above are where
#   to look next.
# - On the serving layout the balance is the cluster's, not the CPU's: at 128k context a DSA layer costs
#   over three times a KDA layer in prefill (the indexer scans every earlier key), every MoE layer pays the
#   same communication, decode is bound by the bytes it reads, and prefill by the All-to-All over the NIC.
