"""MappedFiles.read copies a stored tensor in pieces under torch's parallel grain and blocks of rows, dropping
each block's mapped pages; its result must equal the plain twin (safetensors' own load_file, then a cast or a
transpose) on ragged shapes that cross the piece and block edges, and no page of the file may stay mapped.
docs/design.md §17.4."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from latentmoe_lab.interop import mapped_files
from latentmoe_lab.interop.mapped_files import MappedFiles

# ragged: neither rows nor elements divide the piece (PARALLEL_GRAIN) or the shrunk block below
SHAPES = {"matrix": (517, 1031), "wide": (3, 70001), "vector": (100003,), "small": (5, 7), "scalar": ()}


@pytest.fixture
def stored(tmp_path, monkeypatch):
    monkeypatch.setattr(mapped_files, "COPY_BLOCK_BYTES", 40000)  # many blocks per tensor
    g = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name, shape in SHAPES.items()}
    tensors["fp32"] = torch.randn(211, 389, generator=g)
    file = tmp_path / "model.safetensors"
    save_file(tensors, str(file))
    return file


def test_read_equals_the_plain_load(stored: Path):
    plain = load_file(str(stored))
    with MappedFiles([stored]) as mapped:
        for name, want in plain.items():
            assert torch.equal(mapped.read(name), want), name
        assert torch.equal(mapped.read("fp32", dtype=torch.bfloat16), plain["fp32"].to(torch.bfloat16))


def test_read_into_a_transposed_destination(stored: Path):
    """The expert layout (names.their_views): our [in, out] rows hold their [out, in] matrix transposed, here
    inside a wider row (the gate half of w13), with and without a cast."""
    plain = load_file(str(stored))
    with MappedFiles([stored]) as mapped:
        for name in ("matrix", "fp32"):
            rows, cols = plain[name].shape
            ours = torch.zeros(cols, 2 * rows, dtype=torch.bfloat16)
            mapped.read(name, out=ours[:, :rows].t())
            assert torch.equal(ours[:, :rows], plain[name].t().to(torch.bfloat16)), name
            assert not ours[:, rows:].any()


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_no_page_of_the_file_stays_mapped(stored: Path):
    """Reading out of file order (as a layer's gate then up weights are) leaves nothing mapped: each read ends by
    dropping the neighbours' pages that its faults mapped too (fault-around, large page-cache folios)."""
    with MappedFiles([stored]) as mapped:
        for name in reversed(list(mapped.stored)):
            mapped.read(name)
        assert _mapped_kb(stored) == 0


def _mapped_kb(file: Path) -> int:
    """Resident kB of this process's mappings of `file` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and not fields[0].endswith(":"):  # a mapping's header line: range perms offset dev inode [path]
            inside = fields[-1] == str(file)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total
