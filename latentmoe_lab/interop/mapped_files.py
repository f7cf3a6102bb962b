"""Read single tensors out of memory-mapped safetensors files, one owned copy each, without the mapping's pages
staying in the process.

safetensors' own safe_open maps a file and leaves every page a read touched resident in the process until the
handle closes, so loading a one-file model that way peaks at about twice its size (the mapped pages plus the
copies). Here each tensor is copied (and cast) out of the mapping straight into its destination, and the range
it came from is then dropped from the process with madvise(MADV_DONTNEED): the pages stay in the page cache,
which the kernel reclaims under pressure, and the peak resident set stays about one copy of the model
(docs/design.md §17).
"""
from __future__ import annotations

import mmap
import warnings
from pathlib import Path

import torch

from latentmoe_lab.checkpoint_integrity import SAFETENSORS_DTYPES, open_regular, read_safetensors_header

PAGE = mmap.PAGESIZE
COPY_BLOCK_BYTES = 8 << 20  # mapped bytes copied between two madvise calls


class MappedFiles:
    """The tensors of several safetensors files by name. stored: {name: (file, header entry)}.

    read(name, dtype) -> a new contiguous CPU tensor of the stored shape in `dtype`. Use as a context manager
    (or call close()) so the mappings are released.
    """

    def __init__(self, files: list[Path]):
        self._maps: dict[Path, tuple[mmap.mmap, int]] = {}
        self.stored: dict[str, tuple[Path, dict]] = {}
        try:
            for file in files:
                header = read_safetensors_header(file)
                with open_regular(file) as handle:
                    data_start = 8 + int.from_bytes(handle.read(8), "little")
                    self._maps[file] = (mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ), data_start)
                for name, entry in header.items():
                    if name != "__metadata__":
                        if name in self.stored:
                            raise ValueError(f"checkpoint file {file}: tensor {name!r} is also stored in "
                                             f"{self.stored[name][0]}")
                        self.stored[name] = (file, entry)
        except BaseException:
            self.close()
            raise

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.stored[name][1]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return SAFETENSORS_DTYPES[self.stored[name][1]["dtype"]]

    def nbytes(self, name: str) -> int:
        begin, end = self.stored[name][1]["data_offsets"]
        return end - begin

    def read(self, name: str, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name` as a new tensor in `dtype` (default: as stored), or copied into `out` (same shape)."""
        file, entry = self.stored[name]
        buffer, data_start = self._maps[file]
        begin, end = (data_start + offset for offset in entry["data_offsets"])
        stored_dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        shape = tuple(entry["shape"])
        if out is None:
            out = torch.empty(shape, dtype=dtype or stored_dtype)
        if end == begin:
            return out
        with warnings.catch_warnings():  # the view is only read from, never written
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            stored = torch.frombuffer(buffer, dtype=stored_dtype, count=(end - begin) // stored_dtype.itemsize,
                                      offset=begin).view(shape)
        # copy a block of leading rows at a time and drop its pages at once: the mapped pages resident in the
        # process never exceed one block, whatever the tensor's size
        flat_out, flat_stored = (out, stored) if out.dim() else (out.view(1), stored.view(1))
        row_bytes = max(1, (end - begin) // flat_stored.shape[0])
        rows = max(1, COPY_BLOCK_BYTES // row_bytes)
        for first in range(0, flat_stored.shape[0], rows):
            flat_out[first:first + rows].copy_(flat_stored[first:first + rows])
            low = begin + first * row_bytes
            high = min(end, low + rows * row_bytes)
            buffer.madvise(mmap.MADV_DONTNEED, low - low % PAGE, high - (low - low % PAGE))
        del stored, flat_stored
        return out

    def close(self) -> None:
        for buffer, _ in self._maps.values():
            try:
                buffer.close()
            except BufferError:  # a view of it is still alive somewhere; the mapping goes when that does
                pass
        self._maps.clear()

    def __enter__(self) -> "MappedFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
