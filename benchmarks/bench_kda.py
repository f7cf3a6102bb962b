"""Chunked KDA against the per-token recurrence on CPU, and against its FLOP lower bound.

    .venv/bin/python benchmarks/bench_kda.py            # B=1, H=4, d_k=d_v=64, C=64, fp32, T=512..16384
    .venv/bin/python benchmarks/bench_kda.py --quick    # T=512, 1024 and 2 repeats: checks the harness

For each T both ops run on the same inputs (unit-norm k, g in [-0.5, 0], beta in (0, 1)), interleaved
call by call so that a load spike on the shared machine hits both alike; each time is the median of
--repeats calls after a warm-up. The recurrence is run only --recurrent-repeats times (default 1) at
T >= 8192, since it costs seconds there.

FLOP lower bound per head (docs/design.md §1.3): 6 T d^2 + 3 T C d + T C^2 FLOPs. The bound's time is those
FLOPs at the best fp32 matmul rate measured in this process (a 1024^3 matmul), so the ratio
chunked / bound says how far the eager PyTorch op is from a kernel that only ran matmuls at peak.
A second rate, that of a batch of d x d products (the shapes a chunk is made of), shows how much of
the gap is the small matrices themselves. Peak memory is the chunked op's own tensor storage
(latentmoe_lab.analysis.memory.PeakMemory): it stops growing with T once chunks run in groups.
A last table times the op at T = 4096 under mild gates, g = -5 everywhere and periodic g = -1000 resets
(hard decays make it halve blocks, see ops/kda_intra.py), and a last line forward + backward of both ops
under lower-bound gates g = -5 sigmoid(x), with the gradients' agreement. Writes benchmarks/bench_kda.json.
"""
from __future__ import annotations

import statistics
import time

import torch

from latentmoe_lab.analysis.memory import PeakMemory
from latentmoe_lab.ops.kda import kda_chunked, kda_recurrent
from latentmoe_lab.ops.norms import l2_norm

from common import apply_threads, machine_info, make_parser, write_json


def make_inputs(seq_len: int, heads: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seq_len, heads, dim, generator=gen)
    k = l2_norm(torch.randn(1, seq_len, heads, dim, generator=gen))
    v = torch.randn(1, seq_len, heads, dim, generator=gen)
    g = -0.5 * torch.rand(1, seq_len, heads, dim, generator=gen)
    beta = torch.rand(1, seq_len, heads, generator=gen)
    return q, k, v, g, beta


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def matmul_peak_gflops(repeats: int = 7) -> float:
    """Best fp32 GFLOP/s of a 1024^3 matmul here (the rate the lower bound assumes)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    best = min(timed(lambda: a @ b)[0] for _ in range(repeats))
    return 2 * 1024 ** 3 / best / 1e9


def small_matmul_gflops(dim: int, repeats: int = 7) -> float:
    """Best fp32 GFLOP/s of 256 independent [dim, dim] @ [dim, dim] products (one batched matmul)."""
    a, b = torch.randn(256, dim, dim), torch.randn(256, dim, dim)
    a @ b
    best = min(timed(lambda: a @ b)[0] for _ in range(repeats))
    return 2 * 256 * dim ** 3 / best / 1e9


def gate_table(seq_len: int, args, repeats: int) -> list[dict]:
    """kda_chunked at one T under three gate profiles, interleaved: how hard decays change its cost."""
    q, k, v, g, beta = make_inputs(seq_len, args.heads, args.dim)
    profiles = {"g in [-0.5, 0]": g, "g = -5 everywhere": torch.full_like(g, -5.0),
                "g = -1000 every 100 tokens": g.clone().index_fill_(1, torch.arange(0, seq_len, 100), -1000.0)}
    times = {name: [] for name in profiles}
    for name, gates in profiles.items():
        torch.testing.assert_close(kda_chunked(q, k, v, gates, beta, chunk_size=args.chunk)[0],
                                   kda_recurrent(q, k, v, gates, beta)[0], rtol=1e-5, atol=1e-5)
    for _ in range(repeats):
        for name, gates in profiles.items():
            times[name].append(timed(lambda: kda_chunked(q, k, v, gates, beta, chunk_size=args.chunk))[0])
    base = statistics.median(times["g in [-0.5, 0]"])
    print(f"\nT={seq_len}, gate profiles (each equal to the recurrence to 1e-5):")
    rows = []
    for name, seconds in times.items():
        rows.append(dict(gates=name, T=seq_len, chunked_ms=1e3 * statistics.median(seconds),
                         vs_mild=statistics.median(seconds) / base))
        print(f"  {name:28s} {rows[-1]['chunked_ms']:8.1f} ms  {rows[-1]['vs_mild']:5.2f}x")
    return rows


def gradient_table(seq_len: int, args, repeats: int) -> dict:
    """Forward + backward of both ops under K3's lower-bound gates g = -5 sigmoid(x), x ~ N(0, 1), whose
    chunks decay far past the key-growth limit (ops/kda_intra.py): times, and the worst input's gradient
    error relative to the recurrence's, ||grad - reference|| / ||reference||."""
    q, k, v, _, beta = make_inputs(seq_len, args.heads, args.dim)
    gen = torch.Generator().manual_seed(1)
    g = -5.0 * torch.sigmoid(torch.randn(q.shape, generator=gen))
    weight = torch.randn(v.shape, generator=gen)

    def gradients(op, **kwargs):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
        (op(*leaves, **kwargs)[0] * weight).sum().backward()
        return [t.grad for t in leaves]

    chunked_s, recurrent_s = [], []
    gradients(kda_chunked, chunk_size=args.chunk)  # warm-up
    for i in range(repeats):
        seconds, fast = timed(lambda: gradients(kda_chunked, chunk_size=args.chunk))
        chunked_s.append(seconds)
        if i < args.recurrent_repeats:
            seconds, slow = timed(lambda: gradients(kda_recurrent))
            recurrent_s.append(seconds)
    error = max(((a - b).norm() / b.norm()).item() for a, b in zip(fast, slow))
    row = dict(T=seq_len, gates="-5 sigmoid(N(0, 1))", chunked_fwd_bwd_ms=1e3 * statistics.median(chunked_s),
               recurrent_fwd_bwd_ms=1e3 * statistics.median(recurrent_s), max_rel_grad_error=error)
    row["speedup"] = row["recurrent_fwd_bwd_ms"] / row["chunked_fwd_bwd_ms"]
    print(f"\nT={seq_len}, forward + backward, g = -5 sigmoid(N(0, 1)): chunked {row['chunked_fwd_bwd_ms']:.1f} ms, "
          f"recurrent {row['recurrent_fwd_bwd_ms']:.1f} ms ({row['speedup']:.1f}x), "
          f"worst gradient error {error:.1e} (norm-relative)")
    return row


def flop_lower_bound(seq_len: int, heads: int, dim: int, chunk: int) -> float:
    return heads * (6 * seq_len * dim ** 2 + 3 * seq_len * chunk * dim + seq_len * chunk ** 2)


def main() -> None:
    parser = make_parser(__doc__, default_threads=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--recurrent-repeats", type=int, default=1, help="recurrence repeats at T >= 8192")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64)
    args = parser.parse_args()
    apply_threads(args)
    lengths = [512, 1024] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    repeats = 2 if args.quick else args.repeats

    # The matmul rates are taken before every T and the best of them kept, so that a slow spell of the
    # shared machine at the start cannot flatter the ratios.
    peaks, smalls, rows = [], [], []
    for seq_len in lengths:
        peaks.append(matmul_peak_gflops())
        smalls.append(small_matmul_gflops(args.dim))
        inputs = make_inputs(seq_len, args.heads, args.dim)
        with PeakMemory() as memory:  # doubles as the warm-up
            kda_chunked(*inputs, chunk_size=args.chunk)
        runs_recurrent = repeats if seq_len < 8192 else args.recurrent_repeats
        chunked_s, recurrent_s, max_diff = [], [], 0.0
        for i in range(max(repeats, runs_recurrent)):
            if i < repeats:
                seconds, (fast, _) = timed(lambda: kda_chunked(*inputs, chunk_size=args.chunk))
                chunked_s.append(seconds)
            if i < runs_recurrent:
                seconds, (slow, _) = timed(lambda: kda_recurrent(*inputs))
                recurrent_s.append(seconds)
                max_diff = max(max_diff, (fast - slow).abs().max().item())
        chunked, recurrent = statistics.median(chunked_s), statistics.median(recurrent_s)
        rows.append(dict(T=seq_len, chunked_ms=1e3 * chunked, recurrent_ms=1e3 * recurrent,
                         speedup=recurrent / chunked, peak_mib=memory.peak_bytes / 2 ** 20, max_abs_diff=max_diff,
                         chunked_repeats=len(chunked_s), recurrent_repeats=len(recurrent_s)))
        print(f"T={seq_len}: chunked {1e3 * chunked:.1f} ms, recurrent {1e3 * recurrent:.1f} ms", flush=True)

    peak, small = max(peaks), max(smalls)
    print(f"\nfp32 matmul rate here ({torch.get_num_threads()} threads, best of {len(peaks)}): {peak:.1f} GFLOP/s "
          f"at 1024^3, {small:.1f} GFLOP/s for 256 x {args.dim}^3")
    print(f"{'T':>6} {'chunked ms':>11} {'recurrent ms':>13} {'speedup':>8} {'bound ms':>9} "
          f"{'chunked/bound':>14} {'at d^3 rate':>12} {'peak MiB':>9} {'max |diff|':>11}")
    for row in rows:
        flops = flop_lower_bound(row["T"], args.heads, args.dim, args.chunk)
        row.update(bound_ms=1e3 * flops / (peak * 1e9), small_matmul_bound_ms=1e3 * flops / (small * 1e9))
        row.update(chunked_over_bound=row["chunked_ms"] / row["bound_ms"],
                   chunked_over_small_matmul_bound=row["chunked_ms"] / row["small_matmul_bound_ms"])
        print(f"{row['T']:>6} {row['chunked_ms']:>11.1f} {row['recurrent_ms']:>13.1f} {row['speedup']:>7.1f}x "
              f"{row['bound_ms']:>9.2f} {row['chunked_over_bound']:>13.1f}x "
              f"{row['chunked_over_small_matmul_bound']:>11.1f}x {row['peak_mib']:>9.1f} {row['max_abs_diff']:>11.1e}")

    gates = gate_table(1024 if args.quick else 4096, args, repeats)
    gradient = gradient_table(1024 if args.quick else 4096, args, repeats)
    result = dict(config=dict(B=1, H=args.heads, d_k=args.dim, d_v=args.dim, chunk=args.chunk, dtype="fp32"),
                  machine=machine_info(matmul_peak_gflops=peak, small_matmul_gflops=small, matmul_rates_taken=peaks),
                  rows=rows, gates=gates, gradient=gradient)
    out = write_json(__file__, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
