"""The training corpus: the running interpreter's own standard library, as byte tokens (docs/design.md §9).

Every machine with Python has it, so nothing is downloaded: the *.py files under sysconfig's "stdlib"
path (site-packages and dist-packages left out), each as

    "# file: <path relative to the stdlib>\\n" + source + "\\n"

encoded into the package byte tokenizer's ids (id = UTF-8 byte, tokenizer.py; computed with one
frombuffer per file, as ByteTokenizer.encode's Python list is ~10x slower on 31 MB; a test checks the
two agree) and concatenated in sorted path order. A file goes to the
held-out split when the SHA-256 of its relative path falls in the lowest `held_out_fraction` of the hash
range: the split depends on the name only, never on the order of a directory listing or on a seed.
Both splits are then packed into fixed-length rows [S, seq_len] (the tail that fills no row is dropped).

`batch_rows(step, ...)` says which rows make up the global batch of a training step: a fresh seeded
permutation per pass over the data, so a step number alone fixes the data position (resume needs nothing
else), and rank r of n takes the r-th contiguous slice of the global batch.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from latentmoe_lab.tokenizer import NUM_BYTES

EXCLUDED_DIRS = ("site-packages", "dist-packages")


def stdlib_root() -> Path:
    """The standard-library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str, fraction: float) -> bool:
    """True for about `fraction` of all paths, chosen by the SHA-256 of the path (stable across machines)."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def encode(text: str) -> torch.Tensor:
    """text -> uint8 byte tokens [N]: ByteTokenizer(vocab).encode(text)[0], without the Python list."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def source_files(root: Path) -> list[Path]:
    """*.py under root, sorted by relative path, without anything below site-packages / dist-packages."""
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS]  # never walk the installed packages
        files += [Path(directory) / name for name in names if name.endswith(".py")]
    return sorted((path for path in files if path.is_file()), key=lambda path: path.relative_to(root).as_posix())


@dataclass(frozen=True)
class Corpus:
    """train / held_out: uint8 byte tokens [N]; the file lists are relative posix paths."""

    root: str
    train: torch.Tensor
    held_out: torch.Tensor
    train_files: tuple[str, ...]
    held_out_files: tuple[str, ...]

    def digest(self) -> str:
        """The first 12 hex digits of the SHA-256 of both splits' bytes: equal digests, equal training data.
        The standard library differs between Python versions and builds, and so does a model trained on it."""
        sha = hashlib.sha256(self.train.numpy().tobytes())
        sha.update(self.held_out.numpy().tobytes())
        return sha.hexdigest()[:12]

    def summary(self) -> str:
        files = len(self.train_files) + len(self.held_out_files)
        total = self.train.numel() + self.held_out.numel()
        return (f"corpus: {files} files, {total:,} bytes from {self.root} (sha256 {self.digest()}); train "
                f"{len(self.train_files)} files {self.train.numel():,} bytes, held-out {len(self.held_out_files)} "
                f"files {self.held_out.numel():,} bytes")


def load_corpus(root: str | Path | None = None, held_out_fraction: float = 0.02, verbose: bool = True) -> Corpus:
    """Read, tokenize and split the *.py files under `root` (default: this interpreter's stdlib)."""
    if not isinstance(held_out_fraction, (int, float)) or not 0 < held_out_fraction < 1:
        raise ValueError(f"held_out_fraction: must lie in (0, 1), got {held_out_fraction!r}")
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise ValueError(f"root: {root} is not a directory")
    pieces: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    names: dict[bool, list[str]] = {False: [], True: []}
    for path in source_files(root):
        relative = path.relative_to(root).as_posix()
        # Undecodable bytes (a latin-1 test file) become U+FFFD: the tokenizer takes text, not raw bytes.
        text = f"# file: {relative}\n" + path.read_bytes().decode("utf-8", errors="replace") + "\n"
        held = is_held_out(relative, held_out_fraction)
        pieces[held].append(encode(text))
        names[held].append(relative)
    if not names[False] or not names[True]:
        raise ValueError(f"root: {root} gives {len(names[False])} training and {len(names[True])} held-out files; "
                         f"both splits need at least one *.py file")
    corpus = Corpus(root=str(root), train=torch.cat(pieces[False]), held_out=torch.cat(pieces[True]),
                    train_files=tuple(names[False]), held_out_files=tuple(names[True]))
    if verbose:
        print(corpus.summary(), flush=True)
    return corpus


def pack(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """tokens [N] -> rows [N // seq_len, seq_len] (a view; the remainder is dropped)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len: must be an integer >= 2 (a row needs an input and a target), got {seq_len!r}")
    rows = tokens.numel() // seq_len
    if rows == 0:
        raise ValueError(f"seq_len: {seq_len} is longer than the {tokens.numel()} tokens to pack")
    return tokens[: rows * seq_len].view(rows, seq_len)


def batch_rows(step: int, global_batch: int, num_rows: int, seed: int, rank: int = 0, world: int = 1) -> torch.Tensor:
    """Row indices [global_batch // world] that rank `rank` trains on at `step` (0-based).

    The global batch of step s is positions s*B .. s*B + B - 1 of an endless stream that walks a fresh
    permutation of the rows (seeded by seed and the pass number) on every pass.
    """
    if global_batch % world:
        raise ValueError(f"global_batch: {global_batch} must be divisible by the {world} processes")
    per_rank = global_batch // world
    positions = torch.arange(step * global_batch + rank * per_rank, step * global_batch + (rank + 1) * per_rank)
    passes = positions // num_rows
    rows = torch.empty_like(positions)
    for epoch in passes.unique().tolist():
        order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        mask = passes == epoch
        rows[mask] = order[positions[mask] % num_rows]
    return rows
