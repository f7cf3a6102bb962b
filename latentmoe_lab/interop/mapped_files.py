"""Read single tensors out of memory-mapped safetensors files, one owned copy each, without the mapping's pages
staying in the process.

safetensors' own safe_open maps a file and leaves every page a read touched resident in the process until the
handle closes, so loading a one-file model that way peaks at about twice its size (the mapped pages plus the
copies). Here each tensor is copied (and cast) out of the mapping straight into its destination, and the range
it came from is then dropped from the process with madvise(MADV_DONTNEED): the pages stay in the page cache,
which the kernel reclaims under pressure, and the peak resident set stays about one copy of the model
(docs/design.md §17).

The copy itself goes in pieces of at most PARALLEL_GRAIN elements. A larger copy_ hands its work to torch's
intra-op thread pool; on a busy machine waking the pool costs milliseconds per call, more than copying the
megabyte itself, and a load makes thousands of such calls (a 1.65 GB checkpoint with 2 threads: 10.5 of its
12.4 s; benchmarks/RESULTS.md, bench_load). Pieces under the grain run on the calling thread. Into a
transposed destination (names.their_views' expert stacks) the pieces are blocks of a few rows, whose writes
stay within a few cache lines per destination row.
"""
from __future__ import annotations

import mmap
import warnings
from pathlib import Path

import torch

from latentmoe_lab.checkpoint_integrity import SAFETENSORS_DTYPES, open_regular, read_safetensors_header

PAGE = mmap.PAGESIZE
COPY_BLOCK_BYTES = 8 << 20  # mapped bytes copied between two madvise calls
PARALLEL_GRAIN = 32768  # torch's at::internal::GRAIN_SIZE: a copy_ of more elements goes to the thread pool
# A page fault maps more than the page: Linux's fault-around (64 KB by default) and, on recent kernels, the
# whole large folio of the page cache that holds it (up to a PMD: 2 MB with 4 KB pages). Pages of the
# neighbouring tensors (or of this tensor's dropped blocks) get mapped that way, and a read out of file order (a
# layer's gate weights, then its up weights) would leave them mapped for good: ~30 MB per GB of checkpoint,
# measured. So a read ends by dropping its tensor's range widened by this much on either side.
NEIGHBOUR_BYTES = PAGE * (PAGE // 8)


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
        # process never exceed one block, whatever the tensor's size. A contiguous destination is one long row
        # of elements, so any piece of it is a slice.
        if out.is_contiguous():
            flat_out, flat_stored = out.view(-1), stored.reshape(-1)
        else:
            flat_out, flat_stored = (out, stored) if out.dim() else (out.view(1), stored.view(1))
        rows = flat_stored.shape[0]
        row_bytes = max(1, (end - begin) // rows)
        block_rows = max(1, COPY_BLOCK_BYTES // row_bytes)
        piece_rows = max(1, PARALLEL_GRAIN // max(1, flat_stored[0].numel()))
        for block in range(0, rows, block_rows):
            stop = min(rows, block + block_rows)
            for first in range(block, stop, piece_rows):
                last = min(stop, first + piece_rows)
                flat_out[first:last].copy_(flat_stored[first:last])
            _drop_pages(buffer, begin + block * row_bytes, begin + stop * row_bytes)
        _drop_pages(buffer, begin - NEIGHBOUR_BYTES, end + NEIGHBOUR_BYTES)
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


def _drop_pages(buffer: mmap.mmap, low: int, high: int) -> None:
    """Unmap bytes low:high of the mapping from this process, widened to whole pages and clipped to the file.
    The mapping is read-only, so a dropped page that is read again is simply faulted in again from the page
    cache."""
    low = max(0, low - low % PAGE)
    high = min(len(buffer), high)
    if high > low:
        buffer.madvise(mmap.MADV_DONTNEED, low, high - low)
