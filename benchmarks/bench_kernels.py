"""Triton kernels against their torch references on one CUDA GPU: time, TFLOP/s or GB/s, share of peak.

    .venv/bin/python benchmarks/bench_kernels.py           # needs a CUDA GPU; under 5 minutes
    .venv/bin/python benchmarks/bench_kernels.py --smoke   # no GPU needed: tiny sizes in triton's CPU
                                                           # interpreter, to check the harness runs

On a GPU it prints a table and writes benchmarks/bench_kernels.json. Each row times one kernel
(latentmoe_kernels.*, called directly) and the torch reference op (backend="torch") side by side in this
process: median of several CUDA-event timed repeats after a warm-up call that also compiles. Compute-bound
kernels report TFLOP/s against the dense peak of the precision they compute in (bf16 tensor cores, or
plain fp32 for the KDA kernels, which do all their math in fp32); memory-bound ones report GB/s against
HBM bandwidth. Peaks come from a small table of published spec values (override with --peak-*).
"max diff" compares the kernel's output with the reference's where the reference fits in memory.
Without a GPU (and without --smoke) the script says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

SPEC_PEAKS = {  # name fragment -> (bf16 dense TFLOP/s, fp32 non-tensor TFLOP/s, HBM GB/s), vendor spec sheets
    "H200": (989.0, 67.0, 4800.0),
    "H100 PCIe": (756.0, 51.0, 2000.0),
    "H100": (989.0, 67.0, 3350.0),
    "A100-SXM4-80GB": (312.0, 19.5, 2039.0),
    "A100": (312.0, 19.5, 1555.0),
}
TIME_BUDGET_S = 270.0  # stop starting new cases past this, to stay under 5 minutes


@dataclass
class Case:
    family: str
    size: str
    work: float  # FLOPs or bytes of one call
    unit: str  # "TFLOP/s" (peak "bf16" or "fp32") or "GB/s"
    peak: str  # "bf16" | "fp32" | "hbm"
    kernel: Callable[[], object]
    reference: Callable[[], object] | None  # None: the reference does not fit in memory at this size
    diff: Callable[[object, object], float] | None = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU in triton's interpreter")
    parser.add_argument("--peak-bf16", type=float, help="bf16 dense TFLOP/s of this GPU")
    parser.add_argument("--peak-fp32", type=float, help="fp32 (non-tensor-core) TFLOP/s of this GPU")
    parser.add_argument("--peak-hbm", type=float, help="memory bandwidth of this GPU in GB/s")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("bench_kernels: no CUDA GPU found. The Triton kernels are timed on a GPU only (the CPU "
              "interpreter checks correctness, not speed); nothing was measured. Run with --smoke to "
              "exercise the harness on CPU.")
        return
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench_kernels: triton is not installed (pip install 'latentmoe-lab[kernels]'); nothing was measured.")
        return

    device = "cpu" if args.smoke else "cuda"
    name = "CPU (triton interpreter, --smoke)" if args.smoke else torch.cuda.get_device_name()
    spec = next((peaks for fragment, peaks in SPEC_PEAKS.items() if fragment in name), (None, None, None))
    peaks = {"bf16": args.peak_bf16 or spec[0], "fp32": args.peak_fp32 or spec[1], "hbm": args.peak_hbm or spec[2]}
    print(f"device: {name}; peaks used: bf16 {peaks['bf16']} TFLOP/s, fp32 {peaks['fp32']} TFLOP/s, "
          f"HBM {peaks['hbm']} GB/s")

    torch.manual_seed(0)
    rows, started = [], time.perf_counter()
    for make in (_routing_cases, _grouped_gemm_cases, _dsa_cases, _kda_cases):  # the slowest (KDA 64k) last
        for case in make(torch, device, args.smoke):
            if time.perf_counter() - started > TIME_BUDGET_S:
                print(f"time budget spent, skipping {case.family} {case.size}")
                continue
            rows.append(_run(torch, case, peaks, args.smoke))
            print(_format(rows[-1]), flush=True)
            _free(torch, device)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if not args.smoke:
        out = Path(__file__).with_suffix(".json")
        out.write_text(json.dumps({"device": name, "peaks": peaks, "rows": rows}, indent=2))
        print(f"wrote {out}")


# ------------------------------------------------------------------------------------ timing and table
def _time_ms(torch, fn: Callable[[], object], smoke: bool) -> tuple[float, object]:
    """Median ms of repeated calls after one warm-up (compile) call; returns it with the last output."""
    out = fn()
    if smoke:
        start = time.perf_counter()
        out = fn()
        return (time.perf_counter() - start) * 1e3, out
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    repeats = max(3, min(20, int(500.0 / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(repeats):
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), out


def _run(torch, case: Case, peaks: dict, smoke: bool) -> dict:
    kernel_ms, kernel_out = _time_ms(torch, case.kernel, smoke)
    reference_ms = max_diff = None
    if case.reference is not None:
        reference_ms, reference_out = _time_ms(torch, case.reference, smoke)
        if case.diff is not None:
            max_diff = case.diff(kernel_out, reference_out)
    scale = 1e12 if case.unit == "TFLOP/s" else 1e9
    achieved = case.work / (kernel_ms * 1e-3) / scale
    peak = peaks[case.peak]
    return {"family": case.family, "size": case.size, "triton_ms": kernel_ms, "torch_ms": reference_ms,
            "speedup": None if reference_ms is None else reference_ms / kernel_ms, "achieved": achieved,
            "unit": case.unit, "peak": case.peak, "percent_of_peak": None if not peak else 100 * achieved / peak,
            "max_diff": max_diff}


def _format(row: dict) -> str:
    torch_ms = "   skipped" if row["torch_ms"] is None else f"{row['torch_ms']:10.3f}"
    speedup = "     -" if row["speedup"] is None else f"{row['speedup']:5.1f}x"
    share = "  n/a" if row["percent_of_peak"] is None else f"{row['percent_of_peak']:4.1f}%"
    diff = "-" if row["max_diff"] is None else f"{row['max_diff']:.1e}"
    return (f"{row['family']:<18} {row['size']:<40} triton {row['triton_ms']:9.3f} ms  torch {torch_ms} ms  "
            f"{speedup}  {row['achieved']:8.1f} {row['unit']:<7} {share} of {row['peak']} peak  max diff {diff}")


def _free(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def _max_abs(a, b) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _fits(torch, device: str, nbytes: float) -> bool:
    """Whether a torch reference needing about `nbytes` of temporaries fits in a quarter of the GPU."""
    return device == "cpu" or nbytes < 0.25 * torch.cuda.get_device_properties(0).total_memory


# ------------------------------------------------------------------------------------------- cases
def _routing_cases(torch, device, smoke):
    from latentmoe_kernels.grouped_gemm import combine as combine_kernel
    from latentmoe_kernels.routing import fused_route
    from latentmoe_lab.ops.routing import combine, plan_dispatch, route_and_plan

    tokens, experts, top_k, width = (16, 32, 4, 64) if smoke else (16384, 896, 16, 3584)
    logits = torch.randn(tokens, experts, device=device)
    bias = torch.randn(experts, device=device) * 1e-2
    routed_bytes = tokens * experts * 4 + tokens * top_k * (4 + 8 + 8)
    yield Case("routing", f"N={tokens} E={experts} top-{top_k}", routed_bytes, "GB/s", "hbm",
               lambda: fused_route(logits, top_k, bias).order,
               lambda: route_and_plan(logits, top_k, bias, backend="torch")[2].order,
               lambda a, b: float((a != b).sum()))  # rows placed differently

    tokens = 16 if smoke else 4096
    indices = torch.rand(tokens, experts, device=device).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, device=device)
    plan = plan_dispatch(indices, experts)
    y = torch.randn(tokens * top_k, width, device=device, dtype=torch.float16 if smoke else torch.bfloat16)
    moved = y.numel() * y.element_size() + tokens * width * 4
    yield Case("combine", f"N={tokens} top-{top_k} D={width} {str(y.dtype)[6:]}", moved, "GB/s", "hbm",
               lambda: combine_kernel(y, weights, plan.order), lambda: combine(y, weights, plan, tokens, backend="torch"),
               _max_abs)


def _grouped_gemm_cases(torch, device, smoke):
    from latentmoe_kernels.grouped_gemm import grouped_gemm, grouped_swiglu as swiglu_kernel
    from latentmoe_lab.ops.routing import grouped_matmul, grouped_swiglu

    # One expert-parallel slice: 128 of the 896 experts (one rank of 7), latent 3584, expert width 3072.
    experts, latent, inter = (4, 64, 48) if smoke else (128, 3584, 3072)
    dtype = torch.float16 if smoke else torch.bfloat16
    w13 = torch.randn(experts, latent, 2 * inter, device=device, dtype=dtype) * latent ** -0.5
    w2 = torch.randn(experts, inter, latent, device=device, dtype=dtype) * inter ** -0.5
    for tokens in ((8,) if smoke else (256, 4096)):
        rows = tokens * 16 * experts // 896 if not smoke else tokens * 2  # top-16 of 896 lands this many here
        counts = torch.bincount(torch.randint(0, experts, (rows,), device=device), minlength=experts)
        offsets = counts.cumsum(0)
        x = torch.randn(rows, latent, device=device, dtype=dtype)
        hidden = swiglu_kernel(x, w13, offsets)
        size = f"{tokens} tokens -> M={rows}, E={experts}"
        yield Case("grouped SwiGLU", size, 2 * rows * latent * 2 * inter, "TFLOP/s", "bf16",
                   lambda x=x, offsets=offsets: swiglu_kernel(x, w13, offsets),
                   lambda x=x, offsets=offsets: grouped_swiglu(x, w13, offsets, backend="torch"), _max_abs)
        yield Case("grouped GEMM down", size, 2 * rows * inter * latent, "TFLOP/s", "bf16",
                   lambda h=hidden, offsets=offsets: grouped_gemm(h, w2, offsets),
                   lambda h=hidden, offsets=offsets: grouped_matmul(h, w2, offsets, backend="torch"), _max_abs)


def _kda_inputs(torch, device, batch, seq_len, heads, dim):
    def unit(*shape):
        x = torch.randn(*shape, device=device)
        return (x / x.norm(dim=-1, keepdim=True)).to(torch.bfloat16)
    q, k = unit(batch, seq_len, heads, dim), unit(batch, seq_len, heads, dim)
    v = torch.randn(batch, seq_len, heads, dim, device=device, dtype=torch.bfloat16)
    g = -torch.rand(batch, seq_len, heads, dim, device=device) * 0.1
    beta = torch.rand(batch, seq_len, heads, device=device)
    return q, k, v, g, beta


def _kda_cases(torch, device, smoke):
    from latentmoe_kernels import kda as kernels
    from latentmoe_lab.ops.kda import kda_chunked, kda_recurrent

    dim, chunk = (16, 16) if smoke else (128, 64)
    for seq_len, heads in (((40, 2),) if smoke else ((8192, 32), (32768, 64), (65536, 96))):
        q, k, v, g, beta = _kda_inputs(torch, device, 1, seq_len, heads, dim)
        flops = heads * (6 * seq_len * dim ** 2 + 3 * seq_len * chunk * dim + seq_len * chunk ** 2)
        reference_bytes = 4 * heads * seq_len * chunk * dim * 4  # its [B, H, N, C, C, K]-sized pair decays
        reference = None
        if _fits(torch, device, reference_bytes):
            def reference(q=q, k=k, v=v, g=g, beta=beta):
                return kda_chunked(q, k, v, g, beta, chunk_size=chunk, backend="torch")[0]
        yield Case("KDA chunked", f"T={seq_len} H={heads} d={dim} C={chunk}", flops, "TFLOP/s", "fp32",
                   lambda q=q, k=k, v=v, g=g, beta=beta: kernels.kda_chunked(q, k, v, g, beta, chunk_size=chunk)[0],
                   reference, _max_abs)
        del q, k, v, g, beta

    batch, heads = (2, 2) if smoke else (64, 96)
    q, k, v, g, beta = _kda_inputs(torch, device, batch, 1, heads, dim)
    state = torch.randn(batch, heads, dim, dim, device=device)
    state_bytes = 2 * state.numel() * 4  # read and write the fp32 state; the token's inputs are noise
    yield Case("KDA decode step", f"B={batch} H={heads} d={dim}, state in place", state_bytes, "GB/s", "hbm",
               lambda: kernels.kda_recurrent(q, k, v, g, beta, initial_state=state)[0],
               lambda: kda_recurrent(q, k, v, g, beta, initial_state=state, backend="torch")[0], None)


def _dsa_cases(torch, device, smoke):
    from latentmoe_kernels import sparse_attention as kernels
    from latentmoe_lab.ops.sparse_attention import index_topk, sparse_attention

    dtype = torch.float16 if smoke else torch.bfloat16
    heads_idx, dim_idx, topk = (2, 16, 8) if smoke else (64, 128, 2048)
    for batch, queries, keys in (((1, 4, 24),) if smoke else ((1, 8192, 8192), (16, 1, 65536))):
        q_idx = torch.randn(batch, queries, heads_idx, dim_idx, device=device, dtype=dtype)
        k_idx = torch.randn(batch, keys, dim_idx, device=device, dtype=dtype)
        w = torch.randn(batch, queries, heads_idx, device=device)
        offset = keys - queries
        visible = batch * sum(min(t + offset + 1, keys) for t in range(queries))
        yield Case("index top-k", f"B={batch} T={queries} S={keys} HI={heads_idx} k={topk}",
                   2 * visible * heads_idx * dim_idx, "TFLOP/s", "bf16",
                   lambda q_idx=q_idx, k_idx=k_idx, w=w, offset=offset: kernels.index_topk(q_idx, k_idx, w, topk, offset),
                   lambda q_idx=q_idx, k_idx=k_idx, w=w, offset=offset: index_topk(q_idx, k_idx, w, topk, offset,
                                                                                    backend="torch"),
                   lambda a, b: float((a.sort(-1).values != b.sort(-1).values).float().mean()))  # share differing

    # Absorbed MLA decode/prefill form: one latent key/value head of 512 + 64 rope dims, 96 query heads.
    heads, dim, dim_v, topk = (4, 24, 16, 8) if smoke else (96, 576, 512, 2048)
    queries, keys = (3, 20) if smoke else (1024, 8192)
    q = torch.randn(1, queries, heads, dim, device=device, dtype=dtype)
    k = torch.randn(1, keys, 1, dim, device=device, dtype=dtype)
    v = torch.randn(1, keys, 1, dim_v, device=device, dtype=dtype)
    indices = torch.randint(0, keys, (1, queries, topk), device=device)
    yield Case("sparse attention", f"T={queries} S={keys} H={heads} MQA d={dim}/{dim_v} k={topk}",
               2 * queries * heads * topk * (dim + dim_v), "TFLOP/s", "bf16",
               lambda: kernels.sparse_attention(q, k, v, indices),
               lambda: sparse_attention(q, k, v, indices, backend="torch"), _max_abs)


if __name__ == "__main__":
    sys.exit(main())
