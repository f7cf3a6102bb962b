"""Is a checkpoint file what the save wrote? Header checks, dtype rules and SHA-256 checksums.

Every safetensors file is validated here before safetensors or accelerate open it, so a damaged file
gives a one-line ValueError naming the file (and the tensor), never a SafetensorError, a hang or a
silent wrong load:

- the path must be a regular file (a FIFO, device, directory or a link to one is refused unread);
- the 8-byte header length must fit the file and the 100 MB cap, the header must be a JSON object whose
  entries have a known dtype, a shape of non-negative ints and two offsets;
- the tensors, in the order the header lists them, must tile the data region exactly: the first starts at
  0, each starts where the previous one ended, each spans dtype size x element count bytes, the last ends
  at the end of the file. (The safetensors writer lists tensors in data order, so two swapped offsets are
  refused too, and nothing overlaps, hides in a gap or trails the data.)

Checksums: a save writes `checksums.json`, {"format", "files": {name: {"bytes", "sha256"}}}, for each
safetensors file and the index. A load checks each file it reads against it (the size always; the
SHA-256 unless verify_checksums=False, for very large checkpoints) and refuses a file the manifest does
not list. A checkpoint saved before checksums existed (no checksums.json) loads on the header checks alone, with
a warning (a removed manifest must not pass unnoticed).
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from latentmoe_lab.textfile import read_text_file

CHECKSUMS_NAME = "checksums.json"
CHECKSUMS_FORMAT = "latentmoe-sha256-v1"
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own cap: a larger header is garbage, not a header
MAX_JSON_BYTES = 64 * 2**20  # an index of a very large model (100k tensors) is a few MB
SAFETENSORS_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn,
                      "F8_E5M2": torch.float8_e5m2, "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16,
                      "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
                      "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64}


def open_regular(path: Path, what: str = "checkpoint file"):
    """A binary read handle on `path`, after checking (on the open descriptor) that it is a regular file.

    Opened non-blocking so a FIFO is refused instead of waiting forever for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise ValueError(f"{what} {path}: cannot open it ({error.strerror or error})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{what} {path}: not a regular file (a directory, FIFO, socket or device); refusing "
                         f"to read it")
    return os.fdopen(fd, "rb")


def read_json_file(path: Path, what: str = "checkpoint file"):
    """The parsed JSON of a small regular file; ValueError naming the file otherwise."""
    text = read_text_file(path, name=f"{what} {path}", max_bytes=MAX_JSON_BYTES)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{what} {path}: not valid JSON ({error})") from None


def read_safetensors_header(path: Path) -> dict:
    """The parsed header {name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}} of a safetensors
    file, after the checks in the module docstring (ValueError naming the file, and the tensor if one)."""
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        raw = handle.read(8)
        length = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"checkpoint file {path}: not a safetensors file (header length {length}, file "
                             f"size {size} bytes)")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
            raise ValueError(f"checkpoint file {path}: its safetensors header is not valid JSON "
                             f"({str(error)[:120]})") from None
    if not isinstance(header, dict):
        raise ValueError(f"checkpoint file {path}: its safetensors header is not a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"checkpoint file {path}: its __metadata__ is not a map of strings")
    end = 0
    for name, entry in header.items():
        if name != "__metadata__":
            end = _check_entry(path, name, entry, end)
    if 8 + length + end != size:
        raise ValueError(f"checkpoint file {path}: its tensors end at byte {8 + length + end}, the file has "
                         f"{size} (truncated, or bytes appended)")
    return header


def _check_entry(path: Path, name: str, entry, begin_expected: int) -> int:
    """Check one header entry that should start at `begin_expected`; returns where it ends."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"checkpoint file {path}: tensor {name!r}: malformed header entry (needs exactly "
                         f"dtype, shape and data_offsets)")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"checkpoint file {path}: tensor {name!r}: unknown dtype {str(dtype)[:20]!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"checkpoint file {path}: tensor {name!r}: shape must be a list of non-negative ints")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        raise ValueError(f"checkpoint file {path}: tensor {name!r}: data_offsets must be two ints")
    nbytes = SAFETENSORS_DTYPES[dtype].itemsize
    for dim in shape:
        nbytes *= dim
    if offsets[0] != begin_expected:
        raise ValueError(f"checkpoint file {path}: tensor {name!r} starts at data byte {offsets[0]}, not "
                         f"{begin_expected} where the tensor before it ends (offsets overlap, leave a gap or "
                         f"are out of order)")
    if offsets[1] - offsets[0] != nbytes:
        raise ValueError(f"checkpoint file {path}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes, its "
                         f"dtype {dtype} and shape {shape} need {nbytes}")
    return offsets[1]


def stored_tensors(files: Iterable[Path]) -> dict[str, tuple[str, tuple[int, ...], Path]]:
    """Tensor name -> (safetensors dtype, shape, file) over all files, headers validated, no data read.
    A tensor in two files is refused (which one would be loaded is up to the loader)."""
    found: dict[str, tuple[str, tuple[int, ...], Path]] = {}
    for file in files:
        for name, entry in read_safetensors_header(file).items():
            if name == "__metadata__":
                continue
            if name in found:
                raise ValueError(f"checkpoint file {file}: tensor {name!r} is also stored in {found[name][2]}")
            found[name] = (entry["dtype"], tuple(entry["shape"]), file)
    return found


def dtype_mismatch(stored_dtype: str, model_dtype) -> bool:
    """True when a tensor stored as `stored_dtype` must not load into a model tensor of torch dtype
    `model_dtype`: any floating dtype may be cast to another (from_pretrained(dtype=...)), anything else
    must match exactly (an int32 tensor read as float32 weights is garbage)."""
    stored = SAFETENSORS_DTYPES[stored_dtype]
    return not (stored == model_dtype or (stored.is_floating_point and model_dtype.is_floating_point))


# ---------------------------------------------------------------------------------------------- checksums
def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def write_checksums(directory: Path, names: Iterable[str]) -> None:
    """Record each named file's size and SHA-256 in directory/checksums.json."""
    files = {name: {"bytes": (directory / name).stat().st_size, "sha256": file_sha256(directory / name)}
             for name in sorted(names)}
    (directory / CHECKSUMS_NAME).write_text(json.dumps({"format": CHECKSUMS_FORMAT, "files": files}, indent=1))


def read_checksums(directory: Path) -> Mapping[str, dict] | None:
    """{file name: {"bytes", "sha256"}} from directory/checksums.json, or None when the checkpoint has none."""
    path = directory / CHECKSUMS_NAME
    if not (path.exists() or path.is_symlink()):
        return None
    data = read_json_file(path)
    files = data.get("files") if isinstance(data, dict) and data.get("format") == CHECKSUMS_FORMAT else None
    if not isinstance(files, dict) or not all(
            isinstance(v, dict) and type(v.get("bytes")) is int and isinstance(v.get("sha256"), str)
            for v in files.values()):
        raise ValueError(f"checkpoint file {path}: not a {CHECKSUMS_FORMAT} manifest")
    return files


def verify_files(directory: Path, files: Iterable[Path], verify_checksums: bool = True) -> None:
    """Check `files` (inside `directory`) against its checksums.json: listed, same size, and unless
    verify_checksums is False the same SHA-256. Nothing to check when the checkpoint predates checksums."""
    recorded = read_checksums(directory)
    if recorded is None:  # loads (older saves have none), but a stripped manifest must not pass unnoticed
        if verify_checksums:
            warnings.warn(f"checkpoint {directory}: no {CHECKSUMS_NAME}, so its files are not checked against "
                          f"checksums (saved before they existed, or the manifest was removed)", stacklevel=3)
        return
    for path in files:
        name = str(path.relative_to(directory))
        if name not in recorded:
            raise ValueError(f"checkpoint file {path}: not written by the save (not listed in {CHECKSUMS_NAME})")
        size = path.stat().st_size
        if size != recorded[name]["bytes"]:
            raise ValueError(f"checkpoint file {path}: {size} bytes, the save wrote {recorded[name]['bytes']} "
                             f"(truncated or overwritten)")
        if verify_checksums and file_sha256(path) != recorded[name]["sha256"]:
            raise ValueError(f"checkpoint file {path}: its SHA-256 differs from the one recorded at the save "
                             f"(the file was corrupted or changed; verify_checksums=False skips this check)")
