"""How the K3 release stores tensors that k3.name_table names in their logical layout (docs/design.md §18).

    A_log          fp32 [P]: the num_heads live values, then zeros up to P (the release: 96 live of P = 128,
                   the next power of two). Read by narrowing to [num_heads], never by a reshape; non-zero
                   padding is refused: exp(0) = 1 is a real decay rate, so a port that kept it ran wrong.
    experts        routed experts `...experts.{e}.w1|w2|w3` (w1 gate, w3 up, w2 down, each a Linear [out, in]) in
                   compressed-tensors "mxfp4-pack-quantized": `.weight_packed` uint8 [out, in / 2] and
                   `.weight_scale` uint8 [out, in / 32]. Two E2M1 codes per byte, element 2j in the low nibble;
                   the scale byte is an E8M0 exponent e, the group of 32 weighs 2^(e - 127). This is the byte
                   layout of quant/weight_mxfp4.py for a matrix whose `in` is a multiple of 32, so packed bytes
                   move between the two untouched.
    fp32 tensors   A_log, dt_bias, the three short-conv kernels, the KDA o_norm gain and the router's
                   e_score_correction_bias; every other dense tensor is bf16 (the published shard headers).
"""
from __future__ import annotations

import re

import torch

from latentmoe_lab.quant.weight_mxfp4 import BLOCK, MXFP4Format

PACKED, SCALE = "weight_packed", "weight_scale"
FP32_SUFFIXES = ("self_attn.A_log", "self_attn.dt_bias", "self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight",
                 "self_attn.v_conv1d.weight", "self_attn.o_norm.weight", "gate.e_score_correction_bias")
EXPERT_WEIGHT = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")
A_LOG_SUFFIX = "self_attn.A_log"
_FORMAT = MXFP4Format()


def is_expert_weight(name: str) -> bool:
    """True for a routed expert's logical name `...block_sparse_moe.experts.{e}.w1|w2|w3.weight`."""
    return EXPERT_WEIGHT.search(name) is not None


def packed_names(name: str) -> tuple[str, str]:
    """`...w1.weight` -> (`...w1.weight_packed`, `...w1.weight_scale`)."""
    stem = name[: -len("weight")]
    return stem + PACKED, stem + SCALE


def stored_dtype(name: str) -> torch.dtype:
    """The dtype the release stores a (non-expert) tensor in."""
    return torch.float32 if name.endswith(FP32_SUFFIXES) else torch.bfloat16


def a_log_stored_size(num_heads: int) -> int:
    """Padded A_log length: the next power of two >= num_heads (96 -> 128, what the release ships)."""
    return 1 << (num_heads - 1).bit_length()


def pad_a_log(a_log: torch.Tensor) -> torch.Tensor:
    """[H] -> fp32 [a_log_stored_size(H)], the live values then zeros."""
    if a_log.dim() != 1:
        raise ValueError(f"a_log: expected [num_heads], got shape {tuple(a_log.shape)}")
    out = torch.zeros(a_log_stored_size(a_log.shape[0]), dtype=torch.float32)
    out[: a_log.shape[0]] = a_log.float()
    return out


def narrow_a_log(stored: torch.Tensor, num_heads: int, name: str) -> torch.Tensor:
    """Stored A_log [P] -> its live [num_heads] (a narrow, a view); ValueError naming the tensor when it is not
    1-D, is shorter than num_heads, or holds a non-zero value past num_heads."""
    if stored.dim() != 1 or stored.shape[0] < num_heads:
        raise ValueError(f"{name}: expected 1-D with at least num_heads={num_heads} values, got shape "
                         f"{tuple(stored.shape)}")
    padding = stored[num_heads:]
    if bool((padding != 0).any()):
        first = num_heads + int((padding != 0).nonzero()[0])
        raise ValueError(f"{name}: values past num_heads={num_heads} must be zero padding, got "
                         f"{float(stored[first])} at index {first} (refusing: a live value there would be lost)")
    return stored.narrow(0, 0, num_heads)


def packed_shapes(out_features: int, in_features: int, name: str = "weight") -> tuple[tuple[int, int], ...]:
    """(weight_packed shape, weight_scale shape) of one [out, in] expert matrix; `in` must be a multiple of 32
    (the format has no ragged group)."""
    if in_features % BLOCK:
        raise ValueError(f"{name}: MXFP4 groups of {BLOCK} need in_features divisible by {BLOCK}, got {in_features}")
    return (out_features, in_features // 2), (out_features, in_features // BLOCK)


def pack_matrix(weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """fp [out, in] -> (weight_packed uint8 [out, in/2], weight_scale uint8 [out, in/32]) by quant/weight_mxfp4.py's
    rounding (round to nearest even, X = 2^(floor(log2 absmax) - 2) per group)."""
    packed_shapes(*weight.shape, name=name)
    parts = _FORMAT.pack(weight.contiguous())  # a transposed view of our [E, in, out] stack comes in
    return parts["data"].contiguous(), parts["scale"].contiguous()


def unpack_matrix(packed: torch.Tensor, scale: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """(weight_packed [out, in/2], weight_scale [out, in/32]) -> fp32 [out, in], exact (E2M1 x 2^k fits fp32)."""
    check_pair(packed, scale, name)
    return _FORMAT.unpack({"data": packed, "scale": scale})


def check_pair(packed: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    """ValueError naming the tensor unless packed / scale are uint8 [out, in/2] / [out, in/32] of one matrix."""
    for part, tensor in ((PACKED, packed), (SCALE, scale)):
        if tensor.dtype != torch.uint8 or tensor.dim() != 2:
            raise ValueError(f"{name}.{part}: expected a 2-D uint8 tensor, got {tensor.dtype} {tuple(tensor.shape)}")
    if packed.shape[0] != scale.shape[0] or packed.shape[1] != scale.shape[1] * (BLOCK // 2):
        raise ValueError(f"{name}: weight_packed {tuple(packed.shape)} and weight_scale {tuple(scale.shape)} are not "
                         f"one matrix (need [out, in/2] and [out, in/{BLOCK}])")


# ------------------------------------------------------------------------------- quantization_config
QUANT_METHOD, QUANT_FORMAT = "compressed-tensors", "mxfp4-pack-quantized"
# What the published ignore list names, plus the bf16 linears of the MoE block our writer also leaves unpacked.
IGNORE = ("re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
          "re:.*vision_tower.*", "re:.*mm_projector.*", r"re:.*block_sparse_moe\.gate$",
          r"re:.*block_sparse_moe\.routed_expert_(down|up)_proj$")


def quantization_config() -> dict:
    """The text_config.quantization_config our writer puts beside MXFP4 experts."""
    weights = {"num_bits": 4, "group_size": BLOCK, "type": "float", "symmetric": True, "dynamic": False,
               "scale_dtype": "torch.uint8"}
    return {"quant_method": QUANT_METHOD, "format": QUANT_FORMAT, "ignore": list(IGNORE),
            "config_groups": {"group_0": {"format": QUANT_FORMAT, "targets": ["Linear"], "input_activations": None,
                                          "weights": weights}}}


def check_quantization_config(config: dict | None) -> bool:
    """True when text_config.quantization_config announces MXFP4 pack-quantized experts (False when absent);
    ValueError naming the key for any other method, format, bit width or group size."""
    if config is None:
        return False
    if not isinstance(config, dict):
        raise ValueError(f"quantization_config: expected an object, got {type(config).__name__}")
    for key, expected in (("quant_method", QUANT_METHOD), ("format", QUANT_FORMAT)):
        if config.get(key) != expected:
            raise ValueError(f"quantization_config.{key}: expected {expected!r}, got {config.get(key)!r}")
    groups = config.get("config_groups", {})
    if not isinstance(groups, dict):
        raise ValueError(f"quantization_config.config_groups: expected an object, got {type(groups).__name__}")
    for group_name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            continue
        for key, expected in (("num_bits", 4), ("group_size", BLOCK), ("type", "float")):
            if key in weights and weights[key] != expected:
                raise ValueError(f"quantization_config.config_groups.{group_name}.weights.{key}: expected "
                                 f"{expected!r} (MXFP4), got {weights[key]!r}")
        if group.get("format", QUANT_FORMAT) != QUANT_FORMAT:
            raise ValueError(f"quantization_config.config_groups.{group_name}.format: expected {QUANT_FORMAT!r}, "
                             f"got {group['format']!r}")
    return True
