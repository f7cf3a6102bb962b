"""ViT-style vision tower (docs/design.md §1.5): patches -> ViT blocks (2D rotary) -> 2x2 merger -> projector.

Input layout (what `latentmoe_lab.multimodal` emits; every image of a batch in one tensor):
    pixel_values [N, C * p * p]   every patch of every image, flattened as (channel, row, col),
                                  images one after another, each in merge-window order
                                  (window_row, window_col, row_in_window, col_in_window)
    image_grids  [I, 2]           (rows, cols) of patches per image, both multiples of the merge size m

    x   = W_patch pixel_values                                  [N, d_v]
    x   = ViTBlock(x), L times      attention within one image only; q, k rotated by (row, col)
    w   = each m x m window of LayerNorm(x), concatenated       [N / m^2, m^2 d_v]   (patch merger)
    out = W_2 GELU(W_1 LayerNorm(w))                            [N / m^2, hidden]    (projector)

2D rotary positions: the first half of each head's dims rotates with the patch row, the second half
with the column. Scores then depend on relative (row, col) offsets only, so any image size works
without interpolating a learned position table. Merge-window order makes every window m^2
consecutive rows, so the merger is a reshape, and merged tokens come out in raster order of windows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from latentmoe_lab.config import ModelConfig, VisionConfig

ROPE_THETA = 10000.0


def patch_positions(image_grids: torch.Tensor, merge_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """image_grids [I, 2] -> (rows [N], cols [N], image_index [N]) of every patch, in merge-window order."""
    rows, cols, owner = [], [], []
    for index, (height, width) in enumerate(image_grids.tolist()):  # one step per image, not per patch
        window_rows, window_cols = height // merge_size, width // merge_size
        grid_shape = (window_rows, window_cols, merge_size, merge_size)
        row = torch.arange(height).view(window_rows, 1, merge_size, 1).expand(grid_shape)
        col = torch.arange(width).view(1, window_cols, 1, merge_size).expand(grid_shape)
        rows.append(row.reshape(-1))
        cols.append(col.reshape(-1))
        owner.append(torch.full((height * width,), index))
    device = image_grids.device
    return torch.cat(rows).to(device), torch.cat(cols).to(device), torch.cat(owner).to(device)


def rotary_2d(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, theta: float = ROPE_THETA) -> torch.Tensor:
    """Rotate x [N, H, D] (D divisible by 4): dims [:D/2] by angles row * f, dims [D/2:] by col * f (fp32 math)."""
    quarter = x.shape[-1] // 4
    freqs = theta ** (-torch.arange(quarter, device=x.device, dtype=torch.float32) / quarter)  # [D/4]
    by_row, by_col = x.float().chunk(2, dim=-1)
    rotated = [_rotate_pairs(by_row, rows[:, None].float() * freqs),
               _rotate_pairs(by_col, cols[:, None].float() * freqs)]
    return torch.cat(rotated, dim=-1).to(x.dtype)


def _rotate_pairs(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x [N, H, 2q], angles [N, q]: rotate each pair (x_i, x_{i+q}) by angles_i."""
    a, b = x.chunk(2, dim=-1)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class VisionAttention(nn.Module):
    """Multi-head self-attention over patches; a patch sees every patch of its own image (no causality)."""

    def __init__(self, vision: VisionConfig):
        super().__init__()
        self.num_heads = vision.num_heads
        self.qkv = nn.Linear(vision.hidden_size, 3 * vision.hidden_size)
        self.out = nn.Linear(vision.hidden_size, vision.hidden_size)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                same_image: torch.Tensor) -> torch.Tensor:
        """x [N, d_v]; rows, cols [N]; same_image [N, N] bool -> [N, d_v]."""
        q, k, v = rearrange(self.qkv(x), "n (three h d) -> three n h d", three=3, h=self.num_heads)
        q, k = rotary_2d(q, rows, cols), rotary_2d(k, rows, cols)
        # fp32 softmax whatever the storage dtype
        q, k, v = (rearrange(t.float(), "n h d -> h n d") for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=same_image)
        return self.out(rearrange(attn, "h n d -> n (h d)").to(x.dtype))


class VisionBlock(nn.Module):
    """Pre-norm ViT block: x + Attn(LN(x)), then + MLP(LN(x)) with a GELU MLP."""

    def __init__(self, vision: VisionConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(vision.hidden_size, eps=1e-6)
        self.attn = VisionAttention(vision)
        self.mlp_norm = nn.LayerNorm(vision.hidden_size, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(vision.hidden_size, vision.intermediate_size), nn.GELU(approximate="tanh"),
                                 nn.Linear(vision.intermediate_size, vision.hidden_size))

    def forward(self, x, rows, cols, same_image):
        x = x + self.attn(self.attn_norm(x), rows, cols, same_image)
        return x + self.mlp(self.mlp_norm(x))


class PatchMerger(nn.Module):
    """LayerNorm each patch, then concatenate each m x m window: [N, d_v] -> [N / m^2, m^2 d_v]."""

    def __init__(self, vision: VisionConfig):
        super().__init__()
        self.window = vision.merge_size ** 2
        self.norm = nn.LayerNorm(vision.hidden_size, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rearrange(self.norm(x), "(n w) d -> n (w d)", w=self.window)


class Projector(nn.Module):
    """Merged windows into the text hidden size: W_2 GELU(W_1 LayerNorm(w)). [M, m^2 d_v] -> [M, hidden]."""

    def __init__(self, merged_size: int, hidden_size: int):
        super().__init__()
        self.norm = nn.LayerNorm(merged_size, eps=1e-6)
        self.fc1 = nn.Linear(merged_size, merged_size)
        self.fc2 = nn.Linear(merged_size, hidden_size)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(w)), approximate="tanh"))


class VisionTower(nn.Module):
    """forward(pixel_values [N, C*p*p], image_grids [I, 2]) -> image features [N / m^2, hidden], in order."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if not isinstance(config, ModelConfig) or config.vision is None:
            raise ValueError("config: expected a ModelConfig whose `vision` part is set")
        vision = config.vision
        self.patch_size, self.in_channels, self.merge_size = vision.patch_size, vision.in_channels, vision.merge_size
        self.patch_dim = vision.in_channels * vision.patch_size ** 2
        self.patch_embed = nn.Linear(self.patch_dim, vision.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(vision) for _ in range(vision.num_layers))
        self.merger = PatchMerger(vision)
        self.projector = Projector(vision.merge_size ** 2 * vision.hidden_size, config.hidden_size)

    def tokens_per_image(self, image_grids: torch.Tensor) -> torch.Tensor:
        """image_grids [I, 2] -> merged tokens per image [I] (rows * cols / m^2)."""
        return image_grids[:, 0] * image_grids[:, 1] // self.merge_size ** 2

    def forward(self, pixel_values: torch.Tensor, image_grids: torch.Tensor) -> torch.Tensor:
        self.check_inputs(pixel_values, image_grids)
        rows, cols, owner = patch_positions(image_grids, self.merge_size)
        same_image = owner[:, None] == owner[None, :]  # [N, N]: images never attend to each other
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        for block in self.blocks:
            x = block(x, rows, cols, same_image)
        return self.projector(self.merger(x))

    def check_inputs(self, pixel_values: torch.Tensor, image_grids: torch.Tensor) -> None:
        if not isinstance(pixel_values, torch.Tensor) or not pixel_values.is_floating_point():
            raise TypeError(f"pixel_values: expected a floating-point tensor [N, C*p*p], "
                            f"got {getattr(pixel_values, 'dtype', type(pixel_values).__name__)}")
        if pixel_values.dim() != 2 or pixel_values.shape[1] != self.patch_dim:
            raise ValueError(f"pixel_values: expected shape [N, C*p*p = {self.in_channels}*{self.patch_size}^2 = "
                             f"{self.patch_dim}], got {tuple(pixel_values.shape)}")
        if not isinstance(image_grids, torch.Tensor) or image_grids.is_floating_point():
            raise TypeError("image_grids: expected an integer tensor [I, 2] of (rows, cols) of patches")
        if image_grids.dim() != 2 or image_grids.shape[1] != 2 or image_grids.shape[0] < 1:
            raise ValueError(f"image_grids: expected shape [I >= 1, 2], got {tuple(image_grids.shape)}")
        m = self.merge_size
        if bool((image_grids > pixel_values.shape[0]).any()):  # bounded first: rows * cols must not wrap int64
            raise ValueError(f"image_grids: a side of {int(image_grids.max())} patches exceeds the "
                             f"{pixel_values.shape[0]} patches of pixel_values")
        if bool((image_grids < m).any()) or bool((image_grids % m != 0).any()):
            raise ValueError(f"image_grids: rows and cols must be positive multiples of merge_size={m}, "
                             f"got {image_grids.tolist()}")
        expected = int((image_grids[:, 0] * image_grids[:, 1]).sum())
        if expected != pixel_values.shape[0]:
            raise ValueError(f"pixel_values: has {pixel_values.shape[0]} patches but image_grids "
                             f"{image_grids.tolist()} describe {expected}")
        if not bool(torch.isfinite(pixel_values).all()):
            raise ValueError("pixel_values: contains NaN or inf")
