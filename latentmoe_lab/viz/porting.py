"""Figures of the porting kit (latentmoe_lab.porting): where an inventory's FLOPs and bytes go."""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots


def inventory_figure(inventory, title: str | None = None) -> go.Figure:
    """Two panels, FLOPs and bytes per layer type, each split into standard ops and custom-work ops."""
    layer_types = sorted({r.layer_type for r in inventory.rows if r.layer_type},
                         key=lambda t: -sum(r.flops for r in inventory.rows if r.layer_type == t))
    fig = make_subplots(rows=1, cols=2, subplot_titles=("FLOPs per token", "bytes moved per token"))
    for kind, color in (("standard", "steelblue"), ("custom", "darkorange")):
        for col, key in ((1, "flops"), (2, "bytes")):
            values = [sum(getattr(r, key) for r in inventory.rows if r.layer_type == t and r.kind == kind)
                      / inventory.tokens for t in layer_types]
            fig.add_trace(go.Bar(x=layer_types, y=values, name=f"{kind} ops", marker_color=color,
                                 legendgroup=kind, showlegend=col == 1), row=1, col=col)
    fig.update_layout(barmode="stack", height=380,
                      title=title or f"{inventory.preset} {inventory.phase}: where the work goes")
    return fig
