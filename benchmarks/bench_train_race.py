"""The quality race at equal training FLOPs: mini against a dense model with mini's active parameters and one
with mini's total parameters, and the plot of every held-out curve bench_train.py writes.

FLOPs are counted as model_flops_per_token (bench_train_parts: 6 x active matmul parameters + 6 x attention
MACs, per token) x tokens, tokens = steps x batch x seq_len. The budget is mini's: --flops-steps steps of
mini at the batch. Each dense model takes round(budget / its FLOPs per step) steps, with the same batches in
the same order, a warm-up of the same share of its run and a cosine to 10% at its last step; each model is
evaluated on the same held-out rows at 1/4, 2/4, 3/4 and 4/4 of its steps, so at matching FLOPs (within
half a step). Steps are fixed, so the curves do not depend on the machine's load; only train_s does.
mini trains at the train preset's lr; each dense model at every lr of --dense-lr, the best one raced.

    python benchmarks/bench_train_race.py benchmarks/bench_train.json benchmarks/bench_train_2threads.json
        # -> benchmarks/bench_train_race.html: bits/byte against training FLOPs and against minutes
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from bench_train_parts import DenseCausalLM, heldout_bits_per_byte, model_flops_per_token
from bench_train_steps import DENSE_LR, dense_trainer, mini_trainer

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.training.corpus import batch_rows, load_corpus, pack
from latentmoe_lab.training.lm import PRESET_DEFAULTS, warmup_cosine

# d_model and heads of the dense models; 4 layers each, mini's depth. The feed-forward width is solved
# so that the count matches (dense_sized): ff 952 for 2.61M active, ff 1536 (= 4 d) for 7.25M total.
DENSE_SHAPES = {"dense_active": ("active", 224, 4), "dense_total": ("total", 384, 6)}
DENSE_LAYERS = 4


def mini_parameters(config: ModelConfig) -> dict:
    """mini's active parameters (model_flops_per_token's count: routed experts at top_k / E) and its total,
    counted the same way but every expert whole: neither counts the embedding lookup or the idle vision tower."""
    model = LatentMoEForCausalLM(config)
    total = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("embed_tokens", "vision")))
    return {"active": model_flops_per_token(model, 128)["active_parameters"], "total": total}


def dense_sized(vocab: int, seq_len: int, target: float, d_model: int, num_heads: int) -> DenseCausalLM:
    """The DenseCausalLM of width d_model whose non-embedding parameters come nearest `target`: per layer
    4 d^2 + 9 d (attention, its biases, two LayerNorms) + ff (2 d + 1) (the MLP), plus the final LayerNorm
    2 d and the head d x vocab; ff solved from that, rounded to a multiple of 8."""
    fixed = DENSE_LAYERS * (4 * d_model ** 2 + 9 * d_model) + 2 * d_model + d_model * vocab
    ff = round((target - fixed) / (DENSE_LAYERS * (2 * d_model + 1)) / 8) * 8
    if ff < 8:
        raise ValueError(f"target: {target:,.0f} parameters is too few for width {d_model} ({fixed:,} without the MLP)")
    return DenseCausalLM(vocab, d_model, DENSE_LAYERS, num_heads, ff, seq_len)


def corpus_rows(seq_len: int, eval_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows [N, seq_len], `eval_rows` evenly spaced held-out rows [eval_rows, seq_len]) of the
    standard-library corpus, as int64."""
    corpus = load_corpus(None, 0.02, verbose=False)
    train_rows, held_rows = pack(corpus.train, seq_len), pack(corpus.held_out, seq_len)
    picked = torch.linspace(0, len(held_rows) - 1, min(eval_rows, len(held_rows))).round().long()
    return train_rows, held_rows[picked].long()


def _train_steps(name: str, model, step, evaluate, steps: int, flops_per_step: float, train_rows, batch: int) -> dict:
    """Train `steps` steps on the fixed batch order; held-out bits/byte after each quarter of them."""
    checkpoints = sorted({max(1, round(steps * k / 4)) for k in (1, 2, 3, 4)})
    curve, trained, load_before = [], 0.0, os.getloadavg()
    for number in range(steps):
        ids = train_rows[batch_rows(number, batch, len(train_rows), 0)].long()
        start = time.perf_counter()
        step(ids)
        trained += time.perf_counter() - start
        if number + 1 in checkpoints:
            model.eval()
            curve.append({"steps": number + 1, "flops": (number + 1) * flops_per_step, "train_s": trained,
                          "bits_per_byte": evaluate()})
            model.train()
            print(f"  {name}: step {number + 1}/{steps}, {curve[-1]['flops'] / 1e12:.2f} TFLOP, {trained:.0f} s, "
                  f"held-out {curve[-1]['bits_per_byte']:.3f} bits/byte", flush=True)
    return {"curve": curve, "train_s": trained, "loadavg_before": load_before, "loadavg_after": os.getloadavg()}


def k3_config(config: ModelConfig) -> ModelConfig:
    """mini with K3's expert-balance switches on: the SiTU expert activation and the quantile bias rule."""
    moe = config.to_dict()["moe"]
    moe.update(activation="situ", bias_update="quantile")
    return config.replace(moe=moe)


def flops_race(config: ModelConfig, batch: int, seq_len: int, mini_steps: int, rows, k3: bool = False,
               dense_lrs: tuple[float, ...] = (DENSE_LR,)) -> dict:
    """Held-out bits/byte against training FLOPs of mini, dense_active and dense_total (and, with k3, mini with
    K3's switches), each trained to mini's FLOPs in `mini_steps` steps of batch x seq_len; rows: corpus_rows.
    Each dense model is trained once per peak learning rate in dense_lrs; its run with the lowest final
    bits/byte is the one raced ("lr_sweep" keeps every final figure)."""
    defaults = PRESET_DEFAULTS["mini"]
    sizes = mini_parameters(config)
    mini_flops = model_flops_per_token(LatentMoEForCausalLM(config), seq_len)["flops_per_token"]
    budget = mini_steps * batch * seq_len * mini_flops
    entries = [("mini", config, (defaults["lr"],))] + ([("mini_situ_quantile", k3_config(config), (defaults["lr"],))]
                                                      if k3 else [])
    for name, (count, d_model, heads) in DENSE_SHAPES.items():
        entries.append((name, lambda t=sizes[count], d=d_model, h=heads: dense_sized(
            config.vocab_size, seq_len, t, d, h), dense_lrs))
    out = {"budget_flops": budget, "mini_steps": mini_steps, "batch": batch, "seq_len": seq_len,
           "mini_parameters": sizes, "models": {}, "lr_sweep": {}}
    for name, spec, lrs in entries:
        runs = [_race_one(name, spec, lr, budget, mini_steps, batch, rows) for lr in lrs]
        out["models"][name] = min(runs, key=lambda run: run["curve"][-1]["bits_per_byte"])
        out["lr_sweep"][name] = {f"{run['lr']:g}": run["curve"][-1]["bits_per_byte"] for run in runs}
    final = {name: run["curve"][-1]["bits_per_byte"] for name, run in out["models"].items()}
    out["ratios"] = {f"{sparse}_over_{dense}": final[sparse] / final[dense]
                     for sparse in final if sparse.startswith("mini") for dense in DENSE_SHAPES}
    return out


def _race_one(name: str, spec, lr: float, budget: float, mini_steps: int, batch: int, rows) -> dict:
    """One model trained to `budget` FLOPs at peak lr `lr`; spec: a ModelConfig (mini) or a dense builder."""
    train_rows, held = rows
    seq_len = held.shape[1]
    is_mini = isinstance(spec, ModelConfig)
    counts = model_flops_per_token(LatentMoEForCausalLM(spec) if is_mini else spec(), seq_len)
    steps = round(budget / (counts["flops_per_token"] * batch * seq_len))
    warmup = max(1, min(steps, round(PRESET_DEFAULTS["mini"]["warmup"] * steps / mini_steps)))
    if is_mini:
        model, step = mini_trainer(spec, lr, warmup, steps)
        evaluate = lambda: heldout_bits_per_byte(lambda ids: model(ids, labels=ids).loss, held)  # noqa: E731
        shape = {}
    else:
        model, step = dense_trainer(spec, lr, warmup, steps)
        evaluate = lambda: heldout_bits_per_byte(model.loss, held)  # noqa: E731
        shape = {"d_model": model.d_model, "layers": model.num_layers,
                 "ff": model.encoder.layers[0].linear1.out_features}
    print(f"  {name}: {counts['active_parameters'] / 1e6:.3f}M active parameters, "
          f"{counts['flops_per_token'] / 1e6:.2f} MFLOP/token, {steps} steps (warm-up {warmup}, lr {lr:g})", flush=True)
    run = _train_steps(name, model, step, evaluate, steps, counts["flops_per_token"] * batch * seq_len, train_rows,
                       batch)
    return {**counts, **shape, "steps": steps, "warmup": warmup, "lr": lr, **run}


def figure(runs: dict[str, dict]):
    """Two panels: held-out bits/byte against training FLOPs (the first run's FLOPs race) and against
    training minutes (every run's wall-clock race). runs: label -> a bench_train.py result."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("at equal training FLOPs (fixed steps)",
                                                        "at equal wall-clock minutes"))
    race = next((run["flops_race"] for run in runs.values() if "flops_race" in run), None)
    for name, model in (race or {"models": {}})["models"].items():
        curve = model["curve"]
        fig.add_trace(_line([c["flops"] / 1e12 for c in curve], [c["bits_per_byte"] for c in curve],
                            f"{name} ({model['active_parameters'] / 1e6:.2f}M active, {model['steps']} steps)"),
                      row=1, col=1)
    for label, run in runs.items():
        if "quality" not in run:
            continue
        load = run["machine"]["loadavg_before"][0]
        for name in ("mini", "dense"):
            curve = run["quality"][name]
            fig.add_trace(_line([c["train_s"] / 60 for c in curve], [c["bits_per_byte"] for c in curve],
                                f"{name}, {label} (load {load:.1f})", dash=run["machine"]["threads"] > 1),
                          row=1, col=2)
    fig.update_xaxes(title_text="training TFLOP (model_flops_per_token x tokens)", row=1, col=1)
    fig.update_xaxes(title_text="training minutes", row=1, col=2)
    fig.update_yaxes(title_text="held-out bits per byte", row=1, col=1)
    fig.update_layout(height=520, width=1100, legend={"orientation": "h", "y": -0.2})
    return fig


def _line(x, y, name: str, dash: bool = False):
    import plotly.graph_objects as go

    return go.Scatter(x=x, y=y, name=name, mode="lines+markers", line={"dash": "dash" if dash else "solid"})


def main() -> None:
    import json

    from latentmoe_lab.report import Captioned, Data, write_html_report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="bench_train.py JSON files (the FLOPs race drawn is "
                        "the first file's that has one)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("bench_train_race.html"),
                        help="the HTML page (default: bench_train_race.html here)")
    args = parser.parse_args()
    runs = {}
    for path in args.results:
        run = json.loads(path.read_text())
        threads = run["machine"]["threads"]
        runs[f"{path.stem}, {threads} thread{'s' if threads > 1 else ''}"] = run
    caption = ("Left: fixed steps, so load-independent. Right: each model trained for the same minutes on this "
               "machine at the load shown; dashed lines are 2 threads.")
    page = write_html_report(args.out, "mini against dense: held-out bits per byte",
                             [Captioned(figure(runs), caption), Data("runs", runs)])
    print(f"plot: {page}")


if __name__ == "__main__":
    main()
