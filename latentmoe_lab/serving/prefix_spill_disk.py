"""The disk tier of the prefix-cache spill: one safetensors file per (block hash, kind), checksummed.

    DIR/<key[:32]>/spill.json                       {"format", "key", "describes"}: what wrote the files
    DIR/<key[:32]>/<block hash hex>.<kind>.safetensors   kind "rows" (a block's DSA rows, every DSA layer)
                                                      or "kda" (the KDA snapshot at the block's end)

`key` is the SHA-256 of the model's weights, its config, the cache formats and the block size
(prefix_spill.spill_key): files of another model or cache dtype sit under another subdirectory and are
never looked at. Each file's metadata repeats the key and the block hash and holds the SHA-256 of its
tensors (names, dtypes, shapes, bytes); a read checks all three and the expected tensor names, shapes and
dtypes, and anything wrong (missing, truncated, flipped bytes, another key, another block) raises
SpillRefused: the caller recomputes instead. A refused file is deleted.

Bounded by `max_bytes` (None: unbounded): the least recently used files go first. A restarted engine finds
the files already there (least recently modified first) and serves hits from them. A write that fails (a
full disk) drops that entry with a warning and counts it in write_errors; the request goes on.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "latentmoe-prefix-spill-v1"
log = logging.getLogger(__name__)
SUFFIX = ".safetensors"


class SpillRefused(Exception):
    """A spilled block or snapshot that must not be served (missing, corrupt, or another model's)."""


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors' names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class DiskTier:
    def __init__(self, root: str | Path, key: str, describes: dict, max_bytes: int | None = None):
        self.key, self.max_bytes = key, max_bytes
        self.directory = Path(root) / key[:32]
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / ".write-probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            raise ValueError(f"prefix_cache.disk_dir: cannot write the spill directory {self.directory} "
                             f"(key {key[:32]}): {error.strerror or error}") from error
        self._check_manifest(describes)
        self.files: OrderedDict[tuple[bytes, str], int] = OrderedDict()  # least recently used first
        for leftover in self.directory.glob("*.tmp"):  # a write cut short by a crash
            leftover.unlink(missing_ok=True)
        found = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            parsed = _parse_name(path.name)
            if parsed is not None:
                stat = path.stat()
                found.append((stat.st_mtime_ns, parsed, stat.st_size))
        for _, parsed, size in sorted(found, key=lambda item: item[0]):
            self.files[parsed] = size
        self.nbytes = sum(self.files.values())  # kept up to date by put and discard
        self.bytes_written = 0
        self.write_errors = 0
        self.bytes_read = 0

    def _check_manifest(self, describes: dict) -> None:
        manifest = self.directory / "spill.json"
        wanted = {"format": FORMAT, "key": self.key, "describes": describes}
        if manifest.exists():
            try:
                found = json.loads(manifest.read_text())
            except (OSError, ValueError) as error:
                raise ValueError(f"prefix_cache.disk_dir: {manifest} is unreadable ({error}); remove the "
                                 f"directory {self.directory} to start it afresh") from error
            if not isinstance(found, dict) or found.get("key") != self.key or found.get("format") != FORMAT:
                raise ValueError(f"prefix_cache.disk_dir: {self.directory} was written for another model or cache "
                                 f"(key {str(found.get('key') if isinstance(found, dict) else found)[:32]}, this "
                                 f"engine's is {self.key[:32]}); its files are not served")
            return
        _write_atomically(manifest, json.dumps(wanted, indent=1, sort_keys=True).encode())

    def has(self, block_hash: bytes, kind: str) -> bool:
        return (block_hash, kind) in self.files

    def put(self, block_hash: bytes, kind: str, tensors: dict[str, torch.Tensor]) -> None:
        """Write one entry (kept as it is when already there), then trim the directory to max_bytes."""
        if (block_hash, kind) in self.files:
            self.files.move_to_end((block_hash, kind))
            return
        path = self._path(block_hash, kind)
        metadata = {"format": FORMAT, "key": self.key, "block_hash": block_hash.hex(), "kind": kind,
                    "sha256": tensors_sha256(tensors)}
        temporary = path.with_name(path.name + ".tmp")
        try:
            save_file({name: t.contiguous() for name, t in tensors.items()}, str(temporary), metadata=metadata)
            os.replace(temporary, path)
        except OSError as error:  # a full or failing disk costs the entry (a later miss), never a request
            temporary.unlink(missing_ok=True)
            self.write_errors += 1
            log.warning("prefix cache spill: could not write %s (%s); the entry is dropped", path, error)
            return
        size = path.stat().st_size
        self.files[(block_hash, kind)] = size
        self.nbytes += size
        self.bytes_written += size
        while self.max_bytes is not None and self.nbytes > self.max_bytes and self.files:
            self.discard(*next(iter(self.files)))

    def get(self, block_hash: bytes, kind: str, expected: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
        """The entry's tensors, checked against its checksum, key, block and `expected` {name: (dtype, shape)}.

        SpillRefused (and the file deleted) when any check fails or the file is gone."""
        path = self._path(block_hash, kind)
        try:
            with safe_open(str(path), "pt") as handle:
                metadata = handle.metadata() or {}
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        except Exception as error:  # noqa: BLE001 - missing, truncated, unparsable: all refused alike
            self.discard(block_hash, kind)
            raise SpillRefused(f"{path.name}: unreadable ({type(error).__name__}: {error})") from error
        problems = [f"{field} {metadata.get(field)!r}" for field, want in
                    (("key", self.key), ("block_hash", block_hash.hex()), ("kind", kind))
                    if metadata.get(field) != want]
        if {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()} != expected:
            problems.append("tensors of other names, dtypes or shapes than the pools'")
        elif metadata.get("sha256") != tensors_sha256(tensors):
            problems.append("checksum mismatch")
        if problems:
            self.discard(block_hash, kind)
            raise SpillRefused(f"{path.name}: {', '.join(problems)}")
        self.files.move_to_end((block_hash, kind))
        self.bytes_read += self.files[(block_hash, kind)]
        return tensors

    def discard(self, block_hash: bytes, kind: str) -> None:
        self.nbytes -= self.files.pop((block_hash, kind), 0)
        try:
            self._path(block_hash, kind).unlink()
        except FileNotFoundError:
            pass

    def _path(self, block_hash: bytes, kind: str) -> Path:
        return self.directory / f"{block_hash.hex()}.{kind}{SUFFIX}"


def _parse_name(name: str) -> tuple[bytes, str] | None:
    stem = name[:-len(SUFFIX)]
    hex_hash, _, kind = stem.partition(".")
    try:
        return (bytes.fromhex(hex_hash), kind) if kind in ("rows", "kda") else None
    except ValueError:
        return None


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)
