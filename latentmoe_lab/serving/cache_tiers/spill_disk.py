"""The disk tier of the prefix-cache spill: one safetensors file per (block hash, kind), checksummed.

    DIR/<key[:32]>/spill.json                       {"format", "key", "describes"}: what wrote the files
    DIR/<key[:32]>/<block hash hex>.<kind>.safetensors   kind "rows" (a block's DSA rows, every DSA layer)
                                                      or "kda" (the KDA snapshot at the block's end;
                                                      with an MTP head its hidden row, "mtp.hidden")

`key` is the SHA-256 of the model's weights, its config, the cache formats and the block size
(prefix_spill.spill_key): files of another model or cache dtype sit under another subdirectory and are
never looked at. Each file's metadata repeats the key and the block hash and holds the SHA-256 of its
tensors (names, dtypes, shapes, bytes); a read checks all three and the expected tensor names, shapes and
dtypes, and anything wrong (missing, truncated, flipped bytes, another key, another block) raises
SpillRefused: the caller recomputes instead. A refused file is deleted.

Bounded by `max_bytes` (None: unbounded): the least recently used files go first. A restarted engine finds
the files already there (least recently modified first) and serves hits from them. A write that fails drops
that entry with a warning and counts it in write_errors; the request goes on. A full disk (ENOSPC, EFBIG,
EDQUOT) stops the spill's writes for the tier's life (`full`): its files keep serving hits, and a full disk
costs one warning instead of a failed write per evicted block.

Only regular files are read, opened without following links and without blocking (a FIFO or a device put
in the directory would otherwise hang the reading thread, and with it the process): anything else there is
refused like a corrupt file, and left in place when it cannot be removed (a directory).
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import stat
import struct
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as serialize

FORMAT = "latentmoe-prefix-spill-v1"
log = logging.getLogger(__name__)
SUFFIX = ".safetensors"
DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


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
            raise ValueError(f"memory.prefix_cache.disk_dir: cannot write the spill directory {self.directory} "
                             f"(key {key[:32]}): {error.strerror or error}") from error
        self._check_manifest(describes)
        self.files: OrderedDict[tuple[bytes, str], int] = OrderedDict()  # least recently used first
        for leftover in self.directory.glob("*.tmp"):  # a write cut short by a crash
            leftover.unlink(missing_ok=True)
        found = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            parsed = _parse_name(path.name)
            info = path.lstat()
            if parsed is not None and stat.S_ISREG(info.st_mode):
                found.append((info.st_mtime_ns, parsed, info.st_size))
        for _, parsed, size in sorted(found, key=lambda item: item[0]):
            self.files[parsed] = size
        self.nbytes = sum(self.files.values())  # kept up to date by put and discard
        self.bytes_written = 0
        self.write_errors = 0
        self.full = False  # a write found the disk full: no more writes (see the module docstring)
        self.bytes_read = 0

    def _check_manifest(self, describes: dict) -> None:
        manifest = self.directory / "spill.json"
        wanted = {"format": FORMAT, "key": self.key, "describes": describes}
        if manifest.exists():
            try:
                found = json.loads(manifest.read_text())
            except (OSError, ValueError) as error:
                raise ValueError(f"memory.prefix_cache.disk_dir: {manifest} is unreadable ({error}); remove the "
                                 f"directory {self.directory} to start it afresh") from error
            if not isinstance(found, dict) or found.get("key") != self.key or found.get("format") != FORMAT:
                raise ValueError(f"memory.prefix_cache.disk_dir: {self.directory} was written for another model or "
                                 f"cache (key {str(found.get('key') if isinstance(found, dict) else found)[:32]}, this "
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
        if self.full:
            return
        path = self._path(block_hash, kind)
        metadata = {"format": FORMAT, "key": self.key, "block_hash": block_hash.hex(), "kind": kind,
                    "sha256": tensors_sha256(tensors)}
        temporary = path.with_name(path.name + ".tmp")
        data = serialize({name: t.contiguous() for name, t in tensors.items()}, metadata=metadata)
        try:
            write_file(temporary, data)  # in memory first: a failed write is an OSError with its errno
            os.replace(temporary, path)
        except OSError as error:  # a full or failing disk costs the entry (a later miss), never a request
            temporary.unlink(missing_ok=True)
            self.write_errors += 1
            self.full = error.errno in DISK_FULL
            log.warning("prefix cache spill: could not write %s (%s); the entry is dropped%s", path, error,
                        "; the disk is full: no more spill writes (the files there still serve hits)"
                        if self.full else "")
            return
        size = path.stat().st_size
        self.files[(block_hash, kind)] = size
        self.nbytes += size
        self.bytes_written += size
        while self.max_bytes is not None and self.nbytes > self.max_bytes and self.files:
            self.discard(*next(iter(self.files)))

    def get(self, block_hash: bytes, kind: str, expected: dict[str, tuple[torch.dtype, tuple[int, ...]]],
            optional: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None):
        """The entry's tensors, checked against its checksum, key, block and `expected` {name: (dtype, shape)},
        plus any of `optional` (a "kda" entry's MTP hidden row: a file without it is served all the same).

        SpillRefused (and the file deleted) when any check fails or the file is gone."""
        path = self._path(block_hash, kind)
        try:
            data = read_regular_file(path)
            metadata, tensors = _header_metadata(data), load_tensors(data)
        except Exception as error:  # noqa: BLE001 - missing, truncated, unparsable, not a file: refused alike
            self.discard(block_hash, kind)
            raise SpillRefused(f"{path.name}: unreadable ({type(error).__name__}: {error})") from error
        problems = [f"{field} {metadata.get(field)!r}" for field, want in
                    (("key", self.key), ("block_hash", block_hash.hex()), ("kind", kind))
                    if metadata.get(field) != want]
        found, optional = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}, optional or {}
        required = {name: shape for name, shape in found.items() if name not in optional}
        if required != expected or any(found[name] != optional[name] for name in found.keys() & optional.keys()):
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
        path = self._path(block_hash, kind)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as error:  # a directory (or no permission): forgotten here, left to whoever made it
            log.warning("prefix cache spill: cannot remove %s (%s); it is no longer looked at", path, error)

    def _path(self, block_hash: bytes, kind: str) -> Path:
        return self.directory / f"{block_hash.hex()}.{kind}{SUFFIX}"


def _parse_name(name: str) -> tuple[bytes, str] | None:
    stem = name[:-len(SUFFIX)]
    hex_hash, _, kind = stem.partition(".")
    try:
        return (bytes.fromhex(hex_hash), kind) if kind in ("rows", "kda") else None
    except ValueError:
        return None


def read_regular_file(path: Path) -> bytes:
    """The bytes of a regular file, opened without following a link and without blocking (a FIFO would wait
    for a writer); OSError for anything else."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        with os.fdopen(os.dup(fd), "rb") as handle:
            return handle.read(info.st_size + 1)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)


def _header_metadata(data: bytes) -> dict:
    """The __metadata__ of a safetensors file's header (8 bytes little-endian length, then JSON)."""
    (length,) = struct.unpack("<Q", data[:8])
    if length > len(data) - 8:
        raise ValueError(f"header length {length} past the file's end")
    metadata = json.loads(data[8:8 + length]).get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError("__metadata__ is not an object")
    return metadata


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)
