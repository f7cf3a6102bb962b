"""KDA slot formats for a `memory.state_dtype` (docs/design.md §6.3): how the paged pools store each slot's
recurrent state [H, d_k, d_v] and conv tail [channels, kernel - 1]. The compute stays fp32 (the conv in the
compute dtype): a read decodes, a write encodes.

    fp32   state fp32, conv tail in the compute dtype (model.dtype)           paged_pools.PlainSlotFormat
    bf16   state and conv tail in bf16                                        paged_pools.PlainSlotFormat
    int8   state  Int8StateFormat, error feedback on: per d_k row of d_v values, uint8 [H, d_k, d_v + 4 + d_v/2]
                  = int8 codes | fp32 scale | 4-bit residual codes (ops/state_quant.py says what each holds)
           conv   Int8ConvFormat, per tail column and group of G = gcd(d_k, d_v) channels (a group lies inside
                  one head's q, k or v), no feedback: uint8 [channels / G, kernel - 1, G + 4] = G codes | scale

Bytes per slot and KDA layer at the mini preset (H 3, d_k = d_v = 64, 576 channels, kernel 4), state + conv:
fp32 49,152 + 6,912 (fp32 compute), bf16 24,576 + 3,456, int8 19,200 + 1,836 (without feedback 13,056 + 1,836).

Why the conv tail keeps no residual: it is a window of the last kernel - 1 inputs, not an accumulator. A value
is read at most kernel - 1 times and never summed into itself, so its rounding does not build up; a column keeps
its own scale when the window shifts, and re-encoding a decoded column gives back its bytes (codes and scale), so a
value is rounded once, when its token is written.

Each format implements the slot protocol of paged_pools.py (bytes_per_slot, allocate, read, write, in_place).
A write's `carry_from` names the slots whose residual the written rows continue: None is the slots themselves
(a decode or a prompt chunk); a verify step (docs/design.md §12) writes token t's state into a new slot,
continuing the residual of the slot of token t - 1.
"""
from __future__ import annotations

import math

import torch

from latentmoe_lab.ops.state_quant import decode_rows, encode_rows, row_bytes
from latentmoe_lab.paged_pools import PlainSlotFormat

STATE_DTYPES = ("fp32", "bf16", "int8")
# memory.state_dtype int8's carry: 4 bits a value. On the trained mini (1k-16k tokens, benchmarks/RESULTS.md) 8 bits
# gave the same bits/byte to within the noise, but a k3-2.8t slot 2.04x smaller than fp32 instead of 2.67x, which
# fits 1.96x the fp32 requests of 1k tokens in a cache instead of 2.50x.
FEEDBACK_BITS = 4


class Int8StateFormat:
    """State rows (the last dim) in int8 with one fp32 scale each; with residual_bits > 0 (error feedback) the
    rounding error of each write, in residual_bits per value, is carried into the next write of the same slot
    (ops/state_quant.py)."""

    in_place = False  # the stored bytes are not the values: the fused decode runs on a decoded copy

    def __init__(self, residual_bits: int = FEEDBACK_BITS):
        row_bytes(1, residual_bits)  # ValueError naming residual_bits unless 0, 4 or 8
        self.residual_bits = residual_bits

    def __repr__(self) -> str:
        return f"Int8StateFormat(residual_bits={self.residual_bits})"

    def bytes_per_slot(self, shape: tuple[int, ...]) -> int:
        return math.prod(shape[:-1]) * row_bytes(shape[-1], self.residual_bits)

    def allocate(self, num_slots: int, shape: tuple[int, ...], device=None) -> torch.Tensor:
        """uint8 [num_slots, *shape[:-1], row bytes], zeros (a zero state with a zero carry)."""
        return torch.zeros(num_slots, *shape[:-1], row_bytes(shape[-1], self.residual_bits), dtype=torch.uint8,
                           device=device)

    def read(self, storage: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """slots [S] -> fp32 [S, *shape]."""
        return decode_rows(storage.index_select(0, slots), self.residual_bits)

    def write(self, storage: torch.Tensor, slots: torch.Tensor, values: torch.Tensor,
              carry_from: torch.Tensor | None = None) -> None:
        """values [S, *shape] into slots [S]; with feedback continuing the residual of carry_from [S] (default
        the slots themselves)."""
        previous = None
        if self.residual_bits:
            previous = storage.index_select(0, slots if carry_from is None else carry_from)
        storage.index_copy_(0, slots, encode_rows(values, self.residual_bits, previous))


class Int8ConvFormat:
    """Conv tails [channels, kernel - 1] in int8, one fp32 scale per tail column and group of `group` channels."""

    in_place = False

    def __init__(self, group: int):
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise ValueError(f"group: channels per scale must be a positive int, got {group!r}")
        self.group = group

    def __repr__(self) -> str:
        return f"Int8ConvFormat(group={self.group})"

    def _groups(self, shape: tuple[int, ...]) -> int:
        channels = shape[0]
        if channels % self.group:
            raise ValueError(f"shape: {channels} conv channels do not split into groups of {self.group}")
        return channels // self.group

    def bytes_per_slot(self, shape: tuple[int, ...]) -> int:
        return self._groups(shape) * shape[1] * row_bytes(self.group, 0)

    def allocate(self, num_slots: int, shape: tuple[int, ...], device=None) -> torch.Tensor:
        """uint8 [num_slots, channels / group, kernel - 1, group + 4]: channel groups first, so that a
        tensor-parallel rank's channels are a slice of dim 1 (serving/transport/tp_rows.py)."""
        return torch.zeros(num_slots, self._groups(shape), shape[1], row_bytes(self.group, 0),
                           dtype=torch.uint8, device=device)

    def read(self, storage: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """slots [S] -> fp32 [S, channels, kernel - 1]."""
        rows = decode_rows(storage.index_select(0, slots), 0)  # [S, groups, kernel - 1, group]
        return rows.transpose(-1, -2).flatten(1, 2)

    def write(self, storage: torch.Tensor, slots: torch.Tensor, values: torch.Tensor,
              carry_from: torch.Tensor | None = None) -> None:
        """values [S, channels, kernel - 1] into slots [S] (carry_from: none to carry; only None is accepted)."""
        if carry_from is not None:
            raise ValueError("carry_from: conv tails keep no residual to carry")
        columns = values.unflatten(1, (-1, self.group)).transpose(-1, -2)  # [S, groups, kernel - 1, group]
        storage.index_copy_(0, slots, encode_rows(columns, 0))


def kda_slot_formats(state_dtype: str, compute_dtype: torch.dtype, head_dim_k: int, head_dim_v: int):
    """(state_format, conv_format) of memory.state_dtype; compute_dtype: the conv tails' under fp32."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"memory.state_dtype: must be one of {list(STATE_DTYPES)}, got {state_dtype!r}")
    if state_dtype == "fp32":
        return PlainSlotFormat(torch.float32), PlainSlotFormat(compute_dtype)
    if state_dtype == "bf16":
        return PlainSlotFormat(torch.bfloat16), PlainSlotFormat(torch.bfloat16)
    return Int8StateFormat(FEEDBACK_BITS), Int8ConvFormat(math.gcd(head_dim_k, head_dim_v))


def kda_slot_bytes(config, state_dtype: str = "fp32", compute_dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """One sequence's KDA slot over every KDA layer of a ModelConfig, as memory.state_dtype stores it:
    {"kda_state": bytes, "kda_conv": bytes}. compute_dtype: the conv tails' dtype under fp32 (the model's).
    The paged pools allocate through the same formats, so this is the planner's count too."""
    kda = config.kda
    num_kda = config.layer_types.count("kda")
    state_format, conv_format = kda_slot_formats(state_dtype, compute_dtype, kda.head_dim_k, kda.head_dim_v)
    channels = kda.num_heads * (2 * kda.head_dim_k + kda.head_dim_v)
    return {"kda_state": num_kda * state_format.bytes_per_slot((kda.num_heads, kda.head_dim_k, kda.head_dim_v)),
            "kda_conv": num_kda * conv_format.bytes_per_slot((channels, kda.conv_kernel - 1))}
