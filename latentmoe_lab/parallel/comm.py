"""Instrumented collectives: every byte the parallel runtime moves goes through `Comm` and is counted.

Counting convention ("payload bytes", what the planner predicts), per rank and per tag:
    all_to_all   rows this rank sends to *other* ranks x row bytes (the self chunk never leaves)
    all_reduce   the tensor's bytes (the wire cost of an algorithm, e.g. a ring's 2(n-1)/n, is
                 applied by the planner's time model, not here)
    all_gather   this rank's shard x (n - 1) receivers
    broadcast    the tensor x (n - 1) on the source, 0 elsewhere
    send         the tensor's bytes (recv counts nothing: the sender already did)
`sent_to[dst]` adds all_to_all and send bytes per destination rank: the token-traffic matrix.
With `timeline` set to a list, each collective also appends a CommEvent (op, tag, start, end, bytes),
times from time.perf_counter (CLOCK_MONOTONIC on Linux: one clock for every process of the machine);
an async collective ends when its PendingTensor is waited on. parallel/timeline.py reads them.

A failing collective (a dead peer closes the socket, or the group's timeout expires) is re-raised
as `CollectiveError` naming this rank, the collective, its tag and the group's ranks.
"""
from __future__ import annotations

import functools
import inspect
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function

from latentmoe_lab.parallel.mesh import ProcessMesh


class CollectiveError(RuntimeError):
    """A collective failed because a peer died or did not answer within the group timeout."""


@dataclass
class CommEvent:
    op: str
    tag: str
    start: float  # time.perf_counter() seconds
    end: float | None  # None until an async collective is waited on
    nbytes: int  # counted as the bytes counters count them (module docstring)


def _recorded(op: str):
    """Decorate a Comm collective: a `comm.<op>` profiler label, and a CommEvent when comm.timeline is a list."""
    def wrap(method):
        signature = inspect.signature(method)

        @functools.wraps(method)
        def run(self, *args, **kwargs):
            if getattr(self, "timeline", None) is None:  # also a Comm-like object without one
                with record_function(f"comm.{op}"):
                    return method(self, *args, **kwargs)
            tag = signature.bind(self, *args, **kwargs).arguments["tag"]
            counted, start = sum(self.bytes.values()), time.perf_counter()
            with record_function(f"comm.{op}"):
                result = method(self, *args, **kwargs)
            event = CommEvent(op, tag, start, time.perf_counter(), sum(self.bytes.values()) - counted)
            if isinstance(result, PendingTensor) and result._work is not None:
                event.end, result._event = None, event  # ends in wait()
            self.timeline.append(event)
            return result
        return run
    return wrap


class Comm:
    """Collectives along the mesh dimensions of `mesh`, with byte counters per tag."""

    def __init__(self, mesh: ProcessMesh):
        self.mesh = mesh
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.sent_to: Counter[int] = Counter()
        self.timeline: list[CommEvent] | None = None  # a list: every collective appends its CommEvent

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.sent_to.clear()

    def _count(self, tag: str, nbytes: int) -> None:
        self.bytes[tag] += int(nbytes)
        self.calls[tag] += 1

    def _fail(self, what: str, tag: str, ranks: Sequence[int], error: Exception):
        raise CollectiveError(f"rank {self.mesh.rank}: {what} '{tag}' with ranks {list(ranks)} failed "
                              f"(a peer died or timed out after {self.mesh.pconfig.timeout_s}s): {error}") from error

    # ------------------------------------------------------------------ group collectives
    @_recorded("all_reduce")
    def all_reduce(self, tensor: torch.Tensor, dim: str, tag: str) -> torch.Tensor:
        """Sum `tensor` in place over the `dim` group; returns it."""
        group = self.mesh.group(dim)
        if group is None:
            return tensor
        self._count(tag, _nbytes(tensor))
        try:
            dist.all_reduce(tensor, group=group)
        except Exception as error:  # noqa: BLE001 - re-raised with the rank and tag named
            self._fail("all_reduce", tag, self.mesh.members[dim], error)
        return tensor

    @_recorded("all_gather")
    def all_gather(self, tensor: torch.Tensor, dim: str, tag: str) -> torch.Tensor:
        """[n0, ...] on each of the n members -> [n * n0, ...], members in `dim` order."""
        group = self.mesh.group(dim)
        if group is None:
            return tensor
        size = self.mesh.size(dim)
        tensor = tensor.contiguous()
        out = tensor.new_empty(size * tensor.shape[0], *tensor.shape[1:])
        self._count(tag, _nbytes(tensor) * (size - 1))
        try:
            dist.all_gather_single(out, tensor, group=group)
        except Exception as error:  # noqa: BLE001
            self._fail("all_gather", tag, self.mesh.members[dim], error)
        return out

    @_recorded("broadcast")
    def broadcast(self, tensor: torch.Tensor, src_index: int, dim: str, tag: str) -> torch.Tensor:
        """Overwrite `tensor` with member `src_index`'s copy along `dim`; returns it."""
        group = self.mesh.group(dim)
        if group is None:
            return tensor
        if self.mesh.index(dim) == src_index:
            self._count(tag, _nbytes(tensor) * (self.mesh.size(dim) - 1))
        try:
            dist.broadcast(tensor, src=self.mesh.peer(dim, src_index), group=group)
        except Exception as error:  # noqa: BLE001
            self._fail("broadcast", tag, self.mesh.members[dim], error)
        return tensor

    @_recorded("all_to_all")
    def all_to_all(self, rows: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], dim: str,
                   tag: str, async_op: bool = False) -> "PendingTensor":
        """Send rows[sum(send_counts[:j]) : ...] to member j; receive recv_counts[j] rows from member j.

        rows: [sum(send_counts), ...]; the result is [sum(recv_counts), ...]. Uneven splits are fine.
        Returns a PendingTensor: `.wait()` gives the received rows (immediately when not async).
        """
        group = self.mesh.group(dim)
        if group is None:
            return PendingTensor(rows, None, self, "all_to_all", tag, [self.mesh.rank])
        send_counts, recv_counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        rows = rows.contiguous()
        row_bytes = rows.element_size() * _row_numel(rows)
        me = self.mesh.index(dim)
        members = self.mesh.members[dim]
        for j, count in enumerate(send_counts):
            if j != me:
                self.sent_to[members[j]] += count * row_bytes
        self._count(tag, (sum(send_counts) - send_counts[me]) * row_bytes)
        out = rows.new_empty(sum(recv_counts), *rows.shape[1:])
        try:
            work = dist.all_to_all_single(out, rows, recv_counts, send_counts, group=group, async_op=async_op)
        except Exception as error:  # noqa: BLE001
            self._fail("all_to_all", tag, members, error)
        return PendingTensor(out, work, self, "all_to_all", tag, members, keep_alive=rows)

    # ------------------------------------------------------------------ point to point
    @_recorded("send")
    def send(self, tensor: torch.Tensor, dst: int, tag: str) -> "PendingTensor":
        """Non-blocking send to global rank `dst`; wait() on the result before reusing `tensor`."""
        tensor = tensor.contiguous()
        self._count(tag, _nbytes(tensor))
        self.sent_to[dst] += _nbytes(tensor)
        try:
            work = dist.isend(tensor, dst)
        except Exception as error:  # noqa: BLE001
            self._fail(f"send to rank {dst}", tag, [self.mesh.rank, dst], error)
        return PendingTensor(tensor, work, self, f"send to rank {dst}", tag, [self.mesh.rank, dst])

    @_recorded("recv")
    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: str) -> torch.Tensor:
        """Blocking receive of a tensor of known shape and dtype from global rank `src`."""
        out = torch.empty(*shape, dtype=dtype, device=self.mesh.device)
        try:
            dist.recv(out, src)
        except Exception as error:  # noqa: BLE001
            self._fail(f"recv from rank {src}", tag, [src, self.mesh.rank], error)
        return out


class PendingTensor:
    """A tensor that is valid once `wait()` returns (the async work handle of a collective)."""

    def __init__(self, tensor, work, comm: Comm, what: str, tag: str, ranks: Sequence[int], keep_alive=None):
        self.tensor, self._work = tensor, work
        self._comm, self._what, self._tag, self._ranks = comm, what, tag, ranks
        self._keep_alive = keep_alive  # the send buffer of an async collective must outlive it
        self._event: CommEvent | None = None  # set by _recorded: its end is the moment wait() returns

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            try:
                self._work.wait()
            except Exception as error:  # noqa: BLE001
                self._comm._fail(self._what, self._tag, self._ranks, error)
            self._work = self._keep_alive = None
            if self._event is not None:
                self._event.end = time.perf_counter()
        return self.tensor


def _row_numel(rows: torch.Tensor) -> int:
    numel = 1
    for size in rows.shape[1:]:
        numel *= size
    return numel


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
