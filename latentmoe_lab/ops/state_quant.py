"""int8 rows with one fp32 scale each and an optional error-feedback residual: the KDA slot codec (design.md §6.3).

A row is n fp32 values (one d_k row of a KDA state: its d_v values; or one conv-tail column of a channel
group). It is stored as bytes, row-interleaved, so a slot, a head or a channel group is one slice:

    [0, n)                 int8 codes c = round(t / s), |c| <= 127        t: the values written (+ the carry)
    [n, n + 4)             fp32 scale s = max|t| / 127 (0 for an all-zero row), the machine's byte order
    [n + 4, ...)           with error feedback (residual_bits b = 4 or 8): the rounding error e = t - c s as
                           b-bit codes r = round(2^b e / s), two's complement, clamped to the b-bit range;
                           b = 4 packs two per byte (element 2j in the low nibble), b = 8 is one int8 each

A read decodes c s only: the residual is not part of the value. Error feedback (`encode_rows` with
`previous`): a write stores t = x + r_prev s_prev / 2^b, so the part of the previous write's value that
rounding dropped is added back to the next write of the same row instead of being lost. A recurrent state
whose per-token change is below half a code step would otherwise never move; with feedback it moves once
the carried changes add up to a step. The carry itself is kept to 1 / 2^b of a step, and what that
rounding drops is lost: the stored state is a (8 + b)-bit accumulator that the compute reads at 8 bits.
Zeroed bytes decode to a zero row with a zero carry.

`encode_rows` / `decode_rows` are the vectorized codec; `encode_row_plain` / `decode_row_plain` their
reference twin, one row at a time with Python bytes (tests/test_state_dtype.py compares them).
"""
from __future__ import annotations

import struct

import torch

CODE_MAX = 127
SCALE_BYTES = 4
RESIDUAL_BITS = (0, 4, 8)  # 0: no error feedback


def _check_bits(residual_bits: int) -> None:
    if residual_bits not in RESIDUAL_BITS:
        raise ValueError(f"residual_bits: must be one of {RESIDUAL_BITS} (0: no feedback), got {residual_bits!r}")


def row_bytes(n: int, residual_bits: int) -> int:
    """Bytes one row of n values takes: codes, scale, and the residual codes (residual_bits each)."""
    _check_bits(residual_bits)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n: a row holds at least one value, got {n!r}")
    return n + SCALE_BYTES + -(-n * residual_bits // 8)


def row_length(stored_bytes: int, residual_bits: int) -> int:
    """The n of row_bytes(n, residual_bits) == stored_bytes (row_bytes increases with n, so it is unique)."""
    n = (stored_bytes - SCALE_BYTES) * 8 // (8 + residual_bits)
    if n < 1 or row_bytes(n, residual_bits) != stored_bytes:
        raise ValueError(f"stored_bytes: {stored_bytes} is no int8 row's size (residual_bits={residual_bits})")
    return n


def _scales(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale [...], the divisor [...]: the scale, or 1 where it is 0 so that a zero row divides cleanly)."""
    scale = values.abs().amax(dim=-1) / CODE_MAX
    return scale, torch.where(scale > 0, scale, torch.ones_like(scale))


def decode_rows(stored: torch.Tensor, residual_bits: int) -> torch.Tensor:
    """stored uint8 [..., row_bytes(n, residual_bits)] -> fp32 [..., n]: codes times scale."""
    n = row_length(stored.shape[-1], residual_bits)
    codes = stored[..., :n].view(torch.int8).float()
    return codes * _stored_scale(stored, n)[..., None]


def _stored_scale(stored: torch.Tensor, n: int) -> torch.Tensor:
    # a copy, not .contiguous(): a contiguous slice may start off a 4-byte boundary, where no fp32 view exists
    return stored[..., n:n + SCALE_BYTES].clone(memory_format=torch.contiguous_format).view(torch.float32)[..., 0]


def _residual(stored: torch.Tensor, n: int, residual_bits: int) -> torch.Tensor:
    """The carry [..., n] fp32 a row's residual codes hold: r s / 2^b."""
    packed = stored[..., n + SCALE_BYTES:]
    if residual_bits == 8:
        steps = packed.view(torch.int8).float()
    else:
        nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)[..., :n].to(torch.int16)
        steps = torch.where(nibbles >= 8, nibbles - 16, nibbles).float()
    return steps * (_stored_scale(stored, n) / 2 ** residual_bits)[..., None]


def encode_rows(values: torch.Tensor, residual_bits: int, previous: torch.Tensor | None = None) -> torch.Tensor:
    """values [..., n] -> uint8 [..., row_bytes(n, residual_bits)].

    previous: the rows' stored bytes before this write (same shape as the result), whose residual is carried
    into this write; None: no carry (a first write). Only with residual_bits > 0.
    """
    _check_bits(residual_bits)
    if previous is not None and not residual_bits:
        raise ValueError("previous: a carry needs residual_bits > 0 (rows without feedback keep no residual)")
    n = values.shape[-1]
    target = values.detach().float()
    if previous is not None:
        target = target + _residual(previous, n, residual_bits)
    scale, divisor = _scales(target)
    codes = (target / divisor[..., None]).round().clamp(-CODE_MAX, CODE_MAX)
    out = torch.empty((*values.shape[:-1], row_bytes(n, residual_bits)), dtype=torch.uint8, device=values.device)
    out[..., :n] = codes.to(torch.int8).view(torch.uint8)
    out[..., n:n + SCALE_BYTES] = scale[..., None].contiguous().view(torch.uint8)
    if residual_bits:
        error = target - codes * scale[..., None]
        low, high = -2 ** (residual_bits - 1), 2 ** (residual_bits - 1) - 1
        steps = (error * (2 ** residual_bits / divisor)[..., None]).round().clamp(low, high).to(torch.int16)
        if residual_bits == 8:
            out[..., n + SCALE_BYTES:] = steps.to(torch.int8).view(torch.uint8)
        else:
            steps = torch.cat([steps, steps.new_zeros((*steps.shape[:-1], n % 2))], dim=-1) & 0xF
            pairs = steps.unflatten(-1, (-1, 2))
            out[..., n + SCALE_BYTES:] = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return out


def encode_row_plain(values: list[float], residual_bits: int, previous: bytes | None = None) -> bytes:
    """encode_rows for one row, value by value (the reference twin). Arithmetic in fp32 as there."""
    n, f32 = len(values), _fp32
    target = [f32(v) for v in values]
    if previous is not None:
        target = [f32(t + c) for t, c in zip(target, _residual_plain(previous, n, residual_bits))]
    scale = f32(max(abs(t) for t in target) / CODE_MAX)
    divisor = scale if scale > 0 else 1.0
    codes = [int(max(-CODE_MAX, min(CODE_MAX, round(f32(t / divisor))))) for t in target]
    out = bytes(c & 0xFF for c in codes) + struct.pack("=f", scale)
    if residual_bits:
        low, high = -2 ** (residual_bits - 1), 2 ** (residual_bits - 1) - 1
        unit = f32(2 ** residual_bits / divisor)
        steps = [max(low, min(high, round(f32(f32(t - f32(c * scale)) * unit)))) for t, c in zip(target, codes)]
        if residual_bits == 8:
            out += bytes(r & 0xFF for r in steps)
        else:
            steps += [0]
            out += bytes((steps[i] & 0xF) | ((steps[i + 1] & 0xF) << 4) for i in range(0, n, 2))
    return out


def decode_row_plain(stored: bytes, residual_bits: int) -> list[float]:
    """decode_rows for one row (the reference twin)."""
    n = row_length(len(stored), residual_bits)
    scale = struct.unpack("=f", stored[n:n + SCALE_BYTES])[0]
    return [_fp32(_signed(c, 8) * scale) for c in stored[:n]]


def _residual_plain(stored: bytes, n: int, residual_bits: int) -> list[float]:
    scale = struct.unpack("=f", stored[n:n + SCALE_BYTES])[0]
    packed = stored[n + SCALE_BYTES:]
    if residual_bits == 8:
        steps = [_signed(r, 8) for r in packed]
    else:
        steps = [_signed((packed[i // 2] >> (4 * (i % 2))) & 0xF, 4) for i in range(n)]
    return [_fp32(r * _fp32(scale / 2 ** residual_bits)) for r in steps]


def _signed(code: int, bits: int) -> int:
    """An unsigned `bits`-bit code read as two's complement."""
    return code - (1 << bits) if code >= 1 << (bits - 1) else code


def _fp32(value: float) -> float:
    """value rounded to the nearest fp32 (the twin's arithmetic is fp32, like the tensors')."""
    return struct.unpack("=f", struct.pack("=f", value))[0]
