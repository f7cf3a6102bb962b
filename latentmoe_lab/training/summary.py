"""The HTML report of a training run (DIR/report.html): a text summary and the viz.training figures."""
from __future__ import annotations

from pathlib import Path

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.report import write_html_report
from latentmoe_lab.viz.training import expert_load_over_steps_figure, loss_curves_figure


def summary_text(history, settings, config: ModelConfig) -> str:
    lines = [f"preset {settings.preset}: {config.num_layers} layers, hidden {config.hidden_size}, "
             f"{config.moe.num_experts} experts top-{config.moe.top_k}, latent {config.moe.latent_size}",
             f"steps {history.step}/{settings.steps}, global batch {settings.batch} x {settings.seq_len} tokens, "
             f"lr {settings.lr}, {settings.nproc} process(es)",
             f"tokens seen {history.tokens_seen:,} in {history.seconds:.1f} s "
             f"({history.tokens_seen / max(history.seconds, 1e-9):,.0f} tokens/s)"]
    if history.eval:
        step, loss, bpb = history.eval[-1]
        lines.append(f"held-out at step {int(step)}: loss {loss:.4f} nats, {bpb:.3f} bits per byte")
    if history.sample:
        lines += ["", "greedy sample:", history.sample]
    return "\n".join(lines)


def write_training_report(path: Path, history, settings, config: ModelConfig) -> Path:
    labels = [f"layer {i}" for i in range(config.first_dense_layers, config.num_layers)]
    sections = [summary_text(history, settings, config), loss_curves_figure(history.train_loss, history.eval)]
    if history.expert_load:
        sections.append(expert_load_over_steps_figure(history.expert_load, labels))
    return write_html_report(path, f"LatentMoE Lab training run ({settings.preset})", sections)
