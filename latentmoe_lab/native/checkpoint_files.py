"""What a sharded checkpoint directory (native/checkpoint.py) must hold, checked without reading tensor data.

Every file must be safetensors or JSON by its bytes (a pickle, a torch.save zip or anything else is
refused, naming the file); every file the manifest lists must be there with the size and (when
the manifest records it, as saves since checksums do) the SHA-256 the save wrote; every safetensors header
must pass checkpoint_integrity's checks (its tensors tile the file's data exactly); within model/ and
optimizer/ only the save's own shards may appear, and each tensor's chunks must add up to its whole size
(no shard file missing). A FIFO, device or other non-regular file is refused unread. See docs/design.md §11.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from latentmoe_lab.checkpoint_checks import CONFIG_NAME, refuse_pickle, resolve_checkpoint_dir
from latentmoe_lab.checkpoint_dir import OutputKind
from latentmoe_lab.checkpoint_integrity import file_sha256, open_regular, read_json_file, read_safetensors_header

MANIFEST_NAME = "checkpoint.json"
MODEL_DIR, OPTIMIZER_DIR, OPTIMIZER_JSON = "model", "optimizer", "optimizer.json"
FORMAT = "latentmoe-dcp-safetensors-v1"
RESERVED_NAMES = {CONFIG_NAME, MANIFEST_NAME, MODEL_DIR, OPTIMIZER_DIR, OPTIMIZER_JSON}
SHARDED = OutputKind(f"a sharded checkpoint (with {MANIFEST_NAME})", lambda d: (d / MANIFEST_NAME).is_file())


@dataclass(frozen=True)
class CheckedCheckpoint:
    directory: Path  # the one read (DIR, or DIR.previous after an interrupted swap)
    manifest: dict
    shapes: dict[str, dict[str, tuple[int, ...]]]  # "model" / "optimizer" -> tensor name -> global shape


def check_sharded(directory: str | Path, verify_checksums: bool = True) -> CheckedCheckpoint:
    """Validate a sharded checkpoint; tensor data is read only to hash it (verify_checksums=False: not at all).

    ValueError names the file: a pickle or any other non-safetensors / non-JSON file, a size or SHA-256 that
    differs from the manifest's, a malformed header, or a tensor whose chunks do not cover it.
    """
    directory = resolve_checkpoint_dir(directory)
    for folder in [directory, *(p for p in directory.rglob("*") if p.is_dir())]:
        refuse_pickle(folder)
    manifest_path = directory / MANIFEST_NAME
    if not manifest_path.exists():
        raise ValueError(f"directory: {directory} has no {MANIFEST_NAME}: not a save_sharded checkpoint "
                         f"(a save_pretrained directory loads with from_pretrained or build_native(checkpoint=...))")
    headers = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_symlink() or not p.is_dir()):
        kind = file_kind(path)
        if kind not in ("json", "safetensors"):
            raise ValueError(f"checkpoint file {path}: {kind}; only safetensors and JSON files are loaded"
                             + (" (pickle can run arbitrary code)" if "pickle" in kind else ""))
        if kind == "safetensors":
            headers[path] = read_safetensors_header(path)
    manifest = read_json_file(manifest_path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(
            manifest.get("files"), dict) or not isinstance(manifest.get("sha256", {}), dict):
        raise ValueError(f"checkpoint file {manifest_path}: not a {FORMAT} manifest")
    for name, size in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise ValueError(f"checkpoint file {path}: listed in {MANIFEST_NAME} but missing")
        if path.stat().st_size != size:
            raise ValueError(f"checkpoint file {path}: {path.stat().st_size} bytes, the save wrote {size} "
                             f"(truncated or overwritten)")
        recorded = manifest.get("sha256", {}).get(name)  # absent in saves from before checksums
        if verify_checksums and recorded is not None and file_sha256(path) != recorded:
            raise ValueError(f"checkpoint file {path}: its SHA-256 differs from the one recorded at the save "
                             f"(the file was corrupted or changed; verify_checksums=False skips this check)")
    strays = [p for p in headers if str(p.relative_to(directory)) not in manifest["files"]]
    if strays:  # the reader takes every *.safetensors file of a folder: a foreign one would be read as a shard
        raise ValueError(f"checkpoint file {strays[0]}: not written by the save (not in {MANIFEST_NAME})")
    shapes = {folder: _check_coverage({p: h for p, h in headers.items() if p.parent == directory / folder},
                                      directory / folder)
              for folder in [MODEL_DIR] + ([OPTIMIZER_DIR] if manifest["optimizer"] else [])}
    return CheckedCheckpoint(directory, manifest, shapes)


def file_kind(path: Path) -> str:
    """"safetensors", "json", or a description of what the file's first bytes say it is."""
    with open_regular(path) as handle:
        head = handle.read(16)
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a pickle (it starts with a pickle protocol opcode)"
    if head[:4] == b"PK\x03\x04":
        return "a zip archive (torch.save's format: a pickle inside)"
    if path.suffix == ".json":
        try:  # the JSON files are small (config, manifest, hyperparameters, trainer state): parse them whole
            json.loads(path.read_bytes())  # a regular file: open_regular above checked it
            return "json"
        except (UnicodeDecodeError, json.JSONDecodeError):
            return "a .json file that is not valid JSON"
    if path.suffix == ".safetensors" and len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"
    return f"unrecognised content (first bytes {head[:8]!r})"


def _check_coverage(headers: dict[Path, dict], folder: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's chunks (over all shard files) must add up to its global size; returns those sizes."""
    chunks: dict[str, list[tuple[list[int], list[int]]]] = {}
    for path, header in headers.items():
        try:
            info = json.loads(header.get("__metadata__", {}).get("DCP_SHARDING_INFO", "{}"))
        except json.JSONDecodeError:
            raise ValueError(f"checkpoint file {path}: its DCP_SHARDING_INFO metadata is not valid JSON") from None
        for name, entry in header.items():
            if name != "__metadata__":
                offsets = info.get(name, {}).get("saved_offsets", [0] * len(entry["shape"]))
                chunks.setdefault(name, []).append((offsets, entry["shape"]))
    if not chunks:
        raise ValueError(f"checkpoint folder {folder}: no safetensors shards")
    sizes = {}
    for name, parts in chunks.items():
        size = sizes[name] = tuple(max(o[d] + s[d] for o, s in parts) for d in range(len(parts[0][1])))
        stored = sum(int(torch.Size(shape).numel()) for _, shape in parts)
        if stored != torch.Size(size).numel():
            raise ValueError(f"checkpoint folder {folder}: tensor {name!r} of size {size} has {stored} elements in "
                             f"its shard files, not {torch.Size(size).numel()} (a shard file is missing)")
    return sizes
