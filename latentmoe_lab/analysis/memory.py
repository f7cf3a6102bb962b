"""Peak tensor memory of a computation, counted from the storages its ops allocate.

    with PeakMemory() as memory:
        layer(x)
    memory.peak_bytes        # the most bytes of new tensor storage alive at once inside the block

Every op runs through a dispatch mode that registers the storages of its outputs that none of its
inputs owned (views and in-place results reuse an input's storage, so they allocate nothing) and
forgets storages that died. The count is what the computation needs at least: allocator caching and
scratch space inside a kernel are not seen. It works the same on CPU, CUDA and meta tensors; on the
meta device nothing is allocated, so it sizes runs that would not fit in memory.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakMemory(TorchDispatchMode):
    """Context manager: peak_bytes and current_bytes of tensor storage allocated inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage id -> (weak ref, bytes)
        self.peak_bytes = 0

    @property
    def current_bytes(self) -> int:
        """Bytes of the storages allocated inside the block that are still alive."""
        self._forget_dead()
        return sum(nbytes for _, nbytes in self._live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        owned_by_inputs = {StorageWeakRef(t.untyped_storage()).cdata
                           for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self._forget_dead()  # first, so a new storage at a freed address is not mistaken for the old one
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata not in owned_by_inputs:
                    self._live.setdefault(ref.cdata, (ref, storage.nbytes()))
        self.peak_bytes = max(self.peak_bytes, sum(nbytes for _, nbytes in self._live.values()))
        return out

    def _forget_dead(self) -> None:
        self._live = {key: entry for key, entry in self._live.items() if not entry[0].expired()}
