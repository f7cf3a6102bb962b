"""A RequestCache as bytes, with a checksum per transfer (docs/design.md §13.1).

    offset 0      8 bytes   magic b"LMDXFER1"
    offset 8      4 bytes   header length H, little-endian
    offset 12     H bytes   JSON: {"request": RequestCache.header(), "tensors": {name: {dtype, shape, offset}}}
    offset 12+H   D bytes   the tensors' raw bytes back to back, in the header's order (offsets into this part)
    last          32 bytes  SHA-256 of everything before it

Nothing is unpickled: the header is JSON, a tensor is rebuilt from its raw bytes with a dtype from a
short allow-list and a shape that must account for exactly its bytes. The checksum is verified before
anything is parsed; any damage (a flipped bit, a truncated or padded payload) raises TransferError.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct

import torch

from latentmoe_lab.serving.transport.request_cache import TENSOR_FIELDS, RequestCache

MAGIC = b"LMDXFER1"
DIGEST_BYTES = 32
MAX_HEADER_BYTES = 64 << 20  # prompt ids and logprobs of a 1M-token prompt fit many times over
DTYPES = {"uint8": torch.uint8, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TransferError(ValueError):
    """A payload that is not an intact transfer (checksum, framing or header); the sender should resend."""


def encode(cache: RequestCache) -> bytes:
    """The transfer's bytes: magic, JSON header, tensor bytes, SHA-256 (see the module docstring)."""
    tensors, chunks, offset = {}, [], 0
    for name, tensor in cache.tensors().items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot travel (allowed: {sorted(DTYPES)})")
        raw = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
        tensors[name] = {"dtype": dtype, "shape": list(tensor.shape), "offset": offset}
        chunks.append(raw)
        offset += len(raw)
    header = json.dumps({"request": cache.header(), "tensors": tensors}, separators=(",", ":")).encode()
    body = b"".join([MAGIC, struct.pack("<I", len(header)), header, *chunks])
    return body + hashlib.sha256(body).digest()


def payload_tensor_bytes(payload: bytes) -> int:
    """Bytes of the tensor part of an encoded transfer (what bytes_per_request plans)."""
    header_len = struct.unpack_from("<I", payload, len(MAGIC))[0]
    return len(payload) - len(MAGIC) - 4 - header_len - DIGEST_BYTES


def decode(payload: bytes) -> RequestCache:
    """The RequestCache encode() wrote; TransferError on a bad checksum, framing or header."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"payload: expected bytes, got {type(payload).__name__}")
    payload = bytes(payload)
    prefix = len(MAGIC) + 4
    if len(payload) < prefix + DIGEST_BYTES:
        raise TransferError(f"payload: {len(payload)} bytes is shorter than an empty transfer")
    body, digest = payload[:-DIGEST_BYTES], payload[-DIGEST_BYTES:]
    if hashlib.sha256(body).digest() != digest:
        raise TransferError("payload: SHA-256 checksum mismatch (corrupted or truncated transfer); resend it")
    if body[:len(MAGIC)] != MAGIC:
        raise TransferError(f"payload: not a transfer (magic {body[:len(MAGIC)]!r}, expected {MAGIC!r})")
    header_len = struct.unpack_from("<I", body, len(MAGIC))[0]
    if header_len > min(MAX_HEADER_BYTES, len(body) - prefix):
        raise TransferError(f"payload: header length {header_len} exceeds the payload")
    try:
        header = json.loads(body[prefix:prefix + header_len])
        tensors = _tensors(header["tensors"], body[prefix + header_len:])
        return RequestCache.from_header(header["request"], tensors)
    except TransferError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise TransferError(f"payload: malformed header ({type(error).__name__}: {error})") from None


def _tensors(entries: dict, data: bytes) -> dict[str, torch.Tensor]:
    """The header's tensor entries -> tensors over copies of their bytes; every byte of data accounted for."""
    if not isinstance(entries, dict) or sorted(entries) != sorted(TENSOR_FIELDS):
        raise TransferError(f"payload: tensors must be exactly {list(TENSOR_FIELDS)}")
    out, expected_offset = {}, 0
    for name, entry in entries.items():
        dtype, shape, offset = DTYPES.get(entry["dtype"]), entry["shape"], entry["offset"]
        if dtype is None:
            raise TransferError(f"payload: {name}: dtype {entry['dtype']!r} is not one of {sorted(DTYPES)}")
        if not isinstance(shape, list) or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape):
            raise TransferError(f"payload: {name}: shape must be a list of integers >= 0, got {shape!r}")
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offset != expected_offset or offset + size > len(data):
            raise TransferError(f"payload: {name}: bytes [{offset}, {offset + size}) do not follow the previous "
                                f"tensor inside the {len(data)}-byte data part")
        raw = bytearray(data[offset:offset + size])
        flat = torch.frombuffer(raw, dtype=torch.uint8) if size else torch.zeros(0, dtype=torch.uint8)
        out[name] = flat.view(dtype).reshape(shape)
        expected_offset = offset + size
    if expected_offset != len(data):
        raise TransferError(f"payload: {len(data) - expected_offset} bytes after the last tensor")
    return out
