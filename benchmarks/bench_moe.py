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
Outputs are compared with assert_close at rtol = atol = 1e-5. A second table repeats
grouped vs per-expert at several T, forward (no grad) and forward + backward (into x and every weight),
with the matmul floor of a forward + backward (the two expert GEMMs and their 4 backward GEMMs) at the
largest T; a third runs the imbalance workloads. Everything goes to stdout
and benchmarks/bench_moe.json.
"""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch
from einops import rearrange

from latentmoe_lab.analysis.imbalance import interleaved_medians, measure_workloads
from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.ffn import SwiGLU
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.ops.routing import grouped_matmul, grouped_swiglu, plan_dispatch
from latentmoe_lab.workloads import WORKLOADS, make_workload

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


def floor_with_backward(layer, tokens: int):
    """The matmul floor of a forward + backward: the expert GEMMs as two plain matmuls of the total routed
    shape, and their 4 backward GEMMs (input and weight gradients)."""
    rows = tokens * layer.top_k
    latent, inter = layer.experts.w2.shape[2], layer.experts.w2.shape[1]
    z_rows, h_rows = torch.randn(rows, latent, requires_grad=True), torch.randn(rows, inter, requires_grad=True)
    w13 = layer.experts.w13[0].detach().clone().requires_grad_()
    w2 = layer.experts.w2[0].detach().clone().requires_grad_()
    return lambda: ((z_rows @ w13).sum() + (h_rows @ w2).sum()).backward()


def sweep_table(layer, token_counts, repeats) -> list[dict]:
    """Library vs per-expert loop per T, forward (no grad) and forward + backward; at the largest T also the
    matmul floor of both."""
    out = []
    for tokens in token_counts:
        x = torch.randn(1, tokens, layer.hidden_size)
        with torch.no_grad():
            torch.testing.assert_close(per_expert_loop_forward(layer, x), layer(x), **TOL)
            m = interleaved_medians({"grouped": lambda: layer(x),
                                     "per-expert loop": lambda: per_expert_loop_forward(layer, x)}, repeats)
        xg = x.clone().requires_grad_()
        runs = {"grouped fwd+bwd": _with_backward(layer, xg),
                "per-expert loop fwd+bwd": _with_backward(lambda v: per_expert_loop_forward(layer, v), xg)}
        if tokens == max(token_counts):
            runs["matmul floor fwd+bwd"] = floor_with_backward(layer, tokens)
        m.update(interleaved_medians(runs, repeats))
        layer.zero_grad(set_to_none=True)
        out.append({"tokens": tokens, **m, "per_expert_over_grouped": m["per-expert loop"] / m["grouped"],
                    "per_expert_over_grouped_fwd_bwd": m["per-expert loop fwd+bwd"] / m["grouped fwd+bwd"]})
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
    parser.add_argument("--sweep", type=int, nargs="*", default=[64, 512, 4096])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("bench_moe.json"))
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeats, args.sweep = 512, 2, [64, 512]
    apply_threads(args)
    per_token_tokens = min(args.per_token_tokens, args.tokens)

    torch.manual_seed(0)
    config = bench_config()
    layer = LatentMoE(config).eval()
    load_before = os.getloadavg()
    started = time.perf_counter()
    main_result = main_table(layer, args.tokens, args.repeats, per_token_tokens)
    sweep = sweep_table(layer, args.sweep, args.repeats)
    workloads = workload_table(config, args.tokens, args.repeats)
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
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
    print(f"torch {m['torch']}, {m['cores']} cores, {m['torch_threads']} threads, load average "
          f"{m['loadavg_before'][0]:.1f} -> {m['loadavg_after'][0]:.1f}")
    print(f"\nT={main_result['tokens']}: median ms, and time / grouped time "
          f"(dense SwiGLU intermediate {main_result['dense_intermediate']})")
    print(f"| variant | ms | x grouped |\n|---|---:|---:|\n| grouped | {main_result['seconds']['grouped'] * 1e3:.1f} | 1.00 |")
    for name, ratio in main_result["speedup_of_grouped"].items():
        print(f"| {name} | {main_result['seconds'][name] * 1e3:.1f} | {ratio:.2f} |")
    print(f"(per-token loop: timed on {main_result['per_token_tokens_timed']} tokens per round and scaled; "
          f"one untimed-round run over all T took {main_result['per_token_single_full_run_s'] * 1e3:.0f} ms)")
    print("\n| T | grouped ms | per-expert loop ms | per-expert / grouped | fwd+bwd: grouped ms | per-expert loop ms "
          "| per-expert / grouped |\n|---:|---:|---:|---:|---:|---:|---:|")
    for row in result["sweep"]:
        print(f"| {row['tokens']} | {row['grouped'] * 1e3:.2f} | {row['per-expert loop'] * 1e3:.2f} | "
              f"{row['per_expert_over_grouped']:.2f} | {row['grouped fwd+bwd'] * 1e3:.2f} | "
              f"{row['per-expert loop fwd+bwd'] * 1e3:.2f} | {row['per_expert_over_grouped_fwd_bwd']:.2f} |")
    last = result["sweep"][-1]
    print(f"T={last['tokens']} fwd+bwd: grouped / matmul floor "
          f"{last['grouped fwd+bwd'] / last['matmul floor fwd+bwd']:.2f}")
    print("\n| workload | max/mean | min/mean | dropped @ cf 1.25 | expert ms | x uniform | padded rows / rows |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for row in result["workloads"]:
        print(f"| {row['workload']} | {row['max_over_mean']:.2f} | {row['min_over_mean']:.2f} | "
              f"{row['dropped_at_cf_1.25']:.3f} | {row['expert_ms']:.1f} | {row['time_vs_uniform']:.2f} | "
              f"{row['padded_over_rows']:.2f} |")


if __name__ == "__main__":
    main()
