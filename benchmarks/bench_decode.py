"""Eager against torch.compile (inductor) on this CPU: the decode step and chunked KDA, in one process.

    .venv/bin/python benchmarks/bench_decode.py           # small preset, B=4; KDA at T=1024 (H=4, d=64, C=64)
    .venv/bin/python benchmarks/bench_decode.py --quick   # tiny preset, B=2, KDA at T=256: checks the harness

Decode: `latentmoe_lab.compiled.compile_decode` (single-token KDA and MoE/FFN layers compiled, DSA and
the routed experts' grouped matmul eager). The two variants decode the same prompt from the same
cache state, interleaved step by step so that load on a shared machine hits both alike; each time is
the median over --steps steps after the compile (whose wall time is reported on its own), and the
compiled logits are checked against the eager ones to 1e-5.
KDA: `ops.kda_compiled.kda_chunked_compiled` against `ops.kda.kda_chunked` (torch), interleaved, and
both against the FLOP lower bound of bench_kda.py at the best 1024^3 fp32 matmul rate in this process.
Writes benchmarks/bench_decode.json.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.compiled import compile_decode
from latentmoe_lab.ops.kda import kda_chunked
from latentmoe_lab.ops.kda_compiled import kda_chunked_compiled

from bench_kda import flop_lower_bound, make_inputs, matmul_peak_gflops, timed
from common import apply_threads, machine_info, make_parser, write_json


def decode_table(preset: str, batch: int, prompt_len: int, steps: int) -> dict:
    torch.manual_seed(0)
    eager = LatentMoEForCausalLM(ModelConfig.from_preset(preset)).eval()
    compiled = compile_decode(copy.deepcopy(eager))
    ids = torch.randint(0, eager.config.vocab_size, (batch, prompt_len))
    caches = {"eager": eager.new_cache(), "compiled": compiled.new_cache()}
    models = {"eager": eager, "compiled": compiled}
    with torch.no_grad():
        nxt = {name: models[name](ids, cache=caches[name]).logits[:, -1:].argmax(-1) for name in models}
        compile_s, logits = timed(lambda: compiled(nxt["compiled"], cache=caches["compiled"]).logits)
        reference = eager(nxt["eager"], cache=caches["eager"]).logits
        torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
        feed = logits[:, -1:].argmax(-1)  # both continue from the same token and equal caches
        times = {name: [] for name in models}
        for _ in range(steps):
            outs = {}
            for name, model in models.items():
                seconds, outs[name] = timed(lambda: model(feed, cache=caches[name]).logits)
                times[name].append(seconds)
            torch.testing.assert_close(outs["compiled"], outs["eager"], rtol=1e-5, atol=1e-5)
            feed = outs["eager"][:, -1:].argmax(-1)
    eager_ms, compiled_ms = (1e3 * statistics.median(times[n]) for n in ("eager", "compiled"))
    row = dict(preset=preset, batch=batch, prompt_len=prompt_len, steps=steps, eager_ms=eager_ms,
               compiled_ms=compiled_ms, speedup=eager_ms / compiled_ms, first_compiled_step_s=compile_s)
    print(f"decode {preset} B={batch} after {prompt_len} tokens: eager {eager_ms:.2f} ms, compiled "
          f"{compiled_ms:.2f} ms per step ({row['speedup']:.2f}x); first compiled step {compile_s:.0f} s")
    return row


def kda_table(seq_len: int, heads: int, dim: int, chunk: int, repeats: int) -> dict:
    q, k, v, g, beta = make_inputs(seq_len, heads, dim)
    compile_s, (out, _) = timed(lambda: kda_chunked_compiled(q, k, v, g, beta, chunk_size=chunk))
    torch.testing.assert_close(out, kda_chunked(q, k, v, g, beta, chunk_size=chunk, backend="torch")[0],
                               rtol=1e-5, atol=1e-5)
    times = {"eager": [], "compiled": []}
    for _ in range(repeats):
        times["eager"].append(timed(lambda: kda_chunked(q, k, v, g, beta, chunk_size=chunk, backend="torch"))[0])
        times["compiled"].append(timed(lambda: kda_chunked_compiled(q, k, v, g, beta, chunk_size=chunk))[0])
    peak = max(matmul_peak_gflops() for _ in range(3))
    bound_ms = 1e3 * flop_lower_bound(seq_len, heads, dim, chunk) / (peak * 1e9)
    eager_ms, compiled_ms = (1e3 * statistics.median(times[n]) for n in ("eager", "compiled"))
    row = dict(T=seq_len, heads=heads, dim=dim, chunk=chunk, eager_ms=eager_ms, compiled_ms=compiled_ms,
               bound_ms=bound_ms, eager_over_bound=eager_ms / bound_ms, compiled_over_bound=compiled_ms / bound_ms,
               first_compiled_call_s=compile_s, matmul_peak_gflops=peak)
    print(f"kda_chunked T={seq_len} H={heads} d={dim} C={chunk}: eager {eager_ms:.1f} ms "
          f"({row['eager_over_bound']:.1f}x bound), compiled {compiled_ms:.1f} ms "
          f"({row['compiled_over_bound']:.1f}x bound; bound {bound_ms:.2f} ms at {peak:.0f} GFLOP/s); "
          f"first compiled call {compile_s:.0f} s")
    return row


def main() -> None:
    parser = make_parser(__doc__, default_threads=None, full_doc=True)  # as bench_kda.py
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps (default: 20)")
    args = parser.parse_args()
    apply_threads(args)
    if args.quick:
        decode = decode_table("tiny", 2, 16, 4)
        kda = kda_table(256, 2, 32, 32, 3)
    else:
        decode = decode_table("small", 4, 64, args.steps)
        kda = kda_table(1024, 4, 64, 64, 7)
    print(f"wrote {write_json(__file__, dict(decode=decode, kda=kda, machine=machine_info()))}")


if __name__ == "__main__":
    main()
