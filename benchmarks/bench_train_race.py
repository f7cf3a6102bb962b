"""The quality race at equal training FLOPs: mini against dense models with mini's active and with its total
parameters, and the plot of every held-out curve bench_train.py writes.

The racers (RACERS): mini; mini_situ_quantile (K3's SiTU activation and quantile bias rule); dense_active /
dense_total, torch transformers (DenseCausalLM) of mini's depth; twin_active / twin_total, mini with a dense
SwiGLU FFN in every layer instead of the MoE, which isolates what the experts buy.

FLOPs are counted as model_flops_per_token (bench_train_parts: 6 x active matmul parameters + 6 x attention
MACs, per token) x tokens, tokens = steps x batch x seq_len. The budget is mini's: --flops-steps steps of
mini at the batch. Each other model takes round(budget / its FLOPs per step) steps, with the same batches in
the same order, a warm-up of the same share of its run and a cosine to 10% at its last step; each model is
evaluated on the same held-out rows at 1/4, 2/4, 3/4 and 4/4 of its steps, so at matching FLOPs (within
half a step). Steps are fixed, so the curves do not depend on the machine's load; only train_s does.
mini, its variant and its twins train at the train preset's lr; each dense transformer at every lr of
--dense-lr, the best one raced.

    python benchmarks/bench_train.py --threads 1 --flops-steps 450 --race mini,twin_active,twin_total
    python benchmarks/bench_train_race.py benchmarks/bench_train_race.json benchmarks/bench_train_race_twins.json \
        benchmarks/bench_train_race_8min.json benchmarks/bench_train_race_8min_2threads.json \
        benchmarks/bench_train_race_2threads.json
        # -> benchmarks/bench_train_race.html (git-ignored, like every *.html): bits/byte against training
        #    FLOPs and against minutes
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
from latentmoe_lab.training.lm import PRESET_DEFAULTS

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


def twin_config(config: ModelConfig, target: float) -> ModelConfig:
    """mini's dense twin: the same embedding, attention stack and norms, a SwiGLU FFN in every layer instead of
    the MoE, its width (a multiple of 8) giving the active parameter count nearest `target`. The count is
    linear in the width, so two probe widths give its slope and offset."""
    def active(width: int) -> float:
        probe = LatentMoEForCausalLM(config.replace(first_dense_layers=config.num_layers,
                                                    dense_intermediate_size=width))
        return model_flops_per_token(probe, 128)["active_parameters"]

    low, high = active(8), active(16)
    width = max(8, round((target - low) / ((high - low) / 8) / 8) * 8 + 8)
    return config.replace(first_dense_layers=config.num_layers, dense_intermediate_size=width)


# What --race can name: mini, mini with K3's switches, the dense transformers (DenseCausalLM, DENSE_SHAPES) and
# mini's dense twins (twin_config), sized to mini's active or total parameters.
RACERS = ("mini", "mini_situ_quantile", "dense_active", "dense_total", "twin_active", "twin_total")
MINI_FAMILY = ("mini", "mini_situ_quantile", "twin_active", "twin_total")  # LatentMoEForCausalLM configs


def mini_family(config: ModelConfig, names) -> dict[str, ModelConfig]:
    """The configs of the MINI_FAMILY racers among `names`, in their order: mini, its K3 variant, its twins."""
    sizes = mini_parameters(config) if any(name.startswith("twin") for name in names) else {}
    build = {"mini": lambda: config, "mini_situ_quantile": lambda: k3_config(config),
             "twin_active": lambda: twin_config(config, sizes["active"]),
             "twin_total": lambda: twin_config(config, sizes["total"])}
    return {name: build[name]() for name in names if name in MINI_FAMILY}


def flops_race(config: ModelConfig, batch: int, seq_len: int, mini_steps: int, rows,
               racers: tuple[str, ...] = ("mini", "dense_active", "dense_total"),
               dense_lrs: tuple[float, ...] = (DENSE_LR,)) -> dict:
    """Held-out bits/byte against training FLOPs of each of `racers` (RACERS), each trained to mini's FLOPs in
    `mini_steps` steps of batch x seq_len; rows: corpus_rows. mini, its K3 variant and its twins train at the
    train preset's lr; each dense transformer once per peak lr in dense_lrs, its run with the lowest final
    bits/byte raced ("lr_sweep" keeps every final figure). ratios: each mini over each other racer, at budget."""
    unknown = sorted(set(racers) - set(RACERS))
    if unknown:
        raise ValueError(f"racers: {unknown} are not among {RACERS}")
    defaults = PRESET_DEFAULTS["mini"]
    sizes = mini_parameters(config)
    mini_flops = model_flops_per_token(LatentMoEForCausalLM(config), seq_len)["flops_per_token"]
    budget = mini_steps * batch * seq_len * mini_flops
    specs: dict = mini_family(config, racers)
    for name, (count, d_model, heads) in DENSE_SHAPES.items():
        specs[name] = lambda t=sizes[count], d=d_model, h=heads: dense_sized(config.vocab_size, seq_len, t, d, h)
    out = {"budget_flops": budget, "mini_steps": mini_steps, "batch": batch, "seq_len": seq_len,
           "mini_parameters": sizes, "models": {}, "lr_sweep": {}}
    for name in racers:
        lrs = dense_lrs if name in DENSE_SHAPES else (defaults["lr"],)
        runs = [_race_one(name, specs[name], lr, budget, mini_steps, batch, rows) for lr in lrs]
        out["models"][name] = min(runs, key=lambda run: run["curve"][-1]["bits_per_byte"])
        out["lr_sweep"][name] = {f"{run['lr']:g}": run["curve"][-1]["bits_per_byte"] for run in runs}
    final = {name: run["curve"][-1]["bits_per_byte"] for name, run in out["models"].items()}
    sparse = [name for name in final if name.startswith("mini")]
    out["ratios"] = {f"{mini}_over_{other}": final[mini] / final[other]
                     for mini in sparse for other in final if other not in sparse}
    return out


def _race_one(name: str, spec, lr: float, budget: float, mini_steps: int, batch: int, rows) -> dict:
    """One model trained to `budget` FLOPs at peak lr `lr`; spec: a ModelConfig (mini, its variants and twins)
    or a dense transformer's builder."""
    train_rows, held = rows
    seq_len = held.shape[1]
    is_mini = isinstance(spec, ModelConfig)
    counts = model_flops_per_token(LatentMoEForCausalLM(spec) if is_mini else spec(), seq_len)
    steps = round(budget / (counts["flops_per_token"] * batch * seq_len))
    warmup = max(1, min(steps, round(PRESET_DEFAULTS["mini"]["warmup"] * steps / mini_steps)))
    if is_mini:
        model, step = mini_trainer(spec, lr, warmup, steps)
        evaluate = lambda: heldout_bits_per_byte(lambda ids: model(ids, labels=ids).loss, held)  # noqa: E731
        shape = {"dense_intermediate_size": spec.dense_intermediate_size} if name.startswith("twin") else {}
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
    """Two panels: held-out bits/byte against training FLOPs (every FLOPs race; a model raced in several runs
    drawn once, from its run with the lowest final bits/byte) and against training minutes (every run's
    wall-clock race). runs: label -> a bench_train.py result."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("at equal training FLOPs (fixed steps)",
                                                        "at equal wall-clock minutes"))
    best: dict[str, dict] = {}
    for run in runs.values():
        for name, model in run.get("flops_race", {}).get("models", {}).items():
            if name not in best or model["curve"][-1]["bits_per_byte"] < best[name]["curve"][-1]["bits_per_byte"]:
                best[name] = model
    for name, model in best.items():
        curve = model["curve"]
        fig.add_trace(_line([c["flops"] / 1e12 for c in curve], [c["bits_per_byte"] for c in curve],
                            f"{name} ({model['active_parameters'] / 1e6:.2f}M active, {model['steps']} steps, "
                            f"lr {model['lr']:g})"), row=1, col=1)
    wall_races = [(label, run) for label, run in runs.items() if "quality" in run]
    for (label, run), dash in zip(wall_races, ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")):
        load = run["machine"]["loadavg_before"][0]
        for name, color in (("mini", "#1f77b4"), ("dense", "#d62728")):  # one colour per model, one dash per run
            curve = run["quality"][name]
            fig.add_trace(_line([c["train_s"] / 60 for c in curve], [c["bits_per_byte"] for c in curve],
                                f"{name}, {label} (load {load:.1f})", {"dash": dash, "color": color}), row=1, col=2)
    fig.update_xaxes(title_text="training TFLOP (model_flops_per_token x tokens)", row=1, col=1)
    fig.update_xaxes(title_text="training minutes", row=1, col=2)
    fig.update_yaxes(title_text="held-out bits per byte", row=1, col=1)
    fig.update_layout(height=520, width=1100, legend={"orientation": "h", "y": -0.2})
    return fig


def _line(x, y, name: str, line: dict | None = None):
    import plotly.graph_objects as go

    return go.Scatter(x=x, y=y, name=name, mode="lines+markers", line=line or {})


def main() -> None:
    import json

    from latentmoe_lab.report import Captioned, Data, write_html_report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="bench_train.py JSON files (a model raced in "
                        "several is drawn from the run where it ended lowest)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("bench_train_race.html"),
                        help="the HTML page (default: bench_train_race.html here)")
    args = parser.parse_args()
    runs = {}
    for path in args.results:
        run = json.loads(path.read_text())
        threads = run["machine"]["threads"]
        runs[f"{path.stem}, {threads} thread{'s' if threads > 1 else ''}"] = run
    caption = ("Left: fixed steps, so load-independent. Right: mini (blue) and the dense reference (red) trained "
               "for the same minutes, steps interleaved, at the load shown; one dash style per run.")
    page = write_html_report(args.out, "mini against dense: held-out bits per byte",
                             [Captioned(figure(runs), caption), Data("runs", runs)])
    print(f"plot: {page}")


if __name__ == "__main__":
    main()
