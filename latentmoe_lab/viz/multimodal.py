"""Figures about native multimodal token mixing: patches and merge windows, the interleaved sequence,
tokens and cache per image size, routing by modality, the tiny VQA training run, prefill chunking.

Every builder takes plain numbers, tensors or the dataclasses of latentmoe_lab.multimodal and returns a
go.Figure; nothing here runs a model.
"""
from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

# One colour per token kind, shared by the sequence figures.
KIND_COLOURS = {"text": "#4c78a8", "image": "#f58518", "image_start": "#54a24b", "image_end": "#54a24b",
                "pad": "#e0e0e0"}


def patch_grid_figure(image: torch.Tensor, patch_size: int, merge_size: int,
                      title: str = "Patches (thin lines) and merge windows (thick): one text token per window"
                      ) -> go.Figure:
    """The image [3, H, W] in [0, 1] (H, W multiples of patch * merge) with its patch grid and merged-token order."""
    height, width = image.shape[-2:]
    fig = go.Figure(go.Image(source=_png_data_uri(image)))
    window = patch_size * merge_size
    for x in range(0, width + 1, patch_size):
        fig.add_shape(type="line", x0=x - 0.5, x1=x - 0.5, y0=-0.5, y1=height - 0.5,
                      line=dict(color="white", width=3 if x % window == 0 else 1))
    for y in range(0, height + 1, patch_size):
        fig.add_shape(type="line", x0=-0.5, x1=width - 0.5, y0=y - 0.5, y1=y - 0.5,
                      line=dict(color="white", width=3 if y % window == 0 else 1))
    cols = width // window
    for index in range((height // window) * cols):
        row, col = divmod(index, cols)
        fig.add_annotation(x=(col + 0.5) * window, y=(row + 0.5) * window, text=str(index), showarrow=False,
                           font=dict(color="black", size=14), bgcolor="rgba(255,255,255,0.7)")
    fig.update_layout(title=title, xaxis_visible=False, yaxis_visible=False)
    return fig


def sequence_layout_figure(kinds: Sequence[Sequence[str]], hover: Sequence[Sequence[str]] | None = None,
                           row_labels: Sequence[str] | None = None,
                           title: str = "Token kinds along the sequence") -> go.Figure:
    """One strip per row: kinds[r][t] in KIND_COLOURS (text, image, image_start, image_end, pad)."""
    names = list(KIND_COLOURS)
    unknown = sorted({k for row in kinds for k in row} - set(names))
    if unknown:
        raise ValueError(f"kinds: unknown token kinds {unknown}; expected some of {names}")
    width = max(len(row) for row in kinds)
    codes = [[names.index(k) for k in row] + [None] * (width - len(row)) for row in kinds]
    text = None if hover is None else [list(row) + [""] * (width - len(row)) for row in hover]
    scale = [(i / (len(names) - 1), KIND_COLOURS[n]) for i, n in enumerate(names)]
    fig = go.Figure(go.Heatmap(z=codes, text=text, hovertemplate="t=%{x}: %{text}<extra></extra>",
                               colorscale=scale, zmin=0, zmax=len(names) - 1, showscale=False, xgap=1, ygap=4,
                               y=list(row_labels) if row_labels is not None else None))
    for name in ("text", "image", "image_start", "pad"):  # a legend: one invisible marker per kind
        label = "image start / end" if name == "image_start" else name
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=label,
                                 marker=dict(size=12, symbol="square", color=KIND_COLOURS[name])))
    # A one-row strip leaves ~40 px of plot: a vertical legend of 4 kinds would be cut off, so it runs
    # horizontally above the strip, with room for it and the title in the top margin.
    fig.update_layout(title=title, xaxis_title="position", yaxis_autorange="reversed", plot_bgcolor="white",
                      height=200 + 40 * len(kinds), margin=dict(t=110, b=60),
                      legend=dict(orientation="h", yanchor="bottom", y=1.05, xanchor="left", x=0))
    return fig


def image_cost_figure(costs: Sequence, title: str = "What one image costs the text model") -> go.Figure:
    """Bars of sequence tokens per image size and a line of the cache bytes they add (ImageCost records)."""
    labels = [f"{c.height}x{c.width}" for c in costs]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Bar(x=labels, y=[c.sequence_tokens for c in costs], name="tokens in the sequence",
                         text=[c.sequence_tokens for c in costs], textposition="outside"))
    fig.add_trace(go.Scatter(x=labels, y=[c.cache_bytes / 2 ** 20 for c in costs], name="cache MiB (all DSA layers)",
                             mode="lines+markers"), secondary_y=True)
    fig.update_layout(title=title, xaxis_title="image size (pixels)")
    fig.update_yaxes(title_text="tokens", secondary_y=False)
    fig.update_yaxes(title_text="MiB", secondary_y=True)
    return fig


def modality_routing_figure(text_fraction, image_fraction, layer_labels: Sequence[str],
                            title: str = "Expert load by modality (share of each modality's assignments)"
                            ) -> go.Figure:
    """Heatmaps [layers, experts] of the text share, the image share, and image minus text."""
    text = [[float(v) for v in row] for row in text_fraction]
    image = [[float(v) for v in row] for row in image_fraction]
    difference = [[i - t for i, t in zip(ri, rt)] for ri, rt in zip(image, text)]
    top = max(max(max(r) for r in text), max(max(r) for r in image))
    spread = max(abs(v) for row in difference for v in row) or 1.0
    fig = make_subplots(rows=1, cols=3, shared_yaxes=True, horizontal_spacing=0.06,
                        subplot_titles=("text tokens", "image tokens", "image - text"))
    labels = list(layer_labels)
    fig.add_trace(go.Heatmap(z=text, y=labels, zmin=0, zmax=top, colorscale="Blues", showscale=False), 1, 1)
    fig.add_trace(go.Heatmap(z=image, y=labels, zmin=0, zmax=top, colorscale="Oranges", showscale=False), 1, 2)
    fig.add_trace(go.Heatmap(z=difference, y=labels, zmin=-spread, zmax=spread, colorscale="RdBu_r",
                             colorbar_title="image - text"), 1, 3)
    for col in (1, 2, 3):
        fig.update_xaxes(title_text="expert", row=1, col=col)
    fig.update_layout(title=title, yaxis_autorange="reversed")
    return fig


def modality_overlap_figure(overlap: Sequence[float], shared: Sequence[int], num_experts: int,
                            layer_labels: Sequence[str],
                            title: str = "Do image and text tokens use the same experts?") -> go.Figure:
    """Per layer: load overlap sum_e min(text_e, image_e) (bars) and experts used by both (text labels)."""
    fig = go.Figure(go.Bar(x=list(layer_labels), y=list(overlap), text=[f"{s}/{num_experts} shared" for s in shared],
                           textposition="outside"))
    fig.update_layout(title=title, yaxis_title="load overlap (1 = same distribution)", yaxis_range=[0, 1.15])
    return fig


def training_curve_figure(result, title: str = "Tiny visual question answering run") -> go.Figure:
    """Loss curves of a TrainingResult (all answer tokens, first answer token, chance level) and accuracies."""
    steps = list(range(1, len(result.losses) + 1))
    fig = make_subplots(rows=1, cols=2, column_widths=[0.7, 0.3],
                        subplot_titles=("answer loss per step", "held-out accuracy"))
    fig.add_trace(go.Scatter(x=steps, y=result.losses, name="all answer tokens", mode="lines"), 1, 1)
    fig.add_trace(go.Scatter(x=steps, y=result.first_token_losses, name="first answer token", mode="lines"), 1, 1)
    fig.add_trace(go.Scatter(x=[steps[0], steps[-1]], y=[result.chance_loss] * 2, mode="lines",
                             name="chance level (ln #answers)", line=dict(dash="dash", color="gray")), 1, 1)
    bars = {"before": result.accuracy_before, "after": result.accuracy_after, "chance": result.chance}
    bars.update({f"after: {k}": v for k, v in result.accuracy_by_kind.items()})
    fig.add_trace(go.Bar(x=list(bars), y=list(bars.values()), text=[f"{v:.0%}" for v in bars.values()],
                         textposition="outside", showlegend=False, marker_color="seagreen"), 1, 2)
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_yaxes(title_text="cross-entropy (nats)", row=1, col=1)
    fig.update_yaxes(range=[0, 1.15], tickformat=".0%", row=1, col=2)
    fig.update_layout(title=title)
    return fig


def chunk_sizes_figure(chunks_by_policy: Mapping[str, Sequence[tuple[int, int]]], image_spans=(),
                       title: str = "Prefill chunks over an interleaved prompt") -> go.Figure:
    """One row of chunk bars per policy ((start, end) half-open), image spans shaded behind them."""
    fig = go.Figure()
    policies = list(chunks_by_policy)
    for start, end in image_spans:
        fig.add_vrect(x0=start, x1=end, fillcolor=KIND_COLOURS["image"], opacity=0.25, line_width=0)
    for row, policy in enumerate(policies):
        chunks = chunks_by_policy[policy]
        fig.add_trace(go.Bar(y=[policy] * len(chunks), x=[end - start for start, end in chunks],
                             base=[start for start, _ in chunks], orientation="h", showlegend=False,
                             text=[str(end - start) for start, end in chunks], textposition="inside",
                             marker=dict(color=[("#4c78a8", "#72b7b2")[i % 2] for i in range(len(chunks))],
                                         line=dict(color="white", width=2))))
    fig.update_layout(title=title + " (shaded: image spans)", xaxis_title="position", barmode="overlay",
                      height=150 + 60 * len(policies))
    return fig


def _png_data_uri(image: torch.Tensor) -> str:
    """[3, H, W] in [0, 1] -> a PNG data URI: a few KB in a saved notebook instead of one JSON number per pixel."""
    from PIL import Image

    pixels = (image.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).contiguous()
    buffer = io.BytesIO()
    Image.frombytes("RGB", (image.shape[-1], image.shape[-2]), pixels.numpy().tobytes()).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
