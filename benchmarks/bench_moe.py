"""LatentMoE forward on CPU: the sort-based grouped path against two loop baselines and a dense SwiGLU.

    .venv/bin/python benchmarks/bench_moe.py                 # E=64, top-8, hidden 512, latent 256, inter 256, T=4096
    .venv/bin/python benchmarks/bench_moe.py --quick         # T=512, 2 repeats: checks the harness in seconds

All variants run in this process on the same LatentMoE weights (no shared experts, so that only
the routed path differs) and the same input x [1, T, 512]:

    grouped       LatentMoE.forward: route_topk, stable sort by expert, permute, then per tile of
                  whole experts up to 4096 expert-major rows (ops.routing.CPU_TILE_ROWS) one grouped
                  matmul per projection (torch._grouped_mm; its backward written out in
                  ops.grouped_experts) and the fp32 index_add combine
    per-expert    route_topk once, then a Python loop over the 64 experts: torch.where,
                  index_select, the expert's SwiGLU, index_add of the weighted rows
    per-token     LatentMoE.reference_forward: for every token, for each of its 8 experts,
                  the textbook expert call (with the per-token reference routing)
    dense SwiGLU  one SwiGLU(512, I) with I chosen so 3 * 512 * I equals the MoE's active
                  parameters per token (router, W_down, W_up, norm, 8 experts)
    matmul floor  the routed expert FLOPs as two plain matmuls of the same total shape
                  ([N*K, 256] @ [256, 512] and [N*K, 256] @ [256, 256]): the best any dispatch can do
    row-blocked   an experiment, not in the library: as grouped, but the permute (the gather of
                  each row's latent token) also runs per block, so no [N*K, 256] tensor exists at all

Each timing is the median of --repeats calls after a warm-up, with the variants interleaved call
by call so a load spike on the shared machine hits all of them alike. The per-token loop is slow, so
inside the interleaved rounds it runs on the first --per-token-tokens tokens (default 256) and its time
is scaled by T / 256: it is one Python iteration per token, so linear in T. It also runs once over
all T, untimed by the rounds, as the correctness check and as a cross-check of the scaled time.
Outputs are compared with assert_close at rtol = atol = 1e-5. The sweep table
(--sweep T..., --sweep-threads n..., --sweep-only to run it alone) times per thread count and T the library
layer, its "steps" strategy, the per-expert loop, the library's routed step alone and the matmul floor
(`expert_floors`: the expert GEMMs alone on pre-sorted rows), forward (no grad) and forward + backward (into
x and every weight), interleaved; a third table runs the imbalance workloads. Everything goes to stdout
and benchmarks/bench_moe.json.
"""
from __future__ import annotations

import os
import platform
import time
from itertools import accumulate
from pathlib import Path

import torch
from einops import rearrange

from latentmoe_lab.analysis.imbalance import interleaved_medians, measure_workloads
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.ffn import SwiGLU
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.ops.grouped_experts import expert_tiles
from latentmoe_lab.ops.routing import CPU_TILE_ROWS, grouped_matmul, grouped_swiglu, plan_dispatch
from latentmoe_lab.routing_workloads import WORKLOADS, make_workload

from common import apply_threads, make_parser, write_json

TOL = dict(rtol=1e-5, atol=1e-5)


def bench_config(num_experts=64, top_k=8, hidden=512, latent=256, inter=256) -> ModelConfig:
    base = ModelConfig.from_preset("small")
    return base.replace(hidden_size=hidden, moe={
        **base.to_dict()["moe"], "num_experts": num_experts, "top_k": top_k, "latent_size": latent,
        "expert_intermediate_size": inter, "num_shared_experts": 0, "n_group": 1, "topk_group": 1})


def per_expert_loop_forward(layer: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """Baseline: the common per-expert Python loop (index_select / index_add), same weights and math."""
    x_nd = rearrange(x, "b t d -> (b t) d")
    weights, indices = layer.route(x_nd)
    z = layer.down(x_nd)
    mixed = torch.zeros(z.shape[0], z.shape[1], dtype=torch.float32)
    for expert in range(layer.num_experts):
        token, slot = torch.where(indices == expert)
        if token.numel() == 0:
            continue
        y = layer.experts.expert_reference(z.index_select(0, token), expert)
        mixed.index_add_(0, token, y.float() * weights[token, slot].unsqueeze(-1))
    return rearrange(layer.up(layer.latent_norm(mixed)), "(b t) d -> b t d", b=x.shape[0])


def row_blocked_forward(layer: LatentMoE, x: torch.Tensor, block_rows: int = 4096) -> torch.Tensor:
    """Experiment: LatentMoE.forward's routed path, one block of expert-major rows at a time."""
    x_nd = rearrange(x, "b t d -> (b t) d")
    weights, indices = layer.route(x_nd)
    z = layer.down(x_nd)
    plan = plan_dispatch(indices, layer.num_experts)
    row_weight = weights.reshape(-1)[plan.order].unsqueeze(-1)
    mixed = torch.zeros(z.shape[0], z.shape[1], dtype=torch.float32)
    rows = plan.order.numel()
    for start in range(0, rows, block_rows):
        end = min(start + block_rows, rows)
        token = plan.token_index[start:end]
        offsets = (plan.offsets - start).clamp(0, end - start)
        hidden = grouped_swiglu(z[token], layer.experts.w13, offsets)
        y = grouped_matmul(hidden, layer.experts.w2, offsets)
        mixed.index_add_(0, token, y.float() * row_weight[start:end])
    return rearrange(layer.up(layer.latent_norm(mixed)), "(b t) d -> b t d", b=x.shape[0])


def dense_twin(layer: LatentMoE) -> SwiGLU:
    """SwiGLU(hidden, I) with 3 * hidden * I equal to the layer's active parameters per token."""
    routed = sum(p.numel() for p in layer.experts.parameters()) * layer.top_k // layer.num_experts
    active = routed + sum(p.numel() for name, p in layer.named_parameters() if not name.startswith("experts."))
    return SwiGLU(layer.hidden_size, round(active / (3 * layer.hidden_size)))


def main_table(layer, tokens, repeats, per_token_tokens) -> dict:
    x = torch.randn(1, tokens, layer.hidden_size)
    subset = x[:, :per_token_tokens]
    dense = dense_twin(layer)
    rows = tokens * layer.top_k
    latent, inter = layer.experts.w2.shape[2], layer.experts.w2.shape[1]
    z_rows, h_rows = torch.randn(rows, latent), torch.randn(rows, inter)
    w13, w2 = layer.experts.w13[0].detach(), layer.experts.w2[0].detach()
    with torch.no_grad():
        fast = layer(x)
        torch.testing.assert_close(per_expert_loop_forward(layer, x), fast, **TOL)
        torch.testing.assert_close(row_blocked_forward(layer, x), fast, **TOL)
        start = time.perf_counter()
        reference = layer.reference_forward(x)  # once over all T: the correctness check and a cross-check
        per_token_full = time.perf_counter() - start
        torch.testing.assert_close(reference, fast, **TOL)
        medians = interleaved_medians({
            "grouped": lambda: layer(x),
            "per-expert loop": lambda: per_expert_loop_forward(layer, x),
            "per-token loop": lambda: layer.reference_forward(subset),
            "row-blocked (experiment)": lambda: row_blocked_forward(layer, x),
            "dense SwiGLU": lambda: dense(x),
            "matmul floor": lambda: (z_rows @ w13, h_rows @ w2),
        }, repeats)
    medians["per-token loop"] *= tokens / per_token_tokens  # one Python iteration per token: linear in T
    grouped = medians["grouped"]
    return {
        "tokens": tokens, "dense_intermediate": dense.w1.out_features,
        "per_token_tokens_timed": per_token_tokens, "per_token_single_full_run_s": per_token_full,
        "seconds": medians,
        "speedup_of_grouped": {name: t / grouped for name, t in medians.items() if name != "grouped"},
        "outputs_equal_1e-5": True,
    }


def _with_backward(forward, x: torch.Tensor):
    """forward(x), then the backward of its sum into x and the layer's weights (grads cleared each call)."""
    def run():
        x.grad = None
        forward(x).sum().backward()
    return run


def expert_floors(layer, x: torch.Tensor) -> tuple[dict, dict]:
    """The matmul floor of x's routing, forward and forward + backward: the expert GEMMs alone on rows already
    sorted by expert (no routing, gather, activation or combine), as ({name: fn}, {name: fn}).

    "grouped floor": torch._grouped_mm per expert at the layer's own counts, in the library's tiles of whole experts
    (ops.routing.CPU_TILE_ROWS rows, so outputs stay cache-sized): z_s W13 [r, 2F] and h_s W2 [r, l]; the backward
    adds dh = dB W2^T, dW2 = h_s^T dB, dz = dA W13^T, dW13 = z_s^T dA (explicit GEMMs, no autograd).
    "one-matmul floor": the same six GEMMs as plain matmuls of the total shape, one expert's weights for all rows
    (fewer weight bytes than any real routing reads). The table's floor is the faster of the two.
    """
    with torch.no_grad():
        _, indices = layer.route(rearrange(x, "b t d -> (b t) d"))
    counts = plan_dispatch(indices, layer.num_experts).counts.tolist()
    tiles = [(first, stop, row, rows, torch.tensor(list(accumulate(counts[first:stop])), dtype=torch.int32))
             for first, stop, row, rows in expert_tiles(counts, CPU_TILE_ROWS)]
    w13, w2 = layer.experts.w13.detach(), layer.experts.w2.detach()
    rows, latent, inter = sum(counts), w2.shape[2], w2.shape[1]
    z_s, h_s = torch.randn(rows, latent), torch.randn(rows, inter)
    grad_a, grad_b = torch.randn(rows, 2 * inter), torch.randn(rows, latent)

    def grouped(backward: bool):
        for first, stop, row, n, ends in tiles:
            z_t, h_t, ga, gb = (t[row:row + n] for t in (z_s, h_s, grad_a, grad_b))
            torch._grouped_mm(z_t, w13[first:stop], offs=ends), torch._grouped_mm(h_t, w2[first:stop], offs=ends)
            if backward:
                torch._grouped_mm(gb, w2[first:stop].transpose(1, 2), offs=ends)
                torch._grouped_mm(h_t.t(), gb, offs=ends)
                torch._grouped_mm(ga, w13[first:stop].transpose(1, 2), offs=ends)
                torch._grouped_mm(z_t.t(), ga, offs=ends)

    def plain(backward: bool):
        z_s @ w13[0], h_s @ w2[0]
        if backward:
            grad_b @ w2[0].t(), h_s.t() @ grad_b, grad_a @ w13[0].t(), z_s.t() @ grad_a

    return ({"grouped floor": lambda: grouped(False), "one-matmul floor": lambda: plain(False)},
            {"grouped floor": lambda: grouped(True), "one-matmul floor": lambda: plain(True)})


def routed_step(layer: LatentMoE, x: torch.Tensor):
    """The library's routed step alone on x's routing (LatentMoE.routed: dispatch, experts, combine; what the floor's
    GEMMs sit in, without the router, W_down, W_up and the norm): (forward fn, forward + backward fn)."""
    with torch.no_grad():
        x_nd = rearrange(x, "b t d -> (b t) d")
        weights, indices = layer.route(x_nd)
        z = layer.to_latent(x_nd)
    z_grad, weights_grad = z.clone().requires_grad_(), weights.clone().requires_grad_()

    def forward():
        with torch.no_grad():
            layer.routed(z, weights, indices)

    def forward_backward():
        z_grad.grad = weights_grad.grad = None
        layer.routed(z_grad, weights_grad, indices).sum().backward()
    return forward, forward_backward


def _strategy(layer: LatentMoE, name: str):
    """layer's forward with routed_strategy `name` ("auto" is the library's own choice)."""
    def forward(x):
        layer.routed_strategy = name
        try:
            return layer(x)
        finally:
            layer.routed_strategy = "auto"
    return forward


def sweep_table(layer, token_counts, thread_counts, repeats) -> list[dict]:
    """Per torch thread count and T: the library path, its "steps" strategy, the per-expert loop and the matmul
    floors, forward (no grad) and forward + backward (into x and every weight), interleaved call by call."""
    out = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for tokens in token_counts:
            x = torch.randn(1, tokens, layer.hidden_size)
            floor_fwd, floor_fwd_bwd = expert_floors(layer, x)
            routed_fwd, routed_fwd_bwd = routed_step(layer, x)
            with torch.no_grad():
                torch.testing.assert_close(per_expert_loop_forward(layer, x), layer(x), **TOL)
                torch.testing.assert_close(_strategy(layer, "steps")(x), layer(x), **TOL)
                fwd = interleaved_medians({"library": lambda: layer(x), "steps": lambda: _strategy(layer, "steps")(x),
                                           "per-expert loop": lambda: per_expert_loop_forward(layer, x),
                                           "routed": routed_fwd, **floor_fwd}, repeats)
            xg = x.clone().requires_grad_()
            bwd = interleaved_medians({
                "library": _with_backward(layer, xg), "steps": _with_backward(_strategy(layer, "steps"), xg),
                "per-expert loop": _with_backward(lambda v: per_expert_loop_forward(layer, v), xg),
                "routed": routed_fwd_bwd, **floor_fwd_bwd}, repeats)
            layer.zero_grad(set_to_none=True)
            for phase, m in (("fwd", fwd), ("fwd+bwd", bwd)):
                floor = min(m["grouped floor"], m["one-matmul floor"])
                out.append({"threads": threads, "tokens": tokens, "phase": phase, "strategy": layer.strategy(x[0]),
                            "seconds": m, "loop_over_library": m["per-expert loop"] / m["library"],
                            "floor_ms": floor * 1e3, "library_over_floor": m["library"] / floor, "routed_over_floor": m["routed"] / floor,
                            "steps_over_library": m["steps"] / m["library"]})
    return out


def workload_table(config: ModelConfig, tokens: int, repeats: int) -> list[dict]:
    moe = config.moe
    workloads = [make_workload(name, tokens, moe.num_experts, moe.top_k) for name in WORKLOADS]
    measured = measure_workloads(workloads, moe.latent_size, moe.expert_intermediate_size, repeats=repeats)
    uniform = measured[0].expert_seconds
    return [{"workload": m.name, "max_over_mean": m.stats.max_over_mean, "min_over_mean": m.stats.min_over_mean,
             "dropped_at_cf_1.25": m.stats.dropped_fraction, "load_entropy": m.stats.load_entropy,
             "expert_ms": m.expert_seconds * 1e3, "time_vs_uniform": m.expert_seconds / uniform,
             "padded_over_rows": m.padded_rows / m.rows, "phase_max_over_mean": m.phase_max_over_mean}
            for m in measured]


def main() -> None:
    parser = make_parser(__doc__, default_threads=None, quick_help="T=512, 2 repeats, small sweep", full_doc=True)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--per-token-tokens", type=int, default=256, help="tokens per timed per-token call")
    parser.add_argument("--sweep", type=int, nargs="*", default=[64, 512, 4096, 16384])
    parser.add_argument("--sweep-threads", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--sweep-only", action="store_true", help="only the sweep table (no main / workload tables)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("bench_moe.json"))
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeats, args.sweep, args.sweep_threads = 512, 2, [64, 512], [1]
    apply_threads(args)
    per_token_tokens = min(args.per_token_tokens, args.tokens)

    torch.manual_seed(0)
    config = bench_config()
    layer = LatentMoE(config).eval()
    load_before, threads = os.getloadavg(), torch.get_num_threads()
    started = time.perf_counter()
    main_result = None if args.sweep_only else main_table(layer, args.tokens, args.repeats, per_token_tokens)
    workloads = None if args.sweep_only else workload_table(config, args.tokens, args.repeats)
    sweep = sweep_table(layer, args.sweep, args.sweep_threads, args.repeats)
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": threads, "torch": torch.__version__,
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                    "wall_s": time.perf_counter() - started},
        "config": {"E": config.moe.num_experts, "K": config.moe.top_k, "hidden": config.hidden_size,
                   "latent": config.moe.latent_size, "inter": config.moe.expert_intermediate_size},
        "main": main_result, "sweep": sweep, "workloads": workloads,
    }
    write_json(__file__, result, out=args.out)
    print_tables(result)


def print_tables(result: dict) -> None:
    m, main_result = result["machine"], result["main"]
    print(f"torch {m['torch']}, {m['cores']} cores, load average {m['loadavg_before'][0]:.1f} -> "
          f"{m['loadavg_after'][0]:.1f}")
    if main_result is not None:
        print(f"\nT={main_result['tokens']}, {m['torch_threads']} threads: median ms, and time / grouped time "
              f"(dense SwiGLU intermediate {main_result['dense_intermediate']})")
        print(f"| variant | ms | x grouped |\n|---|---:|---:|\n| grouped | {main_result['seconds']['grouped'] * 1e3:.1f} "
              f"| 1.00 |")
        for name, ratio in main_result["speedup_of_grouped"].items():
            print(f"| {name} | {main_result['seconds'][name] * 1e3:.1f} | {ratio:.2f} |")
        print(f"(per-token loop: timed on {main_result['per_token_tokens_timed']} tokens per round and scaled; "
              f"one untimed-round run over all T took {main_result['per_token_single_full_run_s'] * 1e3:.0f} ms)")
    print("\n| threads | T | pass | strategy | library ms | loop ms | floor ms | loop / library (>= 1) "
          "| library / floor (<= 1.25 at 4096) | routed step / floor | steps / library |\n"
          "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in result["sweep"]:
        sec = row["seconds"]
        print(f"| {row['threads']} | {row['tokens']} | {row['phase']} | {row['strategy']} | {sec['library'] * 1e3:.1f} "
              f"| {sec['per-expert loop'] * 1e3:.1f} | {row['floor_ms']:.1f} | {row['loop_over_library']:.2f} "
              f"| {row['library_over_floor']:.2f} | {row['routed_over_floor']:.2f} "
              f"| {row['steps_over_library']:.2f} |")
    if result["workloads"] is not None:
        print("\n| workload | max/mean | min/mean | dropped @ cf 1.25 | expert ms | x uniform | padded rows / rows |\n"
              "|---|---:|---:|---:|---:|---:|---:|")
        for row in result["workloads"]:
            print(f"| {row['workload']} | {row['max_over_mean']:.2f} | {row['min_over_mean']:.2f} | "
                  f"{row['dropped_at_cf_1.25']:.3f} | {row['expert_ms']:.1f} | {row['time_vs_uniform']:.2f} | "
                  f"{row['padded_over_rows']:.2f} |")


if __name__ == "__main__":
    main()
